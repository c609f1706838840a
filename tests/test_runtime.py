"""rose_jax.runtime: real spawned CPU JAX workers, array exchange, barriers, failures, relaunch.

Every test here starts real worker processes (JAX on CPU); nothing is mocked. Worker functions
come from rose_jax.runtime.probes by import path.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest

from rose_jax.mps import WorkerSpec
from rose_jax.runtime import (
    RemoteError,
    Transport,
    WorkerDied,
    WorkerError,
    WorkerTimeout,
    choose_transport,
    start_workers,
)
from rose_jax.runtime import exchange, probes, shm
from rose_jax.runtime.cuda_ipc import IpcSupport

P = "rose_jax.runtime.probes:"
CPU = {"JAX_PLATFORMS": "cpu"}


SEG = f"rose{os.getpid()}_"  # every segment a pool of this process creates starts with this


def _shm_entries() -> set[str]:
    """The /dev/shm entries this test process's pools can have created (named ``rose<pid>_...``).

    Entries of other processes are left out, so other test runs or programs on the machine
    (which create their own segments and semaphores at any time) cannot make the checks flaky.
    """
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEG)}


def _children() -> set[int]:
    """Live child processes of this test process, except multiprocessing's resource tracker."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            pass
        out.add(p.pid)
    return out


def _wait_for(pred, timeout=60.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pool():
    specs = [WorkerSpec("a", env=CPU), WorkerSpec("b", mem_fraction=0.3, env=CPU)]
    with start_workers(specs) as p:
        yield p
    assert not p.running
    assert _shm_entries() == set()  # the staging segments too


# ------------------------------------------------------------- pure, no workers


def test_choose_transport():
    no = IpcSupport(False, "cupy not importable")
    yes0, yes1 = IpcSupport(True, "cupy on 0", "0000:01:00.0"), IpcSupport(True, "cupy on 1", "0000:02:00.0")
    assert choose_transport("shm", yes0, {"a": yes0}) == Transport("shm", "host shared memory requested")
    t = choose_transport("auto", None, {"a": yes0, "b": no})
    assert t.kind == "shm" and "worker 'b': cupy not importable" in t.reason
    assert choose_transport("auto", yes0, {"a": yes0, "b": yes0}).kind == "cuda_ipc"
    t = choose_transport("auto", yes0, {"a": yes0, "b": yes1})
    assert t.kind == "shm" and "not all on one GPU" in t.reason
    with pytest.raises(WorkerError, match="cuda_ipc' is not available: driver: cupy not importable"):
        choose_transport("cuda_ipc", no, {"a": yes0})
    with pytest.raises(ValueError, match="transport must be one of"):
        choose_transport("nvlink", yes0, {"a": yes0})


def test_encode_decode_roundtrip_in_process():
    big = np.arange(50_000, dtype=np.float64)
    bf = jnp.arange(40_000, dtype=jnp.bfloat16)
    tree = {
        "big": big,
        "bf16": bf,
        "small": np.int32(3),
        "nested": (np.ones((2, 3), np.float32), None),
        "scalar": 2.5,
        "name": "x",
    }
    before = _shm_entries()
    packet, outbound = exchange.encode(tree, shm_name=SEG + "test_rt", use_ipc=False, inline_limit=1024)
    assert packet.shm_bytes == big.nbytes + bf.nbytes and packet.inline_bytes == 4 + 24
    assert SEG + "test_rt" in _shm_entries()
    back = exchange.decode(packet, to="numpy")
    outbound.release()
    assert _shm_entries() == before
    np.testing.assert_array_equal(back["big"], big)
    assert back["bf16"].dtype == jnp.bfloat16 and np.array_equal(back["bf16"], np.asarray(bf))
    assert back["nested"][1] is None and back["scalar"] == 2.5 and back["name"] == "x"
    with pytest.raises(ValueError, match="decode target"):
        exchange.decode(packet, to="torch")
    with pytest.raises(exchange.ExchangeError, match="PRNG key array: send jax.random.key_data"):
        exchange.encode({"k": jax.random.key(0)}, shm_name=SEG + "test_k", use_ipc=False)
    assert _shm_entries() == before


def test_shm_too_small_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda: 1000)
    with pytest.raises(exchange.ExchangeError, match=r"/dev/shm has 0\.0 MiB free"):
        shm.write(SEG + "test_small", [np.zeros(10_000)])
    assert SEG + "test_small" not in _shm_entries()


# ----------------------------------------------------------- shared 2-worker pool


def test_workers_run_a_jitted_function_by_import_path(pool):
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 4), (4,)))
    want = np.asarray(jax.jit(probes.affine)(x, w, b))
    outs = pool.call_all(P + "affine", x, w, b)
    assert set(outs) == {"a", "b"}
    for out in outs.values():
        assert isinstance(out, np.ndarray) and out.shape == (16, 4)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    # a function object resolves to the same import path; static kwargs are bound before jit
    np.testing.assert_allclose(pool.call("a", probes.affine, x, w, b), want, rtol=1e-6, atol=1e-6)
    tree = {"p": np.ones((3, 2), np.float32), "q": [np.arange(4, dtype=np.int32), np.float32(2.0)]}
    got = pool.call("b", P + "scale", tree, static={"factor": 3.0})
    np.testing.assert_array_equal(got["p"], 3 * tree["p"])
    np.testing.assert_array_equal(got["q"][0], 3 * tree["q"][0])
    s = pool.call("a", P + "tree_summary", tree)
    assert float(s["sum"]) == pytest.approx(6 + 6 + 2) and int(s["count"]) == 11


def test_workers_are_born_with_their_environment(pool):
    for name, info in pool.info.items():
        assert info.backend == "cpu" and info.pid == pool.pids[name] and not info.mps
        assert info.birth_env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert info.birth_env["ROSE_WORKER_NAME"] == name
        assert not any(k.startswith("CUDA_MPS_") for k, v in info.birth_env.items() if v is not None)
    assert pool.info["b"].birth_env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3"
    assert pool.info["a"].birth_env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") is None
    assert pool.transport.kind == "shm" and "CUDA IPC unavailable" in pool.transport.reason
    assert "ROSE_WORKER_NAME" not in os.environ  # the driver's own environment is never changed


def test_starting_workers_never_touches_the_drivers_environment():
    """Workers get their environment at exec; the driver never calls putenv/unsetenv while
    spawning (changing its environment while XLA threads read it is not thread-safe: it once
    segfaulted the test suite)."""
    calls = []
    real = os.putenv, os.unsetenv
    before = dict(os.environ)
    os.putenv = lambda *a: calls.append(("putenv", a))  # noqa: E731 - recorded, not applied
    os.unsetenv = lambda *a: calls.append(("unsetenv", a))  # noqa: E731
    try:
        p = start_workers([WorkerSpec("e", env={**CPU, "ROSE_TEST_TAG": "born"})])
    finally:
        os.putenv, os.unsetenv = real
    try:
        assert not calls, calls
        assert p.call("e", P + "getenv", static={"names": ("ROSE_TEST_TAG",)}, jit=False) == {
            "ROSE_TEST_TAG": "born"
        }
        assert p.info["e"].birth_env["ROSE_WORKER_NAME"] == "e" and p.info["e"].backend == "cpu"
    finally:
        p.close()
    assert dict(os.environ) == before


def _staging(entries: set[str]) -> set[str]:
    """The persistent staging segments among ``entries`` (``<prefix>w<i>i<gen>`` / ``w<i>o<gen>``)."""
    import re

    return {n for n in entries if re.search(r"_w\d+[io]\d+$", n)}


def test_large_arrays_travel_through_shared_memory(pool):
    """Through the worker's persistent staging segments: created and mapped once on each side,
    reused by later calls of the same size, replaced (not added to) when a message is larger."""
    before = _shm_entries() - _staging(_shm_entries())
    x = np.random.default_rng(1).standard_normal(8 * 2**20).astype(np.float32)  # 32 MiB
    y = jnp.arange(2**20, dtype=jnp.bfloat16)  # a jax array from the driver, an ml_dtypes dtype
    created = pool.channel_stats()["b"]["segments_created"]
    for k in range(3):
        out = pool.call("b", P + "identity", {"x": x + k, "y": y})
        np.testing.assert_array_equal(out["x"], x + k)
        assert out["y"].dtype == jnp.bfloat16 and np.array_equal(out["y"], np.asarray(y))
        st = pool.last_stats["b"]
        assert st["in_shm_bytes"] == x.nbytes + y.nbytes == st["out_shm_bytes"]
        assert st["in_inline_bytes"] == 0 and st["in_ipc_bytes"] == 0
        if k == 0:
            first = (pool.channel_stats()["b"], st["channel"])
    # one in-segment (driver -> b) and one out-segment (b -> driver), each made and mapped once
    assert pool.channel_stats()["b"] == first[0] and st["channel"] == first[1]
    assert first[0]["segments_created"] <= created + 1 and first[1]["segments_opened"] <= 1 + created
    staged = _staging(_shm_entries())
    assert len([n for n in staged if "_w1i" in n]) == 1 and len([n for n in staged if "_w1o" in n]) == 1
    assert _shm_entries() - staged == before  # no one-off segment left behind
    bigger = np.concatenate([x, x])
    np.testing.assert_array_equal(pool.call("b", P + "identity", bigger), bigger)
    grown = _staging(_shm_entries())
    assert len(grown) == len(staged) and grown != staged  # replaced by larger ones, not added


def test_barrier_inside_workers_is_step_synchronous(pool):
    ha = pool.submit("a", P + "barrier_probe", static={"delay_s": 0.0}, jit=False)
    hb = pool.submit("b", P + "barrier_probe", static={"delay_s": 0.6}, jit=False)
    (a_before, a_after), (b_before, b_after) = pool.wait([ha, hb], timeout=60)
    assert a_after >= b_before  # a could not pass before b arrived
    assert a_after - a_before >= 0.5
    assert max(a_before, b_before) <= min(a_after, b_after)


def test_driver_barrier_waits_for_everything_submitted(pool):
    t0 = time.monotonic()
    hs = [
        pool.submit(n, P + "hold", np.ones(3), static={"marker": os.devnull, "seconds": 0.4}, jit=False)
        for n in ("a", "b", "a")
    ]
    pool.barrier(timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.75  # "a" ran two 0.4 s calls in order
    assert not pool._pending
    t1 = time.monotonic()
    assert [float(v) for v in pool.wait(hs, timeout=1)] == [3.0, 3.0, 3.0]
    assert time.monotonic() - t1 < 0.5  # already done


def test_map_spreads_items_round_robin_and_keeps_order(pool):
    outs = pool.map(P + "whoami", [()] * 5, jit=False)
    assert [o[0] for o in outs] == ["a", "b", "a", "b", "a"]
    assert [o[1:3] for o in outs] == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 2)]
    xs = [(np.full(3, i, np.float32),) for i in range(4)]
    assert [float(v.sum()) for v in pool.map(P + "scale", xs, static={"factor": 2.0})] == [
        0.0,
        6.0,
        12.0,
        18.0,
    ]


def test_remote_error_keeps_the_pool_usable(pool):
    with pytest.raises(
        RemoteError, match=r"worker 'a': rose_jax.runtime.probes:fail raised ValueError: nope"
    ):
        pool.call("a", P + "fail", static={"message": "nope"}, jit=False)
    with pytest.raises(RemoteError, match="ModuleNotFoundError"):
        pool.call("b", "rose_jax.no_such_module:f")
    assert pool.running
    assert float(pool.call("a", P + "tree_summary", np.ones(5))["sum"]) == 5.0


def test_bad_calls_are_clear_errors(pool):
    with pytest.raises(ValueError, match="'package.module:function'"):
        pool.submit("a", "rose_jax.runtime.probes.affine")
    with pytest.raises(ValueError, match="not importable by path"):
        pool.submit("a", lambda x: x)
    with pytest.raises(ValueError, match=r"no worker named 'c'; workers are \['a', 'b'\]"):
        pool.submit("c", P + "identity", 1.0)
    with pytest.raises(ValueError, match="must be hashable"):
        pool.submit("a", P + "scale", 1.0, static={"factor": [1]})
    with pytest.raises(ValueError, match="transport must be one of"):
        pool.submit("a", P + "identity", 1.0, transport="pcie")
    with pytest.raises(ValueError, match="per_worker must have exactly"):
        pool.call_all(P + "identity", per_worker={"a": (1.0,)})


def test_resident_values_stay_in_the_worker(pool):
    x = np.arange(2**16, dtype=np.float32)  # 256 KiB: would travel through shared memory
    pool.put_resident("a", "x", {"v": x})
    assert pool.last_stats["a"]["in_shm_bytes"] == x.nbytes
    assert pool.resident("a") == {"x": x.nbytes} and pool.resident("b") == {}
    # reads: the resident value is the first argument and moves no bytes; writes: stored, not sent back
    out = pool.call("a", P + "tree_summary", reads=("x",))
    assert float(out["sum"]) == float(x.sum()) and int(out["count"]) == x.size
    st = pool.last_stats["a"]
    assert st["in_shm_bytes"] == st["in_inline_bytes"] == 0 and st["resident_bytes"] == x.nbytes
    got = pool.call("a", P + "scale_resident", np.float32(2.0), reads=("x",), writes=("x", "y"))
    assert float(got) == pytest.approx(2.0 * float(x.sum()))
    assert pool.last_stats["a"]["out_shm_bytes"] == 0  # the scaled tree stayed in the worker
    assert set(pool.resident("a")) == {"x", "y"}
    np.testing.assert_array_equal(pool.get_resident("a", "x")["v"], 2 * x)
    np.testing.assert_array_equal(pool.get_resident("a", "y")["v"], 2 * x)
    with pytest.raises(RemoteError, match="no resident value named 'z' on this worker"):
        pool.call("a", P + "identity", reads=("z",))
    with pytest.raises(RemoteError, match=r"must return \(written, outputs\)"):
        pool.call("a", P + "identity", 1.0, writes=("w",))
    with pytest.raises(ValueError, match="non-empty strings"):
        pool.put_resident("a", "", 1.0)
    pool.drop_resident("a", "x", "y", "never_put")
    assert pool.resident("a") == {} and pool.running
    with pytest.raises(RemoteError, match="no resident value named 'x'"):
        pool.get_resident("a", "x")


# ----------------------------------------------------------------- failure paths


def test_sigkilled_worker_gives_a_clear_error_and_leaves_nothing(tmp_path):
    shm_before, children_before = _shm_entries(), _children()
    marker = tmp_path / "started"
    specs = [WorkerSpec("a", env=CPU), WorkerSpec("b", env=CPU)]
    p = start_workers(specs)
    pids = dict(p.pids)
    big = np.ones(2**18, np.float32)  # 1 MiB: goes through a shared-memory segment
    ha = p.submit("a", P + "hold", big, static={"marker": str(marker), "seconds": 60}, jit=False)
    hb = p.submit("b", P + "hold", big, static={"marker": os.devnull, "seconds": 60}, jit=False)
    assert len(_shm_entries() - shm_before) >= 2  # the two input segments are in flight
    _wait_for(marker.exists)
    t0 = time.monotonic()
    os.kill(pids["a"], signal.SIGKILL)
    with pytest.raises(WorkerDied) as ei:
        p.wait([ha, hb], timeout=60)
    assert time.monotonic() - t0 < 10
    e = ei.value
    assert e.name == "a" and e.signal == signal.SIGKILL and e.pid == pids["a"]
    assert "worker 'a'" in str(e) and "SIGKILL" in str(e) and "rose_jax.runtime.probes:hold" in str(e)
    assert not p.running and p.failure is e
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        for pid in pids.values()
    )
    assert _children() == children_before
    assert _shm_entries() == shm_before
    with pytest.raises(WorkerError, match="pool is down after: worker 'a'"):
        p.submit("b", P + "identity", 1.0)
    p.close()  # closing a broken pool is a no-op


def test_timeout_terminates_the_pool(tmp_path):
    shm_before, children_before = _shm_entries(), _children()
    with start_workers([WorkerSpec("slow", env=CPU)]) as p:
        with pytest.raises(WorkerTimeout, match=r"hold on 'slow' did not finish within 1\.0s"):
            p.call(
                "slow",
                P + "hold",
                np.ones(2**17),
                static={"marker": os.devnull, "seconds": 60},
                jit=False,
                timeout=1.0,
            )
        assert not p.running
    assert _children() == children_before and _shm_entries() == shm_before


def test_relaunch_with_new_specs():
    children_before = _children()
    p = start_workers(
        [
            WorkerSpec("a", env={**CPU, "ROSE_TEST_TAG": "v1"}),
            WorkerSpec("b", env={**CPU, "ROSE_TEST_TAG": "v1"}),
        ]
    )
    try:
        old = dict(p.pids)
        assert p.call("a", P + "getenv", static={"names": ("ROSE_TEST_TAG",)}, jit=False) == {
            "ROSE_TEST_TAG": "v1"
        }
        new = [WorkerSpec(n, mem_fraction=0.2, env={**CPU, "ROSE_TEST_TAG": "v2"}) for n in ("x", "y", "z")]
        assert p.relaunch(new) is p
        assert p.names == ("x", "y", "z") and p.running
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            for pid in old.values()
        )
        assert not set(p.pids.values()) & set(old.values())
        outs = p.call_all(
            P + "getenv", static={"names": ("ROSE_TEST_TAG", "XLA_PYTHON_CLIENT_MEM_FRACTION")}, jit=False
        )
        assert outs == {
            n: {"ROSE_TEST_TAG": "v2", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"} for n in ("x", "y", "z")
        }
        # the in-worker barrier now has three parties
        res = p.call_all(P + "barrier_probe", static={"delay_s": 0.0}, jit=False, timeout=60)
        assert max(r[0] for r in res.values()) <= min(r[1] for r in res.values())
        with pytest.raises(ValueError, match="sum of mem_fraction"):
            p.relaunch([WorkerSpec(n, mem_fraction=0.5) for n in ("u", "v")])
        assert p.running and p.names == ("x", "y", "z")  # a bad plan changes nothing
    finally:
        p.close()
    assert _children() == children_before


# -------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_ipc_roundtrip_on_one_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU (JAX backend is {jax.default_backend()!r})")
    from rose_jax.runtime import cuda_ipc

    support = cuda_ipc.probe()
    if not support.available:
        pytest.skip(support.reason)
    with start_workers([WorkerSpec("g", mem_fraction=0.2)], transport="auto") as p:
        assert p.transport.kind == "cuda_ipc", p.transport
        x = jnp.arange(2**22, dtype=jnp.float32)
        y = jnp.arange(2**20, dtype=jnp.bfloat16)
        out = p.call("g", P + "identity", {"x": x, "y": y})
        assert isinstance(out["x"], jax.Array) and cuda_ipc.on_gpu(out["x"])
        assert bool(jnp.array_equal(out["x"], x)) and bool(jnp.array_equal(out["y"], y))
        st = p.last_stats["g"]
        assert st["in_ipc_bytes"] == x.nbytes + y.nbytes == st["out_ipc_bytes"]
        host = p.call("g", P + "identity", x, transport="shm")
        assert isinstance(host, np.ndarray) and np.array_equal(host, np.asarray(x))


@pytest.mark.gpu
def test_resident_values_over_cuda_ipc():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU (JAX backend is {jax.default_backend()!r})")
    from rose_jax.runtime import cuda_ipc

    support = cuda_ipc.probe()
    if not support.available:
        pytest.skip(support.reason)
    with start_workers([WorkerSpec("g", mem_fraction=0.2)], transport="auto") as p:
        assert p.transport.kind == "cuda_ipc", p.transport
        x = jnp.arange(2**22, dtype=jnp.float32)
        p.put_resident("g", "x", {"v": x})
        assert p.last_stats["g"]["in_ipc_bytes"] == x.nbytes
        total = p.call("g", P + "scale_resident", jnp.float32(3.0), reads=("x",), writes=("x", "y"))
        st = p.last_stats["g"]
        assert st["in_ipc_bytes"] + st["in_inline_bytes"] + st["in_shm_bytes"] == 4  # only the factor
        assert float(total) == pytest.approx(3.0 * float(jnp.sum(x)), rel=1e-5)
        back = p.get_resident("g", "y")
        assert isinstance(back["v"], jax.Array) and cuda_ipc.on_gpu(back["v"])
        assert bool(jnp.array_equal(back["v"], 3.0 * x))
        p.drop_resident("g", "x", "y")
        assert p.resident("g") == {}


@pytest.mark.gpu
def test_cuda_ipc_staging_buffers_are_reused():
    """Over CUDA IPC, repeated calls of one size go through the worker's persistent device staging
    buffers: allocated and opened once on each side (no cudaMalloc / IpcOpenMemHandle per call),
    results equal; a larger message replaces the buffer; closing leaves nothing behind."""
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU (JAX backend is {jax.default_backend()!r})")
    from rose_jax.runtime import cuda_ipc

    support = cuda_ipc.probe()
    if not support.available:
        pytest.skip(support.reason)
    children = _children()
    with start_workers([WorkerSpec("g", mem_fraction=0.2)], transport="auto") as p:
        assert p.transport.kind == "cuda_ipc", p.transport
        x = jnp.arange(2**20, dtype=jnp.float32)
        for k in range(4):
            out = p.call("g", P + "scale", x, static={"factor": float(k)})
            assert isinstance(out, jax.Array) and bool(jnp.array_equal(out, k * x))
            if k == 0:
                first = (p.channel_stats()["g"], p.last_stats["g"]["channel"])
        assert (p.channel_stats()["g"], p.last_stats["g"]["channel"]) == first
        assert first[0]["device_allocations"] == 1 and first[1]["device_opens"] == 1  # driver -> worker
        assert first[1]["device_allocations"] == 1 and first[0]["device_opens"] == 1  # worker -> driver
        y = jnp.arange(2**22, dtype=jnp.float32)
        assert bool(jnp.array_equal(p.call("g", P + "identity", y), y))
        assert p.channel_stats()["g"]["device_allocations"] == 2
    assert _children() == children and _shm_entries() == set()
