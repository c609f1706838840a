"""Packing pytrees of arrays into messages between driver and workers.

``encode`` replaces each array leaf of a pytree by a reference: small arrays (<= inline_limit
bytes) travel inline in the pickled message; large host arrays go into one host shared-memory
segment (``HostRef``); with ``use_ipc``, single-device jax arrays on a CUDA GPU go into one
CUDA-IPC staging buffer (``DeviceRef``). Non-array leaves (Python scalars, strings) are pickled
as they are. ``decode`` rebuilds the pytree: on a worker (``to="jax"``) every array becomes a
jax.Array on the worker's default device; on the driver (``to="numpy"``) host arrays become
numpy arrays and GPU arrays become jax.Arrays on the driver's GPU.

Where the large arrays go. With a one-off name (a ``str``) a message gets its own shared-memory
segment (and its own CUDA-IPC buffer), which the sender releases once the receiver is done:
create, map, unmap and unlink for every message. With a :class:`Staged` name (a grant: the
receiver has answered everything sent before) the message goes into the :class:`Channel`'s
persistent staging buffers instead, mapped once by each side and grown when a message does not
fit; nothing is created, opened or released per message.
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
    """A pytree with array leaves replaced by references, plus where the data lies (bytes per path).

    ``staged``: the segment / IPC block is a persistent staging buffer of the sender's channel
    (nothing to release; ``ipc`` is then a :class:`~rose_jax.runtime.cuda_ipc.StagedBlock`)."""

    tree: Any
    shm_name: str | None = None
    ipc: Any = None
    shm_bytes: int = 0
    ipc_bytes: int = 0
    inline_bytes: int = 0
    staged: bool = False


@dataclasses.dataclass(frozen=True)
class Staged:
    """A grant to write into the channel's persistent staging buffers: host segments are named
    ``<base><generation>`` (the grantor picked ``base``, so it can unlink them all)."""

    base: str


class Channel:
    """One peer's persistent staging buffers (outbox) and mappings of the peer's (inbox).

    The driver keeps one per worker, a worker one for the driver. Counters: ``segments_created``
    / ``segments_opened`` (host), and the device staging's allocations / the mapping's opens.
    """

    def __init__(self):
        self._out: shm.Segment | None = None
        self._generation = 0
        self._in: shm.Segment | None = None
        self._staging: cuda_ipc.Staging | None = None
        self._mapping: cuda_ipc.Mapping | None = None
        self.segments_created = self.segments_opened = 0

    # -- sending
    def out_segment(self, base: str, size: int) -> shm.Segment:
        """The outbox segment, replaced by a larger one when ``size`` bytes do not fit."""
        if self._out is None or self._out.size < size or not self._out.name.startswith(base):
            if self._out is not None:
                self._out.close()  # the receiver's mapping stays valid until it maps the new one
            self._out = None
            self._generation += 1
            # grow geometrically: a message that grows a little does not remap every time
            cap = size if self._generation == 1 else max(size, size + size // 4)
            self._out = shm.Segment.create(f"{base}{self._generation}", cap)
            self.segments_created += 1
        return self._out

    def staging(self) -> cuda_ipc.Staging:
        if self._staging is None:
            self._staging = cuda_ipc.Staging()
        return self._staging

    # -- receiving
    def in_segment(self, name: str) -> shm.Segment:
        """The peer's segment ``name``, mapped once (a new name unmaps the previous one)."""
        if self._in is None or self._in.name != name:
            if self._in is not None:
                self._in.close()
            self._in = None
            self._in = shm.Segment(name)
            self.segments_opened += 1
        return self._in

    def mapping(self) -> cuda_ipc.Mapping:
        if self._mapping is None:
            self._mapping = cuda_ipc.Mapping()
        return self._mapping

    def stats(self) -> dict:
        return {
            "segments_created": self.segments_created,
            "segments_opened": self.segments_opened,
            "device_allocations": self._staging.allocations if self._staging else 0,
            "device_opens": self._mapping.opens if self._mapping else 0,
        }

    def close(self) -> None:
        """Unlink the outbox segment, unmap the inbox, free the device staging; idempotent."""
        for part in (self._out, self._in, self._staging, self._mapping):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - best effort at shutdown (e.g. the CUDA context is gone)
                    pass
        self._out = self._in = self._staging = self._mapping = None


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
    tree: Any,
    *,
    shm_name: str | Staged,
    use_ipc: bool,
    inline_limit: int = DEFAULT_INLINE_LIMIT,
    channel: Channel | None = None,
) -> tuple[Packet, Outbound]:
    """Pack tree. ``shm_name``: a one-off segment name (used only if some array goes through host
    shared memory) or a :class:`Staged` grant (then ``channel``'s staging buffers are used)."""
    staged = isinstance(shm_name, Staged)
    if staged and channel is None:
        raise ValueError("encode: a Staged name needs the channel whose staging buffers it grants")
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
            if staged:
                seg = channel.out_segment(shm_name.base, shm.layout([a.nbytes for a in host_arrays])[1])
                offsets, name = seg.write(host_arrays), seg.name
            else:
                offsets, name = shm.write(shm_name, host_arrays), shm_name
                outbound.shm_name = shm_name
            for i, a, off in zip(host_idx, host_arrays, offsets, strict=True):
                out[i] = HostRef(off, tuple(a.shape), a.dtype)
            packet_kw.update(shm_name=name, shm_bytes=sum(a.nbytes for a in host_arrays))
        if dev_arrays:
            if staged:
                block, offsets = channel.staging().write(dev_arrays)
            else:
                block, ptr, offsets = cuda_ipc.export(dev_arrays)
                outbound.ipc_ptr = ptr
            for i, a, off in zip(dev_idx, dev_arrays, offsets, strict=True):
                out[i] = DeviceRef(off, tuple(a.shape), np.dtype(a.dtype))
            packet_kw.update(ipc=block, ipc_bytes=sum(a.nbytes for a in dev_arrays))
    except BaseException:
        outbound.release()
        raise
    tree_out = jax.tree_util.tree_unflatten(treedef, out)
    return Packet(tree_out, inline_bytes=inline, staged=staged, **packet_kw), outbound


def decode(packet: Packet, *, to: str, channel: Channel | None = None) -> Any:
    """Rebuild the pytree; to="jax" (worker: arrays committed to the default device, whichever path
    they came by: a jitted function sees the same argument placement every call, so it never
    recompiles because one call's inputs came inline and the next one's over CUDA IPC) or
    "numpy" (driver).

    A staged packet is read through ``channel``'s mappings (opened once); without a channel its
    buffers are opened for this message only."""
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
        if packet.staged and channel is not None:
            seg = channel.in_segment(packet.shm_name)
            arrays = seg.read(refs) if to == "numpy" else _to_device([seg.view(*r) for r in refs])
        elif to == "numpy":
            arrays = shm.read(packet.shm_name, refs)
        else:
            arrays = _host_to_device(packet.shm_name, refs)
        for (i, _), a in zip(host, arrays, strict=True):
            out[i] = a
    if dev:
        if packet.ipc is None:
            raise ExchangeError("packet has CUDA-IPC references but no IPC block")
        refs = [(r.offset, r.shape, r.dtype) for _, r in dev]
        if packet.staged:
            mapping = channel.mapping() if channel is not None else cuda_ipc.Mapping()
            try:
                arrays = mapping.read(packet.ipc, refs)
            finally:
                if channel is None:
                    mapping.close()
        else:
            arrays = cuda_ipc.import_arrays(packet.ipc, refs)
        for (i, _), a in zip(dev, arrays, strict=True):
            out[i] = a
    device = jax.devices()[0]
    for i, leaf in enumerate(out):
        if to == "jax" and isinstance(leaf, (np.ndarray, np.generic)):
            out[i] = jax.device_put(np.array(leaf, copy=True), device)
        elif isinstance(leaf, jax.Array):  # e.g. a DLPack import: committed like the others
            out[i] = jax.device_put(leaf, device)
    return jax.tree_util.tree_unflatten(treedef, out)


def _host_to_device(name: str, refs) -> list[jax.Array]:
    with shm.mapped(name) as buf:
        return _to_device([shm.view(buf, off, shape, dtype) for off, shape, dtype in refs])


def _to_device(views: list[np.ndarray]) -> list[jax.Array]:
    """Device copies of views into a segment, waited for (the segment is reused or unmapped next)."""
    on_cpu = jax.default_backend() == "cpu"
    device = jax.devices()[0]
    # The CPU client may alias a host buffer instead of copying it: copy out of the segment.
    arrays = [jax.device_put(np.array(v, copy=True) if on_cpu else v, device) for v in views]
    del views
    jax.block_until_ready(arrays)
    return arrays


def nbytes(tree: Any) -> int:
    """Total bytes of the array leaves of tree."""
    return sum(
        int(np.dtype(x.dtype).itemsize * math.prod(x.shape))
        for x in jax.tree_util.tree_leaves(tree)
        if _is_array(x)
    )
