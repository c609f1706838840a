"""Packing pytrees of arrays into messages between driver and workers.

``encode`` replaces each array leaf of a pytree by a reference: small arrays (<= inline_limit
bytes) travel inline in the pickled message; large host arrays go into one host shared-memory
segment (``HostRef``); with ``use_ipc``, single-device jax arrays on a CUDA GPU go into one
CUDA-IPC staging buffer (``DeviceRef``). Non-array leaves (Python scalars, strings) are pickled
as they are. ``decode`` rebuilds the pytree: on a worker (``to="jax"``) every array becomes a
jax.Array on the worker's default device; on the driver (``to="numpy"``) host arrays become
numpy arrays and GPU arrays become jax.Arrays on the driver's GPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from rose_jax.runtime import cuda_ipc, shm
from rose_jax.runtime.errors import ExchangeError

DEFAULT_INLINE_LIMIT = 1 << 16  # bytes


@dataclasses.dataclass(frozen=True)
class HostRef:
    """An array in the message's shared-memory segment: byte offset, shape, dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class DeviceRef:
    """An array in the message's CUDA-IPC staging buffer: byte offset, shape, dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Packet:
    """A pytree with array leaves replaced by references, plus where the data lies (bytes per path)."""

    tree: Any
    shm_name: str | None = None
    ipc: cuda_ipc.IpcBlock | None = None
    shm_bytes: int = 0
    ipc_bytes: int = 0
    inline_bytes: int = 0


@dataclasses.dataclass
class Outbound:
    """What the sender must release once the receiver is done: a segment name, an IPC buffer."""

    shm_name: str | None = None
    ipc_ptr: int | None = None

    def release(self) -> None:
        if self.shm_name is not None:
            shm.unlink(self.shm_name)
            self.shm_name = None
        if self.ipc_ptr is not None:
            ptr, self.ipc_ptr = self.ipc_ptr, None
            cuda_ipc.free(ptr)


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array))


def encode(
    tree: Any, *, shm_name: str, use_ipc: bool, inline_limit: int = DEFAULT_INLINE_LIMIT
) -> tuple[Packet, Outbound]:
    """Pack tree; shm_name is used only if some array goes through host shared memory."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out: list[Any] = list(leaves)
    host_idx, host_arrays, dev_idx, dev_arrays = [], [], [], []
    inline = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise ExchangeError(
                f"leaf {i} is a typed PRNG key array: send jax.random.key_data(key) and rebuild it with "
                "jax.random.wrap_key_data on the other side"
            )
        if use_ipc and isinstance(leaf, jax.Array) and cuda_ipc.on_gpu(leaf):
            dev_idx.append(i)
            dev_arrays.append(leaf)
        elif _is_array(leaf):
            a = np.asarray(leaf)
            if a.dtype.hasobject:
                raise ExchangeError(
                    f"leaf {i} is an object-dtype array; only numeric arrays can be exchanged"
                )
            if a.nbytes <= inline_limit:
                out[i] = np.array(a, copy=True)
                inline += a.nbytes
            else:
                host_idx.append(i)
                host_arrays.append(a)
    outbound = Outbound()
    packet_kw: dict[str, Any] = {}
    try:
        if host_arrays:
            offsets = shm.write(shm_name, host_arrays)
            outbound.shm_name = shm_name
            for i, a, off in zip(host_idx, host_arrays, offsets, strict=True):
                out[i] = HostRef(off, tuple(a.shape), a.dtype)
            packet_kw.update(shm_name=shm_name, shm_bytes=sum(a.nbytes for a in host_arrays))
        if dev_arrays:
            block, ptr, offsets = cuda_ipc.export(dev_arrays)
            outbound.ipc_ptr = ptr
            for i, a, off in zip(dev_idx, dev_arrays, offsets, strict=True):
                out[i] = DeviceRef(off, tuple(a.shape), np.dtype(a.dtype))
            packet_kw.update(ipc=block, ipc_bytes=sum(a.nbytes for a in dev_arrays))
    except BaseException:
        outbound.release()
        raise
    return Packet(jax.tree_util.tree_unflatten(treedef, out), inline_bytes=inline, **packet_kw), outbound


def decode(packet: Packet, *, to: str) -> Any:
    """Rebuild the pytree; to="jax" (worker: arrays on the default device) or "numpy" (driver)."""
    if to not in ("jax", "numpy"):
        raise ValueError(f"decode target must be 'jax' or 'numpy', got {to!r}")
    leaves, treedef = jax.tree_util.tree_flatten(packet.tree)
    out = list(leaves)
    host = [(i, r) for i, r in enumerate(leaves) if isinstance(r, HostRef)]
    dev = [(i, r) for i, r in enumerate(leaves) if isinstance(r, DeviceRef)]
    if host:
        if packet.shm_name is None:
            raise ExchangeError("packet has shared-memory references but no segment name")
        refs = [(r.offset, r.shape, r.dtype) for _, r in host]
        if to == "numpy":
            arrays = shm.read(packet.shm_name, refs)
        else:
            arrays = _host_to_device(packet.shm_name, refs)
        for (i, _), a in zip(host, arrays, strict=True):
            out[i] = a
    if dev:
        if packet.ipc is None:
            raise ExchangeError("packet has CUDA-IPC references but no IPC block")
        arrays = cuda_ipc.import_arrays(packet.ipc, [(r.offset, r.shape, r.dtype) for _, r in dev])
        for (i, _), a in zip(dev, arrays, strict=True):
            out[i] = a
    if to == "jax":
        for i, leaf in enumerate(out):
            if isinstance(leaf, (np.ndarray, np.generic)):
                out[i] = jax.device_put(np.array(leaf, copy=True))
    return jax.tree_util.tree_unflatten(treedef, out)


def _host_to_device(name: str, refs) -> list[jax.Array]:
    on_cpu = jax.default_backend() == "cpu"
    with shm.mapped(name) as buf:
        arrays = []
        for off, shape, dtype in refs:
            v = shm.view(buf, off, shape, dtype)
            # The CPU client may alias a host buffer instead of copying it: copy out of the segment.
            arrays.append(jax.device_put(np.array(v, copy=True) if on_cpu else v))
            del v
        jax.block_until_ready(arrays)
    return arrays


def nbytes(tree: Any) -> int:
    """Total bytes of the array leaves of tree."""
    return sum(
        int(np.dtype(x.dtype).itemsize * math.prod(x.shape))
        for x in jax.tree_util.tree_leaves(tree)
        if _is_array(x)
    )
