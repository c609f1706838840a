"""Same-GPU array exchange through CUDA IPC (cupy), with jax <-> cupy through DLPack.

Two ways. A channel's persistent staging buffers (:class:`Staging` on the sending side,
:class:`Mapping` on the receiving side): the sender allocates a buffer once (a larger one when a
message does not fit), copies the arrays in on a stream of its own and records an interprocess
CUDA event after the copies; the receiver opens the buffer's IPC handle and the event's once,
waits for that event only (not for the whole device) and copies the arrays out. The sender
reuses the buffer only after the receiver has answered (the runtime's grant), so a message is
never overwritten while it is read. One-off exports (below) remain for messages sent while
another one is in flight.

One-off export: the arrays are copied (device to device) into one staging buffer allocated with
``cudaMalloc`` (a whole allocation, so its ``cudaIpcGetMemHandle`` is valid; XLA's own buffers
are sub-allocations of a pool), the device is synchronised, and the 64-byte handle is sent. The
exporter frees the staging buffer once the importer says it is done.
Import: ``cudaIpcOpenMemHandle``, a cupy view per array, ``jax.dlpack.from_dlpack`` and a copy
into memory owned by the importer's XLA client, then ``cudaIpcCloseMemHandle``. dtypes cupy does
not know (bfloat16, float8) travel as unsigned integers of the same width and are bitcast back.

Nothing here imports cupy or touches CUDA until it is called: ``probe()`` says whether it can work.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

IPC_ALIGN = 256
_CUPY_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
)
_UINT_OF_SIZE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


@dataclasses.dataclass(frozen=True)
class IpcSupport:
    """Whether this process can exchange through CUDA IPC; device = PCI bus id of its GPU."""

    available: bool
    reason: str
    device: str | None = None


@dataclasses.dataclass(frozen=True)
class IpcBlock:
    """An exported staging buffer: IPC handle, size in bytes, PCI bus id of its GPU."""

    handle: bytes
    size: int
    device: str


def probe(jax_backend: str | None = None) -> IpcSupport:
    """Can this process use CUDA IPC? jax_backend: the process's JAX backend if already known."""
    if jax_backend is not None and jax_backend not in ("gpu", "cuda"):
        return IpcSupport(False, f"JAX backend is {jax_backend!r}, not a CUDA GPU")
    try:
        import cupy as cp
    except Exception as e:  # ImportError, or a cupy build that cannot load its CUDA libraries
        return IpcSupport(False, f"cupy not importable ({type(e).__name__}: {e})")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        return IpcSupport(False, f"cupy sees no CUDA device ({type(e).__name__}: {e})")
    if n < 1:
        return IpcSupport(False, "cupy sees no CUDA device")
    try:
        bus = _pci_bus_id(cp, cp.cuda.runtime.getDevice())
    except Exception as e:
        return IpcSupport(False, f"cannot read the GPU's PCI bus id ({type(e).__name__}: {e})")
    return IpcSupport(True, f"cupy {cp.__version__} on GPU {bus}", bus)


def _pci_bus_id(cp, device: int) -> str:
    try:
        return str(cp.cuda.Device(device).pci_bus_id).lower()
    except Exception:
        p = cp.cuda.runtime.getDeviceProperties(device)
        return f"{p['pciDomainID']:04x}:{p['pciBusID']:02x}:{p['pciDeviceID']:02x}.0"


def on_gpu(x: Any) -> bool:
    """True for a jax.Array that lives on exactly one CUDA device."""
    devices = getattr(x, "devices", None)
    if devices is None or not callable(devices):
        return False
    try:
        ds = list(devices())
    except Exception:
        return False
    return len(ds) == 1 and ds[0].platform in ("gpu", "cuda")


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for n in nbytes:
        offsets.append(pos)
        pos += (int(n) + IPC_ALIGN - 1) // IPC_ALIGN * IPC_ALIGN
    return offsets, max(pos, IPC_ALIGN)


def _device_pointer(cp, x) -> tuple[int, object]:
    """(device pointer of x's data, object to keep alive until the copy is done).

    Through DLPack (``cupy.from_dlpack``); dtypes cupy lacks are first bitcast to unsigned ints
    of the same width (a new buffer, kept alive by the returned object). Falls back to
    ``jax.Array.unsafe_buffer_pointer`` if the DLPack exchange is refused.
    """
    import jax

    dt = np.dtype(x.dtype)
    try:
        src = x if dt in _CUPY_DTYPES else jax.lax.bitcast_convert_type(x, _UINT_OF_SIZE[dt.itemsize])
        view = cp.from_dlpack(src)
        return int(view.data.ptr), (src, view)
    except Exception:
        return int(x.unsafe_buffer_pointer()), x


def export(arrays: Sequence[Any]) -> tuple[IpcBlock, int, list[int]]:
    """Copy jax GPU arrays into one IPC-exportable buffer: (block, device pointer to free, offsets)."""
    import cupy as cp
    import jax

    jax.block_until_ready(list(arrays))
    nbytes = [int(np.dtype(a.dtype).itemsize * math.prod(a.shape)) for a in arrays]
    offsets, size = layout(nbytes)
    device = cp.cuda.runtime.getDevice()
    ptr = cp.cuda.runtime.malloc(size)
    keep = []  # sources stay alive until the (host-asynchronous) device-to-device copies are done
    try:
        for a, off, n in zip(arrays, offsets, nbytes, strict=True):
            if n == 0:
                continue
            src_ptr, owner = _device_pointer(cp, a)
            keep.append(owner)
            cp.cuda.runtime.memcpy(ptr + off, src_ptr, n, cp.cuda.runtime.memcpyDeviceToDevice)
        cp.cuda.runtime.deviceSynchronize()
        del keep
        handle = cp.cuda.runtime.ipcGetMemHandle(ptr)
    except BaseException:
        cp.cuda.runtime.free(ptr)
        raise
    return IpcBlock(bytes(handle), size, _pci_bus_id(cp, device)), ptr, offsets


def free(ptr: int) -> None:
    import cupy as cp

    cp.cuda.runtime.free(ptr)


def import_arrays(block: IpcBlock, refs: Sequence[tuple[int, tuple[int, ...], np.dtype]]) -> list[Any]:
    """Copies (owned by this process's JAX client) of the arrays (offset, shape, dtype) in block."""
    import cupy as cp

    ptr = cp.cuda.runtime.ipcOpenMemHandle(block.handle)
    try:
        return _copies(cp, ptr, refs)
    finally:
        cp.cuda.runtime.ipcCloseMemHandle(ptr)


def _copies(cp, ptr: int, refs) -> list[Any]:
    """jax copies of the arrays ``(offset, shape, dtype)`` at device pointer ``ptr`` (waited for)."""
    import jax
    import jax.numpy as jnp

    out = []
    for off, shape, dtype in refs:
        dtype = np.dtype(dtype)
        n = dtype.itemsize * math.prod(shape)
        if n == 0:
            out.append(jnp.zeros(shape, dtype))
            continue
        native = dtype in _CUPY_DTYPES
        mem = cp.cuda.UnownedMemory(ptr + off, n, None)
        view = cp.ndarray(
            shape,
            dtype=dtype if native else _UINT_OF_SIZE[dtype.itemsize],
            memptr=cp.cuda.MemoryPointer(mem, 0),
        )
        x = jax.dlpack.from_dlpack(view)
        x = jnp.array(x, copy=True) if native else jax.lax.bitcast_convert_type(x, dtype)
        out.append(x)
        del view, mem
    jax.block_until_ready(out)
    return out


# ---------------------------------------------------------------- persistent staging buffers

_EVENT_DISABLE_TIMING, _EVENT_INTERPROCESS, _STREAM_NON_BLOCKING = 0x2, 0x4, 0x1


@dataclasses.dataclass(frozen=True)
class StagedBlock:
    """A message in a persistent staging buffer: the buffer's IPC handle and size, its GPU, and
    the IPC handle of the event recorded after the copies (None: the sender synchronised its
    copy stream before sending)."""

    handle: bytes
    size: int
    device: str
    event: bytes | None


class Staging:
    """The sending side's persistent device staging buffer of one channel (see the module docstring).

    ``write(arrays)`` copies jax GPU arrays into the buffer and returns ``(StagedBlock, offsets)``.
    A buffer replaced by a larger one is freed at the next ``write`` (by then the receiver has
    closed its mapping of it); ``close`` frees everything."""

    def __init__(self):
        self._ptr, self._size, self._handle = None, 0, None
        self._retired: list[int] = []
        self._stream = self._event = self._event_handle = None
        self._keep: list = []
        self.events = True  # False once interprocess events failed: stream synchronisation instead
        self.allocations = 0

    def _setup(self, cp) -> None:
        if self._stream is not None:
            return
        self._stream = cp.cuda.runtime.streamCreateWithFlags(_STREAM_NON_BLOCKING)
        try:
            self._event = cp.cuda.runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING | _EVENT_INTERPROCESS)
            self._event_handle = bytes(cp.cuda.runtime.ipcGetEventHandle(self._event))
        except Exception:  # e.g. no interprocess events here: the sender waits for its copies itself
            self.events, self._event, self._event_handle = False, None, None

    def write(self, arrays: Sequence[Any]) -> tuple[StagedBlock, list[int]]:
        import cupy as cp
        import jax

        self._setup(cp)
        if self._event is not None:
            cp.cuda.runtime.eventSynchronize(self._event)  # the previous message's copies (done long ago)
        self._keep = []
        for ptr in self._retired:
            cp.cuda.runtime.free(ptr)
        self._retired = []
        nbytes = [int(np.dtype(a.dtype).itemsize * math.prod(a.shape)) for a in arrays]
        offsets, size = layout(nbytes)
        if size > self._size:
            if self._ptr is not None:
                self._retired.append(self._ptr)
            self._ptr, self._size = None, 0
            self._ptr = cp.cuda.runtime.malloc(size)
            self._size = size
            self._handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._ptr))
            self.allocations += 1
        jax.block_until_ready(list(arrays))  # written by XLA on its own stream
        for a, off, n in zip(arrays, offsets, nbytes, strict=True):
            if n == 0:
                continue
            src_ptr, owner = _device_pointer(cp, a)
            self._keep.append(owner)  # alive until the copy is done (next write)
            cp.cuda.runtime.memcpyAsync(
                self._ptr + off, src_ptr, n, cp.cuda.runtime.memcpyDeviceToDevice, self._stream
            )
        if self._event is not None:
            cp.cuda.runtime.eventRecord(self._event, self._stream)
        else:
            cp.cuda.runtime.streamSynchronize(self._stream)
        device = _pci_bus_id(cp, cp.cuda.runtime.getDevice())
        return StagedBlock(self._handle, self._size, device, self._event_handle), offsets

    def close(self) -> None:
        import cupy as cp

        try:
            if self._stream is not None:
                cp.cuda.runtime.streamSynchronize(self._stream)
            for ptr in self._retired + ([self._ptr] if self._ptr is not None else []):
                cp.cuda.runtime.free(ptr)
            if self._event is not None:
                cp.cuda.runtime.eventDestroy(self._event)
            if self._stream is not None:
                cp.cuda.runtime.streamDestroy(self._stream)
        finally:
            self._ptr, self._size, self._retired, self._keep = None, 0, [], []
            self._stream = self._event = self._event_handle = None


class Mapping:
    """The receiving side's mapping of a sender's :class:`Staging` buffer: each buffer handle and
    event handle is opened once (a new buffer closes the mapping of the old one)."""

    def __init__(self):
        self._handle, self._ptr = None, None
        self._events: dict[bytes, int] = {}
        self.opens = 0

    def read(self, block: StagedBlock, refs: Sequence[tuple[int, tuple[int, ...], np.dtype]]) -> list[Any]:
        """Copies (owned by this process's JAX client) of the arrays ``(offset, shape, dtype)``."""
        import cupy as cp

        if block.handle != self._handle:
            self._close_buffer(cp)
            self._ptr = cp.cuda.runtime.ipcOpenMemHandle(block.handle)
            self._handle = block.handle
            self.opens += 1
        if block.event is not None:
            ev = self._events.get(block.event)
            if ev is None:
                ev = self._events[block.event] = cp.cuda.runtime.ipcOpenEventHandle(block.event)
            cp.cuda.runtime.eventSynchronize(ev)
        return _copies(cp, self._ptr, refs)

    def _close_buffer(self, cp) -> None:
        if self._ptr is not None:
            ptr, self._ptr, self._handle = self._ptr, None, None
            cp.cuda.runtime.ipcCloseMemHandle(ptr)

    def close(self) -> None:
        import cupy as cp

        try:
            self._close_buffer(cp)
            for ev in self._events.values():
                cp.cuda.runtime.eventDestroy(ev)
        finally:
            self._events = {}
