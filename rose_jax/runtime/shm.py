"""Host shared memory for array exchange: named segments, one per message, always unlinked.

A segment holds several arrays back to back (64-byte aligned). The *driver* owns every segment
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


def write(name: str, arrays: Sequence[np.ndarray]) -> list[int]:
    """Create segment ``name`` holding ``arrays``; return their offsets. The segment stays until unlinked."""
    offsets, size = layout([a.nbytes for a in arrays])
    free = free_bytes()
    if free is not None and size > free:
        raise ExchangeError(
            f"/dev/shm has {free / 2**20:.1f} MiB free but segment {name} needs {size / 2**20:.1f} MiB: "
            "enlarge /dev/shm (e.g. docker --shm-size) or exchange on the GPU (transport='cuda_ipc')"
        )
    seg = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        for a, off in zip(arrays, offsets, strict=True):
            if a.dtype.hasobject:
                raise ExchangeError(f"cannot place an object-dtype array in shared memory (dtype {a.dtype})")
            dst = np.ndarray(a.shape, a.dtype, buffer=seg.buf, offset=off)
            np.copyto(dst, a, casting="no")
            del dst
    finally:
        seg.close()
    return offsets


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
