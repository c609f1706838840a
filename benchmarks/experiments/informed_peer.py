"""rose-jax against the informed peer, end to end: Brax's own trainers as shipped and with the best
global XLA flags, against `rose-jax train` (first run: empty compile and plan caches; second run:
both caches warm), each a whole run of a stated length in its own process.

    python -m benchmarks.experiments.informed_peer --workloads sac-hopper,ppo-ant --repeats 2
    python -m benchmarks.experiments.informed_peer --smoke     # CPU: tiny runs of every variant

Variants (each a fresh process; the parent times it from start to exit, imports and compiles in):

- ``peer_default``: Brax's ``{ppo,sac}.train`` with Brax's published keywords, as shipped;
- ``peer_flags``: the same with ``XLA_FLAGS=`` :data:`PEER_FLAGS` (the best global flag we know:
  what our own default options set, passed to the peer's process);
- ``rose_first``: ``python -m rose_jax.cli train`` with the same keywords (``--preset brax`` and
  ``--set``), the persistent compile cache and the plan cache in fresh, empty directories;
- ``rose_cached``: the same command again on the same caches (a user's second run).
- ``rose_optimize_first`` / ``rose_optimize_cached`` (with ``--optimize-variants``): the same with
  ``--optimize`` (the search, then its plan-cache hit).

Steady env-steps/s, one rule for every variant: the rate between consecutive progress reports
(env steps over wall seconds, evaluation included, as a user sees it) after the reports that hold
compiles or the option trial (Brax: its first two training epochs, Brax compiles twice; rose-jax:
its first epoch and the trial's units), the median over >= 3 such intervals. Brax's own
``training/sps`` (training only) is recorded beside it.

Per workload (``results.json``/``results.md``/``results.png`` in ``--out``): the fields of issue
30's table (``peer_default_env_steps_per_s``, ``peer_flags_env_steps_per_s``,
``rose_env_steps_per_s``, ``speedup_vs_informed_peer`` = rose over the faster peer variant,
``end_to_end_s`` medians with ``spread`` and ``repeats``, ``same_call``, ``search_s``,
``breakeven_env_steps``, ``plan``, ``equal``, ``max_abs_diff``, ``command``, ``date``).
``equal``: with ``--check-equal`` (default on a GPU) a child builds rose-jax's unit under XLA's
defaults and under the kept option set, both with ``xla_gpu_deterministic_ops``, runs two units
from the same state and compares the states bitwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import common
from rose_jax.io import atomic_write_json

PEER_FLAGS = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
OUT_DIR = os.path.join(common.RESULTS_DIR, "informed_peer")
VARIANTS = ("peer_default", "peer_flags", "rose_first", "rose_cached")
OPTIMIZE_VARIANTS = ("rose_optimize_first", "rose_optimize_cached")
ALL_VARIANTS = VARIANTS + OPTIMIZE_VARIANTS


def _published(algo: str, env: str) -> dict[str, Any]:
    from algos import presets

    return presets.published(algo, env)


def ppo_env_steps_per_training_step(kw: dict[str, Any]) -> int:
    """Brax PPO keywords ``kw``: env steps per training step (brax/training/agents/ppo/train.py's
    ``env_step_per_training_step``)."""
    return (int(kw["batch_size"]) * int(kw["unroll_length"]) * int(kw["num_minibatches"])
            * int(kw.get("action_repeat", 1)))


def published_epochs(kw: dict[str, Any], epochs: int, algo: str = "sac") -> dict[str, Any]:
    """Brax keywords ``kw`` of ``algo`` (``'sac'`` or ``'ppo'``) cut to ``epochs`` epochs of the size
    the published run has: ``num_evals = epochs + 1`` (Brax evaluates once before training) and
    ``num_timesteps`` so that Brax's rounding gives the published training steps per epoch
    (``num_training_steps_per_epoch`` in brax/training/agents/{sac,ppo}/train.py; SAC: the prefill
    plus ``epochs`` x the published epoch; PPO: ``epochs`` x the published epoch of
    ``batch_size * unroll_length * num_minibatches * action_repeat`` env steps per training step).
    The run keeps the published shape (each epoch's training, then its evaluation of
    ``num_eval_envs`` x ``episode_length`` steps) at a fraction of its length: the evaluation's share
    of an epoch is the published run's, where a shorter ``num_timesteps`` at the published
    ``num_evals`` makes it larger (notes.md, "Why SAC rows from whole runs measure the evaluation",
    and "Eval share": PPO ant at 20M has 7 training steps per epoch, the published run 17)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"published_epochs: epochs must be a positive int, got {epochs!r}")
    after_init = max(int(kw["num_evals"]) - 1, 1)
    if algo == "ppo":
        if int(kw.get("num_resets_per_eval", 0) or 0) > 1:
            raise ValueError("published_epochs: ppo with num_resets_per_eval > 1 is not supported")
        per_step = ppo_env_steps_per_training_step(kw)
        per_epoch = -(-int(kw["num_timesteps"]) // (after_init * per_step))
        return dict(kw, num_evals=epochs + 1, num_timesteps=epochs * per_epoch * per_step)
    if algo != "sac":
        raise ValueError(f"published_epochs: algo must be 'sac' or 'ppo', got {algo!r}")
    per_actor_step = int(kw.get("action_repeat", 1)) * int(kw["num_envs"])
    prefill = -(-int(kw.get("min_replay_size", 0)) // int(kw["num_envs"])) * per_actor_step
    per_epoch = -(-(int(kw["num_timesteps"]) - prefill) // (after_init * per_actor_step))
    return dict(kw, num_evals=epochs + 1, num_timesteps=prefill + epochs * per_epoch * per_actor_step)


# Epochs of the published size in a SAC row's runs: Brax compiles in its first two, so five leave
# three steady intervals (the method's minimum); about 4-5 minutes per run on an H100/H200.
SAC_EPOCHS = 5
# The same for the PPO rows at the published epoch shape: six, so that a plan deferring the last
# evaluation's metrics (offload_component; its last interval is left out) still leaves 4 steady
# intervals (ppo-ant-6ep: 6 x 17 training steps, about 2 minutes per Brax run on an H100;
# ppo-reacher-6ep: 6 x 2, about as long as the 20M reacher rows).
PPO_EPOCHS = 6


def _ppo_epochs(env: str, what: str) -> dict[str, Any]:
    """A PPO workload of :data:`PPO_EPOCHS` epochs of the published run's size (published_epochs)."""
    kw = _published("ppo", env)
    short = published_epochs(kw, PPO_EPOCHS, "ppo")
    per_step = ppo_env_steps_per_training_step(kw)
    per_epoch = short["num_timesteps"] // (PPO_EPOCHS * per_step)
    return dict(
        algo="ppo",
        env=env,
        kwargs=short,
        steps=short["num_timesteps"],
        acceptance_steps=short["num_timesteps"],
        what=f"{what}, {PPO_EPOCHS} of its {max(kw['num_evals'] - 1, 1)} epochs (each {per_epoch} training "
        f"steps of {per_step:,} env steps, then the evaluation; num_evals {PPO_EPOCHS + 1}); published "
        f"length {kw['num_timesteps'] / 1e6:g}M",
    )


# name -> (algo, env, Brax keywords (published), default num_timesteps here, what it is;
# acceptance_steps: the length issue 32's rows run at where it is not the algorithm's default).
# num_timesteps: the published length where one device call allows, else shorter and said so.
def workloads() -> dict[str, dict[str, Any]]:
    sac = _published("sac", "hopper")
    sac_epochs = published_epochs(sac, SAC_EPOCHS, "sac")
    return {
        "sac-hopper-5ep": dict(
            algo="sac",
            env="hopper",
            kwargs=sac_epochs,
            steps=sac_epochs["num_timesteps"],
            acceptance_steps=sac_epochs["num_timesteps"],
            what=f"Brax's published SAC hopper high-update config, {SAC_EPOCHS} of its 19 epochs "
            "(each 2,692 training steps of 128 env steps, then the 128 x 1000 evaluation; num_evals "
            f"{SAC_EPOCHS + 1}); published length 6.55M",
        ),
        "sac-ant-5ep": dict(
            algo="sac",
            env="ant",
            kwargs=dict(sac_epochs),
            steps=sac_epochs["num_timesteps"],
            acceptance_steps=sac_epochs["num_timesteps"],
            what=f"the same SAC high-update config on ant, {SAC_EPOCHS} epochs of the hopper run's size "
            "(Brax publishes no SAC ant config)",
        ),
        "sac-hopper": dict(
            algo="sac",
            env="hopper",
            kwargs=sac,
            steps=300_000,
            what="Brax's published SAC hopper high-update config (128 envs, batch 512, 64 "
            "updates per env step, replay 1M, min replay 8192); published length 6.55M",
        ),
        "sac-ant": dict(
            algo="sac",
            env="ant",
            kwargs=dict(sac),
            steps=300_000,
            what="the same SAC high-update config on ant (Brax publishes no SAC ant config)",
        ),
        "ppo-ant": dict(
            algo="ppo",
            env="ant",
            kwargs=_published("ppo", "ant"),
            steps=20_000_000,
            what="Brax's published PPO ant config (4096 envs, batch 2048, 32 minibatches, unroll 5, "
            "4 updates per batch); published length 50M",
        ),
        "ppo-humanoid": dict(
            algo="ppo",
            env="humanoid",
            kwargs=_published("ppo", "humanoid"),
            steps=20_000_000,
            what="Brax's published PPO humanoid config (2048 envs, batch 1024, 32 minibatches, "
            "unroll 10, 8 updates per batch); published length 50M",
        ),
        "ppo-halfcheetah": dict(
            algo="ppo",
            env="halfcheetah",
            kwargs=_published("ppo", "halfcheetah"),
            steps=20_000_000,
            what="Brax's published PPO halfcheetah config (2048 envs, batch 512, 32 minibatches, "
            "unroll 20, 8 updates per batch, 20 evaluations); published length 50M",
        ),
        "ppo-reacher": dict(
            algo="ppo",
            env="reacher",
            kwargs=_published("ppo", "reacher"),
            steps=20_000_000,
            what="Brax's published PPO reacher config (2048 envs, batch 256, 32 minibatches, "
            "unroll 50, action repeat 4, 8 updates per batch, 20 evaluations); published length 50M",
        ),
        # the PPO rows at the published epoch shape (the evaluation's share of an epoch the published
        # run's, where 20M at the published num_evals gives it 2.4x (ant) and 2x (reacher) more)
        "ppo-ant-6ep": _ppo_epochs("ant", "Brax's published PPO ant config"),
        "ppo-reacher-6ep": _ppo_epochs("reacher", "Brax's published PPO reacher config"),
        "smoke": dict(
            algo="ppo",
            env="inverted_pendulum",
            kwargs=dict(
                _published("ppo", "ant"),
                num_envs=8,
                batch_size=8,
                num_minibatches=2,
                unroll_length=4,
                num_updates_per_batch=1,
                num_evals=6,
                episode_length=50,
            ),
            steps=6 * 8 * 4 * 2,
            what="CPU smoke run: PPO inverted_pendulum, tiny, Brax's small "
            "networks replaced by the same tiny ones on both sides",
        ),
    }


SMOKE_NETWORKS = dict(policy_hidden_sizes=(8,), value_hidden_sizes=(8,), q_hidden_sizes=(8,))


def rose_argv(w: dict[str, Any], steps: int, smoke: bool) -> list[str]:
    """`rose-jax train` arguments running workload ``w`` with Brax's keywords (``--preset brax``
    and :func:`algos.presets.brax_run`'s config fields and env arguments)."""
    from algos import bench, presets, registry

    config, env_kwargs = presets.brax_run(w["algo"], w["kwargs"])
    seed = int(config.pop("seed", 0))
    config["num_timesteps"] = int(steps)
    if smoke:
        fields = set(registry.get(w["algo"]).keys())
        config.update({k: v for k, v in SMOKE_NETWORKS.items() if k in fields})
    config["preset"] = "brax"
    run = bench.BenchRun(
        w["env"], w["algo"], seed, tuple(sorted(config.items())), "", tuple(sorted(env_kwargs.items()))
    )
    return run.train_argv()


# ----------------------------------------------------------------------------------------------
# children: the peer's run, and the equality check


def _smoke_network_factory(algo: str):
    import functools

    if algo == "ppo":
        from brax.training.agents.ppo import networks

        return functools.partial(
            networks.make_ppo_networks, policy_hidden_layer_sizes=(8,), value_hidden_layer_sizes=(8,)
        )
    from brax.training.agents.sac import networks

    return functools.partial(networks.make_sac_networks, hidden_layer_sizes=(8,))


def child_peer(name: str, steps: int, smoke: bool, result: str) -> int:
    """Brax's own trainer on the workload, reports recorded with their wall times."""
    t_start = time.perf_counter()
    from envs.mjcf import quiet_warp_notice

    with quiet_warp_notice():
        import brax.envs

    from benchmarks.suite import brax_shim

    brax_shim.install()  # Brax 0.14.2 calls jax.device_put_replicated (gone from jax >= 0.12; 0.11.2 has it)
    w = workloads()[name]
    kw = dict(w["kwargs"], num_timesteps=steps)
    if w["algo"] == "ppo":
        from brax.training.agents.ppo import train as trainer
    else:
        from brax.training.agents.sac import train as trainer
    reports: list[dict[str, Any]] = []

    def progress(step, metrics):
        reports.append(
            {
                "env_steps": int(step),
                "t": time.perf_counter() - t_start,
                "sps": float(metrics["training/sps"]) if "training/sps" in metrics else None,
                "eval_return": float(metrics["eval/episode_reward"])
                if "eval/episode_reward" in metrics
                else None,
            }
        )
        atomic_write_json(result, {"reports": reports})

    env = brax.envs.get_environment(w["env"], backend="mjx")
    if smoke:
        kw["network_factory"] = _smoke_network_factory(w["algo"])
    trainer.train(environment=env, progress_fn=progress, **kw)
    atomic_write_json(result, {"reports": reports, "finished": True})
    return 0


def child_equal(argv: list[str], options: dict[str, Any], result: str) -> int:
    """rose-jax's unit under XLA's defaults vs under ``options``, deterministic ops on both sides:
    two units from the same initial state, compared bitwise."""
    import jax

    from rose_jax import cli

    job = cli.train_job(argv)
    fn = job.algo.unit_fn(job.config, job.env)
    det = {"xla_gpu_deterministic_ops": True} if jax.default_backend() == "gpu" else {}
    state0 = job.algo.init(job.config, job.env, jax.random.PRNGKey(job.config.seed))
    lowered = jax.jit(fn).lower(state0)
    out = {
        side: common.state_after(lowered.compile(compiler_options=opts or None), state0, 2)
        for side, opts in (("default", det), ("options", {**options, **det}))
    }
    cmp = common.equality_fields(out["options"], out["default"])
    atomic_write_json(
        result,
        {
            "equal": cmp["equal"],
            "max_abs_diff": cmp["max_abs_diff"],
            "options": options,
            "units": 2,
            "deterministic_ops": bool(det),
        },
    )
    return 0


# ----------------------------------------------------------------------------------------------
# the parent: one process per run


# An interval this much shorter than the median interval is two reports written together, not a
# unit's time: rose-jax's driver reads each unit's metrics after dispatching the next, and on the
# H100/H200 runs of 2026-12-05 the last two reports of every rose-jax run came within ~6 ms of
# each other (a rate 600x the others'), the last unit's time inside the interval before.
TOGETHER_SHARE = 0.1


def _steady(points: list[tuple[int, float]], skip: int) -> tuple[float | None, list[float]]:
    """(median, rates) of env steps per second between consecutive points, the first ``skip``
    intervals left out, and any interval shorter than :data:`TOGETHER_SHARE` of the median
    interval (reports written together); None when fewer than 3 remain."""
    spans = []
    for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False):
        if t1 > t0 and s1 > s0:
            spans.append((s1 - s0, t1 - t0))
    spans = spans[skip:]
    if spans:
        typical = statistics.median(dt for _, dt in spans)
        spans = [(ds, dt) for ds, dt in spans if dt >= TOGETHER_SHARE * typical]
    rates = [ds / dt for ds, dt in spans]
    return (statistics.median(rates) if len(rates) >= 3 else None), rates


def _peer_steady(reports: list[dict[str, Any]]) -> tuple[float | None, list[float], float | None]:
    """Brax: intervals after its first two training epochs (each holds a compile), and the median of
    Brax's own ``training/sps`` of those epochs."""
    pts = [(r["env_steps"], r["t"]) for r in reports]
    first_train = next((i for i, r in enumerate(reports) if r["env_steps"] > 0), None)
    if first_train is None:
        return None, [], None
    # interval i ends at report i + 1; leave out those ending at the first two training reports
    skip = first_train + 2 - 1
    median, rates = _steady(pts, max(skip, 0))
    sps = [r["sps"] for r in reports[first_train + 2 :] if r.get("sps")]
    return median, rates, (statistics.median(sps) if sps else None)


def _rose_steady(rows: list[dict[str, Any]], info: dict[str, Any]) -> tuple[float | None, list[float]]:
    """rose-jax: intervals after its first unit (compile) and the option trial's units (and, for a
    plan that defers metrics, before its last report)."""
    xo = info.get("xla_options") or {}
    trial_units = xo.get("trial_units")  # every unit before the decision (timed or beside compiles)
    if trial_units is None:
        trial_units = 0 if xo.get("cached") else (xo.get("rounds") or 0) * len(xo.get("median_ms") or {})
    pts = [(int(r["env_steps"]), float(r["wall_s"])) for r in rows if "wall_s" in r]
    if pts and pts[0][0] == 0:  # an evaluation at step 0 before training
        pts = pts[1:]
    if (info.get("optimize") or {}).get("defers_metrics"):
        # a plan that finishes some metrics in a worker behind the next call (offload_component):
        # each report waits for its unit's deferred work while the next unit runs, so the reports'
        # cadence is the unit's, except the last interval, which times the last unit's deferred
        # work alone (nothing runs beside it); it is left out
        pts = pts[:-1]
    # interval j (report j -> j + 1) times unit j + 2; units 1..trial_units ran the trial
    return _steady(pts, max(trial_units - 1, 0))


def _trial_cost_s(info: dict[str, Any]) -> float | None:
    """Seconds the option trial cost beyond running those units with the kept build (its timed
    units; units run beside the background compiles ran the first build, counted as no cost)."""
    xo = info.get("xla_options") or {}
    med = xo.get("median_ms") or {}
    chosen = xo.get("chosen")
    if xo.get("cached") or chosen not in med:
        return 0.0 if xo.get("cached") or not med else None
    rounds = xo.get("rounds") or 0
    return round(sum(rounds * (m - med[chosen]) for m in med.values()) / 1e3, 3)


def _run(
    cmd: list[str], env: dict[str, str], timeout_s: float, log_path: str | None = None
) -> tuple[int | None, str, str, float]:
    """Run ``cmd``; ``(returncode or None on timeout, stdout, stderr, wall s)``. With ``log_path``,
    stdout and stderr go to that file as the child writes them (so a call cut short still shows
    how far the child got); both returned texts are then the whole log.

    The child runs in a session of its own, and a timeout ends that whole process group (SIGTERM,
    then SIGKILL after ``KILL_GRACE_S``): ``rose-jax train --mps-client`` trains in a grandchild,
    which ``subprocess.run``'s timeout (it kills the direct child only) would leave running beside
    the next variant, sharing its GPU."""
    t0 = time.perf_counter()
    if log_path is not None:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "w") as f:
            rc, _ = _run_group(cmd, env, timeout_s, stdout=f, stderr=subprocess.STDOUT)
        with open(log_path, errors="replace") as f:
            out = f.read()
        err = out if rc is not None else out + f"\ntimed out after {timeout_s:.0f}s"
        return rc, out, err, time.perf_counter() - t0
    rc, (out, err) = _run_group(cmd, env, timeout_s, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if rc is None:
        err = f"timed out after {timeout_s:.0f}s"
    return rc, out, err, time.perf_counter() - t0


KILL_GRACE_S = 20.0  # after SIGTERM on a timeout: for the MPS wrapper to stop its daemon, a trainer to exit
INTERRUPT_GRACE_S = 5.0  # the same when this harness is itself stopped (its own limit may follow soon)


def _run_group(
    cmd: list[str], env: dict[str, str], timeout_s: float, **streams
) -> tuple[int | None, tuple[str, str]]:
    """``cmd`` in a new session; ``(returncode or None on timeout, (stdout, stderr) as text where
    piped, else empty)``. On timeout its whole process group is ended (:func:`_end_group`); so it
    is when this harness is stopped while waiting (Ctrl-C, or SIGTERM: :func:`sigterm_exits`),
    since the child's own session no longer receives the signals sent to this one's group."""
    proc = subprocess.Popen(cmd, env=env, text=True, errors="replace", start_new_session=True, **streams)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, (out or "", err or "")
    except subprocess.TimeoutExpired:
        return None, _end_group(proc, KILL_GRACE_S)
    except BaseException:
        _end_group(proc, INTERRUPT_GRACE_S)
        raise


def _end_group(proc: subprocess.Popen, grace_s: float) -> tuple[str, str]:
    """SIGTERM to ``proc``'s process group; SIGKILL to what is left of it once the leader has
    exited and the group is gone or ``grace_s`` is over. The pipes are read meanwhile (a child
    writing as it stops must not block on a full pipe). Returns what it wrote to them."""
    import signal

    from rose_jax.runtime.process import group_alive, signal_group

    end = time.monotonic() + grace_s
    signal_group(proc.pid, signal.SIGTERM)
    out = err = None
    try:
        out, err = proc.communicate(timeout=grace_s)
        while group_alive(proc.pid) and time.monotonic() < end:  # the leader is gone; its group may stop too
            time.sleep(0.1)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None or group_alive(proc.pid):  # never a group id another session may own now
        signal_group(proc.pid, signal.SIGKILL)
    if out is None:
        try:
            out, err = proc.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            proc.kill()
            out = err = ""
    return out or "", err or ""


@contextlib.contextmanager
def sigterm_exits():
    """SIGTERM raises ``SystemExit(143)`` while inside (main thread only; elsewhere a no-op): a
    harness stopped by a call's limit (GNU ``timeout`` signals its group) unwinds through
    :func:`_run_group`, which ends the run's own session, instead of dying with it running."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _flags_env(variant: str) -> dict[str, str]:
    env = dict(os.environ)  # as shipped: the caller's environment, nothing added
    if variant == "peer_flags":
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {PEER_FLAGS}".strip()
    return env


def peer_run(
    name: str, variant: str, steps: int, smoke: bool, timeout_s: float, log_path: str | None = None
) -> dict[str, Any]:
    fd, result = tempfile.mkstemp(prefix=f"peer-{name}-", suffix=".json")
    os.close(fd)
    os.unlink(result)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.experiments.informed_peer",
        "--child-peer",
        name,
        "--steps",
        str(steps),
        "--result",
        result,
    ] + (["--smoke"] if smoke else [])
    env = _flags_env(variant)
    rc, _, err, wall = _run(cmd, env, timeout_s, log_path)
    data = {}
    if os.path.exists(result):
        with open(result) as f:
            data = json.load(f)
        os.unlink(result)
    reports = data.get("reports", [])
    steady, rates, sps = _peer_steady(reports)
    return {
        "end_to_end_s": round(wall, 2),
        "returncode": rc,
        "finished": bool(data.get("finished")),
        "env_steps": reports[-1]["env_steps"] if reports else None,
        "steady_env_steps_per_s": steady,
        "interval_rates": [round(r) for r in rates],
        "brax_training_sps": sps,
        "reports": len(reports),
        "final_eval_return": next(
            (r["eval_return"] for r in reversed(reports) if r["eval_return"] is not None), None
        ),
        "xla_flags": env.get("XLA_FLAGS", ""),
        "command": ("XLA_FLAGS=" + PEER_FLAGS + " " if variant == "peer_flags" else "")
        + f"python -m benchmarks.experiments.informed_peer --child-peer {name} --steps {steps}",
        "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1][:300],
    }


def _plan_key(out: str) -> dict[str, Any] | None:
    """``{"cache_key": KEY}`` from a ``--plan-only`` run's output (its plan-cache key line), else None."""
    from rose_jax.cli import PLAN_KEY_LINE

    keys = [ln[len(PLAN_KEY_LINE):].strip() for ln in (out or "").splitlines()
            if ln.startswith(PLAN_KEY_LINE)]
    return {"cache_key": keys[-1]} if keys else None


def rose_run(
    name: str,
    variant: str,
    steps: int,
    smoke: bool,
    caches: dict[str, str],
    timeout_s: float,
    extra_argv: tuple[str, ...] = (),
    log_path: str | None = None,
) -> dict[str, Any]:
    """One ``rose-jax train`` process (``extra_argv``: more of its flags, e.g. ``--optimize-budget``;
    ``log_path``: its output streamed there). ``rose_optimize_plan``: ``--optimize --plan-only``, the
    search alone (its plan cached, no training, no run directory)."""
    from algos import checkpoint
    from rose_jax import rundir

    argv = rose_argv(workloads()[name], steps, smoke)
    if variant.startswith("rose_optimize"):
        argv = argv + ["--optimize"]
    plan_only = variant == "rose_optimize_plan"
    argv = argv + list(extra_argv) + (["--plan-only"] if plan_only else [])
    run_dir = tempfile.mkdtemp(prefix=f"rose-{name}-{variant}-")
    os.rmdir(run_dir)
    where = [] if plan_only else ["--run-dir", run_dir]
    cmd = [sys.executable, "-m", "rose_jax.cli", "train", *argv, *where, "--no-tensorboard"]
    env = {
        **_flags_env(variant),
        "ROSE_JAX_COMPILE_CACHE": caches["compile"],
        "ROSE_JAX_PLAN_CACHE": caches["plans"],
    }
    rc, out, err, wall = _run(cmd, env, timeout_s, log_path)
    run = rundir.RunDir(run_dir)
    rows, info, summary = run.rows(), run.read_run() or {}, run.read_summary() or {}
    steady, rates = _rose_steady(rows, info)
    record = {
        "end_to_end_s": round(wall, 2),
        "returncode": rc,
        "finished": summary.get("status") == "finished",
        "env_steps": summary.get("env_steps"),
        "steady_env_steps_per_s": steady,
        "interval_rates": [round(r) for r in rates],
        "rows": len(rows),
        "final_eval_return": rows[-1].get("eval_episode_return", rows[-1].get("episode_return"))
        if rows
        else None,
        "checkpoint": checkpoint.latest_step(run.checkpoint_dir),
        "xla_options": info.get("xla_options"),
        # the plan a run trained with (run.json); a plan-only search has no run.json: its key line
        "optimize": info.get("optimize") or _plan_key(out),
        "trial_cost_s": _trial_cost_s(info),
        "xla_options_line": next((ln.strip() for ln in out.splitlines() if "XLA options" in ln), None),
        "command": "python -m rose_jax.cli train " + " ".join(argv),
        "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1][:300],
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    return record


def equality(name: str, steps: int, smoke: bool, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    fd, result = tempfile.mkstemp(prefix=f"equal-{name}-", suffix=".json")
    os.close(fd)
    os.unlink(result)
    argv = rose_argv(workloads()[name], steps, smoke)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.experiments.informed_peer",
        "--child-equal",
        json.dumps(options),
        "--result",
        result,
        "--",
        *argv,
    ]
    rc, _, err, wall = _run(cmd, dict(os.environ), timeout_s)
    if rc != 0 or not os.path.exists(result):
        return {
            "equal": None,
            "error": (err.strip().splitlines() or ["?"])[-1][:300],
            "wall_s": round(wall, 1),
        }
    with open(result) as f:
        data = json.load(f)
    os.unlink(result)
    return {**data, "wall_s": round(wall, 1)}


# ----------------------------------------------------------------------------------------------
# the table


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(records: list[dict[str, Any]], equal: dict[str, dict[str, Any]] | None = None) -> list[dict]:
    rows = []
    equal = equal or {}
    for name in dict.fromkeys(r["workload"] for r in records):
        mine = [r for r in records if r["workload"] == name]
        ok = {v: [r for r in mine if r["variant"] == v and r["returncode"] == 0] for v in ALL_VARIANTS}
        e2e = {v: _med([r["end_to_end_s"] for r in ok[v]]) for v in ALL_VARIANTS if ok[v]}
        spread = {
            v: [min(r["end_to_end_s"] for r in ok[v]), max(r["end_to_end_s"] for r in ok[v])]
            for v in ALL_VARIANTS
            if ok[v]
        }
        rate = {
            v: _med([r["steady_env_steps_per_s"] for r in ok[v] if r["steady_env_steps_per_s"]])
            for v in ALL_VARIANTS
        }
        rose_rates = [
            r["steady_env_steps_per_s"]
            for v in ("rose_first", "rose_cached")
            for r in ok[v]
            if r["steady_env_steps_per_s"]
        ]
        rose = _med(rose_rates)
        peers = [p for p in (rate["peer_default"], rate["peer_flags"]) if p]
        best_peer = max(peers) if peers else None
        calls = {
            r.get("call") for v in ("peer_default", "peer_flags", "rose_first", "rose_cached") for r in ok[v]
        }
        kept = [r for v in ("rose_first", "rose_cached") for r in ok[v] if r.get("xla_options")]
        plan = sorted({(r["xla_options"] or {}).get("chosen") or "default" for r in kept})
        trial = [r["trial_cost_s"] for r in ok["rose_first"] if r.get("trial_cost_s") is not None]
        search_s = _med(trial)
        breakeven = None
        if search_s is not None and rose and best_peer and rose > best_peer:
            breakeven = round(search_s / (1 / best_peer - 1 / rose))
        eq = equal.get(name) or {}
        w = workloads()[name]
        steps = next((r["num_timesteps"] for r in mine), None)
        peer_e2e = e2e.get("peer_flags")
        rows.append(
            {
                "workload": name,
                "what": w["what"],
                "num_timesteps": steps,
                "peer": "brax",
                "peer_flags": PEER_FLAGS,
                "peer_default_env_steps_per_s": rate["peer_default"],
                "peer_flags_env_steps_per_s": rate["peer_flags"],
                "rose_env_steps_per_s": rose,
                "speedup_vs_informed_peer": round(rose / best_peer, 3) if rose and best_peer else None,
                "end_to_end_s": e2e,
                "spread": spread,
                "repeats": {v: len(ok[v]) for v in ALL_VARIANTS if ok[v]},
                "failed": {
                    v: len([r for r in mine if r["variant"] == v and r["returncode"] != 0])
                    for v in ALL_VARIANTS
                    if any(r["variant"] == v for r in mine)
                },
                "same_call": len(calls) == 1 and None not in calls,
                "search_s": search_s,
                "breakeven_env_steps": breakeven,
                "plan": ", ".join(plan) or None,
                "equal": eq.get("equal"),
                "max_abs_diff": eq.get("max_abs_diff"),
                "rose_first_vs_peer_flags": round(peer_e2e / e2e["rose_first"], 3)
                if peer_e2e and e2e.get("rose_first")
                else None,
                "rose_cached_vs_peer_flags": round(peer_e2e / e2e["rose_cached"], 3)
                if peer_e2e and e2e.get("rose_cached")
                else None,
                "command": next((r["command"] for r in mine if r["variant"] == "rose_first"), None),
            }
        )
    return rows


TARGETS = (
    "speedup_vs_informed_peer >= 1.0; end_to_end_s.rose_first <= end_to_end_s.peer_flags; "
    "end_to_end_s.rose_cached at least 1.3x shorter than end_to_end_s.peer_flags"
)


def write(out: str, records: list[dict[str, Any]], equal: dict[str, dict[str, Any]], command: str) -> None:
    os.makedirs(out, exist_ok=True)
    summary = summarize(records, equal)
    machine = {**common.machine_info(), "command": command}
    date = machine.get("date")
    for row in summary:
        row["date"] = date
    atomic_write_json(
        os.path.join(out, "results.json"),
        {"machine": machine, "targets": TARGETS, "summary": summary, "equality": equal, "runs": records},
    )
    lines = [
        "# rose-jax vs the informed peer, end to end",
        "",
        f"{date} on {machine.get('gpu') or machine.get('backend')}; command: `{command}`. Generated by "
        "`benchmarks/experiments/informed_peer.py`.",
        "",
        "Peer = Brax's own trainer with Brax's published keywords, as shipped (`peer_default`) and with "
        f"`XLA_FLAGS={PEER_FLAGS}` (`peer_flags`). rose = `rose-jax train` with the same keywords, first "
        "run on empty compile and plan caches (`rose_first`) and the second run on them (`rose_cached`). "
        "Every run is its own process, timed from start to exit (imports and compiles included). Steady "
        "env-steps/s: median rate between progress reports after the compile and trial reports (Brax: "
        "after its first two training epochs). Speedup = rose over the faster peer variant.",
        "",
        f"Targets: {TARGETS}.",
        "",
    ]
    headers = [
        "workload",
        "steps",
        "peer default",
        "peer flags",
        "rose",
        "speedup vs informed peer",
        "e2e peer default s",
        "e2e peer flags s",
        "e2e rose first s",
        "e2e rose cached s",
        "first vs peer flags",
        "cached vs peer flags",
        "plan",
        "equal",
        "same call",
    ]

    def e2e(row, v):
        m = row["end_to_end_s"].get(v)
        s = row["spread"].get(v)
        n = row["repeats"].get(v, 0)
        return f"{common.fmt(m)} ({common.fmt(s[0])}-{common.fmt(s[1])}, n={n})" if m is not None else "-"

    table = [
        [
            r["workload"],
            f"{r['num_timesteps']:,}" if r["num_timesteps"] else "-",
            common.fmt(r["peer_default_env_steps_per_s"], ",.0f"),
            common.fmt(r["peer_flags_env_steps_per_s"], ",.0f"),
            common.fmt(r["rose_env_steps_per_s"], ",.0f"),
            common.fmt(r["speedup_vs_informed_peer"], ".3f"),
            e2e(r, "peer_default"),
            e2e(r, "peer_flags"),
            e2e(r, "rose_first"),
            e2e(r, "rose_cached"),
            common.fmt(r["rose_first_vs_peer_flags"], ".3f"),
            common.fmt(r["rose_cached_vs_peer_flags"], ".3f"),
            r["plan"] or "-",
            common.fmt_equal(r["equal"]),
            r["same_call"],
        ]
        for r in summary
    ]
    lines.append(common.markdown_table(headers, table))
    lines.append("")
    for r in summary:
        lines.append(
            f"- {r['workload']}: {r['what']}. Option trial cost {common.fmt(r['search_s'], '.2f')} s, "
            f"break-even {common.fmt(r['breakeven_env_steps'], ',.0f')} env steps; "
            f"max |diff| {common.fmt(r['max_abs_diff'], '.3g')}."
        )
    lines += ["", "Runs (each process):", ""]
    lines.append(
        common.markdown_table(
            [
                "workload",
                "variant",
                "#",
                "call",
                "rc",
                "end to end s",
                "steady env-steps/s",
                "Brax training/sps",
                "finished",
                "final eval return",
                "XLA options / error",
            ],
            [
                [
                    r["workload"],
                    r["variant"],
                    r["repeat"],
                    r.get("call"),
                    r["returncode"],
                    r["end_to_end_s"],
                    common.fmt(r["steady_env_steps_per_s"], ",.0f"),
                    common.fmt(r.get("brax_training_sps"), ",.0f"),
                    r.get("finished"),
                    common.fmt(r.get("final_eval_return"), ".1f"),
                    r.get("xla_options_line") or r.get("error") or "",
                ]
                for r in records
            ],
        )
    )
    common.write_markdown_and_plot(out, lines, plot, summary)


def plot(summary: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["workload"] for r in summary]
    rate_keys = (
        ("peer default", "peer_default_env_steps_per_s"),
        ("peer flags", "peer_flags_env_steps_per_s"),
        ("rose", "rose_env_steps_per_s"),
    )
    width = 0.8 / len(rate_keys)
    for i, (label, key) in enumerate(rate_keys):
        axes[0].bar(
            [k + i * width for k in range(len(names))], [r[key] or 0 for r in summary], width, label=label
        )
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs = [k + i * width for k in range(len(names))]
        meds = [r["end_to_end_s"].get(v) or 0 for r in summary]
        lo = [m - (r["spread"].get(v) or [m, m])[0] for m, r in zip(meds, summary, strict=True)]
        hi = [(r["spread"].get(v) or [m, m])[1] - m for m, r in zip(meds, summary, strict=True)]
        axes[1].bar(xs, meds, width, yerr=[lo, hi], capsize=2, label=v)
    axes[0].set_title("steady env-steps/s")
    axes[1].set_title("whole run s (median, min-max)")
    for ax, n in zip(axes, (len(rate_keys), len(VARIANTS)), strict=True):
        ax.set_xticks([k + 0.4 - 0.4 / n for k in range(len(names))], names)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    common.save_plot(fig, path)


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="sac-hopper,ppo-ant", help="comma-separated names of the workloads")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(ALL_VARIANTS)}")
    p.add_argument("--optimize-variants", action="store_true", help="add the --optimize first/cached runs")
    p.add_argument("--steps", type=float, default=None, help="env steps per run (default: the workload's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds")
    p.add_argument("--run-timeout-s", type=float, default=420.0)
    p.add_argument(
        "--check-equal",
        choices=("auto", "yes", "no"),
        default="auto",
        help="bitwise check of the kept option set (auto: on a GPU)",
    )
    p.add_argument("--out", default=OUT_DIR)
    p.add_argument("--merge", action="store_true", help="add to the runs already in --out/results.json")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke workload, one repeat")
    p.add_argument("--child-peer", help=argparse.SUPPRESS)
    p.add_argument("--child-equal", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    args = p.parse_args(argv)
    if args.child_peer:
        return child_peer(args.child_peer, int(args.steps), args.smoke, args.result)
    if args.child_equal is not None:
        return child_equal(rest, json.loads(args.child_equal), args.result)

    known = workloads()
    names = ["smoke"] if args.smoke else [w.strip() for w in args.workloads.split(",") if w.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.optimize_variants:
        variants += [v for v in OPTIMIZE_VARIANTS if v not in variants]
    for n in names:
        if n not in known:
            p.error(f"unknown workload {n!r}; known: {', '.join(known)}")
    for v in variants:
        if v not in ALL_VARIANTS:
            p.error(f"unknown variant {v!r}; known: {', '.join(ALL_VARIANTS)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    command = "python -m benchmarks.experiments.informed_peer " + " ".join(argv)
    records: list[dict[str, Any]] = []
    equal: dict[str, dict[str, Any]] = {}
    results = os.path.join(args.out, "results.json")
    if args.merge and os.path.exists(results):
        with open(results) as f:
            old = json.load(f)
        records = [r for r in old.get("runs", [])]
        equal = dict(old.get("equality") or {})
    date = common.machine_info(jax_devices=False).get("date")
    repeats = 1 if args.smoke else args.repeats
    tmp = tempfile.mkdtemp(prefix="informed-peer-")
    try:
        for repeat in range(1, repeats + 1):
            for name in names:
                steps = int(args.steps or known[name]["steps"])
                # fresh caches per repeat: rose_first runs on them empty, rose_cached on what it left
                caches = {}
                for kind in ("rose", "rose_optimize"):
                    base = os.path.join(tmp, f"{name}-{repeat}-{kind}")
                    caches[kind] = {
                        "compile": os.path.join(base, "compile"),
                        "plans": os.path.join(base, "plans"),
                    }
                for v in variants:
                    if common.elapsed() > args.budget_s:
                        common.log(f"budget spent: {name} {v} #{repeat} not run")
                        continue
                    if v.startswith("peer"):
                        rec = peer_run(name, v, steps, args.smoke, args.run_timeout_s)
                    else:
                        kind = "rose_optimize" if v.startswith("rose_optimize") else "rose"
                        rec = rose_run(name, v, steps, args.smoke, caches[kind], args.run_timeout_s)
                    rec = {
                        "workload": name,
                        "variant": v,
                        "repeat": repeat,
                        "call": date,
                        "num_timesteps": steps,
                        **rec,
                    }
                    records.append(rec)
                    common.log(
                        f"{name} {v} #{repeat}: rc={rec['returncode']} {rec['end_to_end_s']:.1f}s, steady "
                        f"{common.fmt(rec['steady_env_steps_per_s'], ',.0f')} env-steps/s "
                        f"{rec.get('xla_options_line') or rec.get('error') or ''}"
                    )
                    write(args.out, records, equal, command)
        import jax

        check = args.check_equal == "yes" or (args.check_equal == "auto" and jax.default_backend() == "gpu")
        for name in names if check else ():
            chosen = [
                r
                for r in records
                if r["workload"] == name and r["variant"] == "rose_first" and r.get("xla_options")
            ]
            if not chosen:
                continue
            opts = (chosen[-1]["xla_options"] or {}).get("options") or {}
            if common.elapsed() > args.budget_s + 60:
                common.log(f"budget spent: equality of {name} not checked")
                continue
            equal[name] = equality(
                name, int(args.steps or known[name]["steps"]), args.smoke, opts, args.run_timeout_s
            )
            common.log(f"{name} equality: {equal[name]}")
        write(args.out, records, equal, command)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


if __name__ == "__main__":
    with sigterm_exits():  # a call's limit ends the runs' own sessions too
        sys.exit(main())
