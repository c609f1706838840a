"""Host shared memory for array exchange: named segments, always unlinked by their owner.

A segment holds several arrays back to back (64-byte aligned). A one-off segment carries one
message (:func:`write`, :func:`read`); a :class:`Segment` stays mapped for many (a persistent
staging buffer of a channel, or the receiver's mapping of one). The *driver* owns every segment
name (it picks the names, including those of segments a worker creates for its outputs), so it
can unlink all of them, also when a worker dies mid-call. Python's resource tracker, shared by
the driver and its spawned workers, is kept balanced: every unlink goes through
``SharedMemory.unlink``.
"""

from __future__ import annotations

import contextlib
import os
from multiprocessing import shared_memory
from typing import Iterator, Sequence

import numpy as np

from rose_jax.runtime.errors import ExchangeError

ALIGN = 64
SHM_DIR = "/dev/shm"


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of arrays of the given sizes in one segment, and the segment size (bytes)."""
    offsets, pos = [], 0
    for n in nbytes:
        offsets.append(pos)
        pos += aligned(int(n))
    return offsets, max(pos, 1)


def free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where that cannot be told."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _check_free(name: str, size: int) -> None:
    free = free_bytes()
    if free is not None and size > free:
        raise ExchangeError(
            f"/dev/shm has {free / 2**20:.1f} MiB free but segment {name} needs {size / 2**20:.1f} MiB: "
            "enlarge /dev/shm (e.g. docker --shm-size) or exchange on the GPU (transport='cuda_ipc')"
        )


def _fill(buf: memoryview, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    for a, off in zip(arrays, offsets, strict=True):
        if a.dtype.hasobject:
            raise ExchangeError(f"cannot place an object-dtype array in shared memory (dtype {a.dtype})")
        dst = np.ndarray(a.shape, a.dtype, buffer=buf, offset=off)
        np.copyto(dst, a, casting="no")
        del dst


def write(name: str, arrays: Sequence[np.ndarray]) -> list[int]:
    """Create segment ``name`` holding ``arrays``; return their offsets. The segment stays until unlinked."""
    offsets, size = layout([a.nbytes for a in arrays])
    _check_free(name, size)
    seg = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        _fill(seg.buf, arrays, offsets)
    finally:
        seg.close()
    return offsets


class Segment:
    """A shared-memory segment mapped once and kept: ``Segment.create(name, size)`` by its owner
    (a persistent staging buffer), ``Segment(name)`` by a receiver. ``size`` is in bytes."""

    def __init__(self, name: str, *, _create_size: int | None = None):
        create = _create_size is not None
        self._seg = shared_memory.SharedMemory(name=name, create=create, size=_create_size or 0)
        self.name, self.size, self.owner = name, self._seg.size, create

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        _check_free(name, size)
        return cls(name, _create_size=max(int(size), 1))

    def write(self, arrays: Sequence[np.ndarray]) -> list[int]:
        """Place ``arrays`` back to back; return their offsets (they must fit: see ``layout``)."""
        offsets, size = layout([a.nbytes for a in arrays])
        if size > self.size:
            raise ExchangeError(f"segment {self.name} holds {self.size} bytes, the message needs {size}")
        _fill(self._seg.buf, arrays, offsets)
        return offsets

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A view into the mapping: valid until the sender writes its next message."""
        return np.ndarray(shape, dtype, buffer=self._seg.buf, offset=offset)

    def read(self, refs: Sequence[tuple[int, tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        """Copies of the arrays ``(offset, shape, dtype)``."""
        return [np.array(self.view(*r), copy=True) for r in refs]

    def close(self) -> None:
        """Unmap (and, for the owner, unlink) the segment; idempotent."""
        seg, self._seg = self._seg, None
        if seg is None:
            return
        try:
            seg.close()
        except BufferError:  # a view still alive: the mapping goes with its last view
            pass
        if self.owner:
            try:
                seg.unlink()
            except FileNotFoundError:
                pass


@contextlib.contextmanager
def mapped(name: str) -> Iterator[memoryview]:
    """Map segment ``name`` for reading; views made from the buffer must not outlive the block."""
    seg = shared_memory.SharedMemory(name=name, create=False)
    try:
        yield seg.buf
    finally:
        try:
            seg.close()
        except BufferError:
            # A consumer still holds a view (e.g. a transfer keeps the host buffer): the mapping
            # goes away with the last view; the segment itself is unlinked by its owner.
            pass


def view(buf: memoryview, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.ndarray(shape, dtype, buffer=buf, offset=offset)


def read(name: str, refs: Sequence[tuple[int, tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Copies of the arrays (offset, shape, dtype) in segment ``name``."""
    with mapped(name) as buf:
        return [np.array(view(buf, off, shape, dtype), copy=True) for off, shape, dtype in refs]


def unlink(name: str) -> bool:
    """Unlink segment ``name``; False if it did not exist."""
    try:
        seg = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return False
    seg.close()
    try:
        seg.unlink()
    except FileNotFoundError:
        return False
    return True


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment in /dev/shm whose name starts with prefix (Linux); return the names."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []
    return [n for n in names if unlink(n)]
