"""Many runs on one GPU: K seeds of one config as ONE vmapped program, K configs as K processes.

Two paths, one run directory per run (:mod:`rose_jax.rundir`'s layout: ``run.json``, the record
``metrics.jsonl``, derived ``metrics.json`` / ``learning_curve.png`` / ``summary.json``, and
``checkpoints/<env steps>/``):

* :func:`train_many` ``(config, env, seeds, settings=None)``: the algorithm's init is vmapped
  over ``K`` keys and its jitted step (PPO: one iteration; SAC: one epoch, as their ``train``
  drivers use) is vmapped over the leading run axis of the stacked TrainState: one compile, one
  dispatch per step for all runs. ``settings`` (one dict per run) adds per-run values of the
  algorithm's data fields (``DATA_FIELDS`` of :mod:`algos.ppo_core` / :mod:`algos.sac`: the
  scalars that enter the program only as arithmetic, e.g. learning rates, entropy cost,
  discount, tau, reward scaling): the step is built by :func:`settings_step` with those fields
  as traced values (:func:`settings_config`), so they are vmapped data, and the compile cache key
  holds the field names, not the values: any values of the same fields (and shapes) reuse one
  program. Each run has its own run directory, whose ``run.json`` holds that run's own config
  (seed and settings values); its metrics rows and checkpoints are slices of the vmapped state
  and metrics, so a run's checkpoint restores into a solo run of its config. Per-run results
  equal solo runs up to the summation order of batched vs unbatched kernels and the rounding of
  scalar constants folded in float64 vs float32 data (on a CPU: within rtol 1e-5 / atol 1e-6
  after a few steps, tests/test_sweep.py, tests/test_sweep_settings.py). The runs share fate:
  one program, one process.
* :class:`ProcessSweep` ``(runs, run_root)``: one OS process per :class:`RunSpec` (a config and
  its seeds, each process itself a :func:`train_many`), under one MPS daemon where MPS is
  available, each with its SM quota (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in the environment it
  is born with). A run that raises or is killed is reported; the daemon and the other runs go on.
  Without MPS (a CPU machine) the same processes run plainly and the reason is printed.

``rose-jax sweep`` (:func:`main_sweep`) picks the path: seeds only -> vmapped, ``--grid`` or
``--processes`` -> processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

CHECKPOINT_DIR = "checkpoints"
LOG_FILE = "log.txt"
PROCESS_FILE = "process.json"
JOB_FILE = "job.json"
SWEEP_FILE = "sweep.json"
DESCRIPTION = (
    "Train many runs on one GPU, each into its own run directory under --run-dir. Seeds only: one "
    "vmapped program (one compile, every seed in each step). --grid or --processes: one process per "
    "config (or seed) under one MPS daemon with SM quotas where MPS is available, plain processes "
    "otherwise; a run that fails is reported and the others go on."
)
PARENT_VAR = "ROSE_SWEEP_PARENT"  # the pid a sweep child must be the child of (else it exits)
STOP_GRACE_S = 10.0  # a stopped run's group gets SIGTERM, then SIGKILL after this long


# ----------------------------------------------------------------------------------------------
# Run directories (rose_jax.rundir's durable record) and the sweep's own files


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of a run directory's record (``metrics.jsonl``; a torn last line is skipped)."""
    from rose_jax.rundir import RunDir

    return RunDir(os.fspath(run_dir)).rows()


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    """A run directory's ``summary.json`` (None while the run goes on)."""
    from rose_jax.rundir import RunDir

    return RunDir(os.fspath(run_dir)).read_summary()


def seed_dirs(root: str | os.PathLike, seeds: Sequence[int]) -> list[str]:
    """``<root>/seed-<s>`` for each seed (the default layout of a seed sweep)."""
    return [os.path.join(os.fspath(root), f"seed-{s}") for s in seeds]


def _open_run(run_dir: str, info: dict, resume_step: int | None):
    """A RunDir whose record is open for appending: fresh, or cut back to ``resume_step``."""
    from rose_jax import rundir

    rundir.check_writable(run_dir)
    run = rundir.RunDir(run_dir)
    run.clean()
    if resume_step is None:
        if run.read_run() is not None or run.rows():
            raise ValueError(f"run dir {run_dir!r} already holds a run; use an empty directory "
                             "or resume=True")
        run.write_run(info)
        run.restart_record([])
    else:
        run.restart_record([r for r in run.rows() if int(r.get("env_steps", 0)) <= resume_step])
    return run


# ----------------------------------------------------------------------------------------------
# K seeds, one vmapped program


def _record_of(config: Any):
    from algos import registry as algo_registry

    for name in algo_registry.names():
        record = algo_registry.get(name)
        if isinstance(config, record.Config):
            return record
    known = ", ".join(algo_registry.get(n).Config.__name__ for n in algo_registry.names())
    raise ValueError(f"train_many: config must be one of {known}, got {type(config).__name__}")


def _unit(record: Any, config: Any, env: Any, resolved: Any) -> Callable:
    """The step of one progress report: SAC's epoch, PPO's iteration or (with ``num_evals``) its
    epoch with the evaluation (``eval_epoch`` resolves the env itself: given the unresolved one)."""
    if record.unit == "epoch":
        return record.epoch(config, resolved)
    if record.evaluates(config):  # Brax's epoch: the evaluation batched over the group by the vmap
        return record.module.eval_epoch(config, env)
    return record.iteration(config, resolved)


def _algo_of(config: Any, env: Any) -> tuple[Any, Any, Callable, int]:
    """(record, env, step, number of steps) of ``config`` on ``env``, validated."""
    record = _record_of(config)
    resolved = record.train_env(config, env)  # as train does (PPO: Brax envs, action_repeat)
    step = _unit(record, config, env, resolved)
    # with num_evals: Brax's max(num_evals - 1, 1) epochs (its step-0 evaluation is not run here)
    return record, resolved, step, record.num_units(config)


def check_seeds(seeds: Sequence[int], distinct: bool = True) -> tuple[int, ...]:
    seeds = tuple(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty sequence of non-negative ints, got {seeds!r}")
    if distinct and len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {seeds!r}")
    return tuple(int(s) for s in seeds)


# ----------------------------------------------------------------------------------------------
# Settings: config fields vmapped as data


def data_fields(config: Any) -> tuple[str, ...]:
    """The fields of ``config``'s algorithm that may be vmapped as data: its module's
    ``DATA_FIELDS`` (``algos.ppo_core.DATA_FIELDS``, ``algos.sac.DATA_FIELDS``; () if it has none)."""
    return tuple(getattr(_record_of(config).module, "DATA_FIELDS", ()))


def settings_config(config: Any, values: Mapping[str, Any]) -> Any:
    """A copy of ``config`` with the fields ``values`` replaced, WITHOUT ``__post_init__``.

    For the program of a settings group: ``values`` are tracers (one scalar per run under vmap),
    which the config's validation cannot check; :func:`train_many` validates every run's
    concrete values first (``dataclasses.replace``). ``config`` itself is not changed.
    """
    import copy

    out = copy.copy(config)  # a frozen dataclass: copied without __init__ / __post_init__
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out


def settings_step(config: Any, env: Any) -> Callable[[Any, Mapping[str, Any]], tuple[Any, Any]]:
    """``step(state, values) -> (state, metrics)``: the step of :func:`train_many` (PPO: one
    iteration; SAC: one epoch) of ``config`` on ``env`` with the fields in ``values`` (a dict
    ``{field: scalar array}``, fields of :func:`data_fields`) read from ``values`` as traced data:
    jit it (and vmap it over a leading run axis of ``state`` and ``values``) once, and any values
    of those fields run in that one compiled program. ``config``'s own values of those fields are
    not read. A field outside :func:`data_fields` is a one-line ValueError (when traced).
    """
    record, resolved, _, _ = _algo_of(config, env)  # validates; resolves the env (PPO) once
    allowed = data_fields(config)

    def step(state: Any, values: Mapping[str, Any]) -> tuple[Any, Any]:
        _check_fields(record, values, allowed)
        cfg = settings_config(config, values)
        return _unit(record, cfg, env, resolved)(state)

    return step


def _check_fields(record: Any, keys: Any, allowed: Sequence[str]) -> None:
    for name in keys:
        if name not in allowed:
            raise ValueError(f"train_many: settings field {name!r} is not data of {record.name} (a shape, "
                             f"loop count, branch or init input); allowed: {', '.join(allowed)}")


def _check_settings(config: Any, seeds: tuple[int, ...], settings: Sequence[Mapping[str, Any]]
                    ) -> tuple[tuple[dict, ...], tuple[Any, ...]]:
    """(the settings as dicts, each run's validated concrete config); one-line ValueErrors."""
    record = _record_of(config)
    if isinstance(settings, Mapping) or not isinstance(settings, Sequence):
        raise ValueError(f"train_many: settings must be a sequence of dicts (one per run), got "
                         f"{type(settings).__name__}")
    settings = tuple(settings)
    if len(settings) != len(seeds):
        raise ValueError(f"train_many: settings must hold {len(seeds)} dicts (one per seed), "
                         f"got {len(settings)}")
    if not all(isinstance(s, Mapping) for s in settings):
        raise ValueError("train_many: settings must be a sequence of dicts (one per run)")
    keys = list(settings[0])
    _check_fields(record, keys, data_fields(config))
    out, configs = [], []
    for i, (seed, one) in enumerate(zip(seeds, settings, strict=True)):
        if set(one) != set(keys):
            raise ValueError(f"train_many: every settings dict must have the same keys; settings[0] has "
                             f"{sorted(keys)}, settings[{i}] has {sorted(one)}")
        one = {k: (one[k].item() if isinstance(one[k], np.generic) else one[k]) for k in keys}
        configs.append(dataclasses.replace(config, seed=seed, **one))  # the config's own errors
        for k, v in one.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"train_many: settings[{i}][{k!r}] must be a number (data), got {v!r}")
        out.append(one)
    pairs = [(s, tuple(sorted(o.items()))) for s, o in zip(seeds, out, strict=True)]
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"train_many: the runs' (seed, settings) pairs must be distinct, got "
                         f"{list(zip(seeds, out, strict=True))!r}")
    return tuple(out), tuple(configs)


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """What :func:`train_many` returns.

    seeds: the K runs' seeds. state: the final TrainStates stacked on a leading axis of size K
    (for K = 1 too). metrics: per run, the host rows (dicts of floats) of the steps run by this
    call. run_dirs: per run, its run directory (None when none was given). stopped: a
    ``progress_fn`` raised ``algos.driver.StopTraining`` (the run ended early, with checkpoints).
    settings: per run, its settings dict (None when ``train_many`` got none).
    """

    seeds: tuple[int, ...]
    state: Any
    metrics: tuple[list[dict], ...]
    run_dirs: tuple[str | None, ...]
    stopped: bool = False
    settings: tuple[dict, ...] | None = None

    def seed_state(self, i: int) -> Any:
        """The final TrainState of run index ``i`` (unstacked, as a solo run's)."""
        return _slice(self.state, i)


def train_many(
    config: Any,
    env: Any,
    seeds: Sequence[int],
    *,
    settings: Sequence[Mapping[str, float]] | None = None,
    run_dirs: Sequence[str | os.PathLike] | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    progress_fn: Callable[[int, list[dict]], None] | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int | None = 3,
    checkpoints: bool = True,
    resume: bool = False,
    xla_options: Mapping[str, Mapping[str, Any]] | None = None,
    xla_options_cache: str | None = None,
    transform: Any = None,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Train K runs of one config (``len(seeds)``: seeds, and with ``settings`` the values of
    data fields) as one vmapped, jitted program.

    Run i is a solo run of ``dataclasses.replace(config, seed=seeds[i], **settings[i])``: the
    same result up to the summation order of batched kernels (within rtol 1e-5 / atol 1e-6 after
    a few steps on a CPU), the same run directory. The settings' values are data of the program
    (vmapped arrays), not constants in it: one compile serves any values of the same fields.

    Args:
      config: an algorithm's config (``PPOConfig``, ``SACConfig``); its ``seed`` is replaced by
        each of ``seeds``, its fields named in ``settings`` by each run's values.
      env: an ``envs.Env``, or a registry name (or ``"package.module:factory"``) built with
        ``env_kwargs``.
      seeds: K non-negative ints; run i starts from ``PRNGKey(seeds[i])``, as ``train(seed=s)``.
        Distinct without ``settings``; with it a seed may repeat, but the (seed, settings) pairs
        must be distinct.
      settings: None, or K dicts ``{field: number}`` (one per run, the same keys in each), each
        field one of the algorithm's ``DATA_FIELDS`` (:func:`data_fields`: scalars that enter the
        program only as arithmetic, e.g. PPO's learning_rate, entropy_cost, discounting; SAC's
        learning rates, discounting, tau). Another field is a one-line ValueError naming the
        allowed ones; a bad value (``discounting=1.5``) is the config's own one-line ValueError,
        before anything compiles or is written. With K = 1 the run is the solo program itself.
      run_dirs: one directory per run (e.g. :func:`seed_dirs` for distinct seeds), or None for no
        files. Each is a ``rose_jax.rundir`` run directory: ``run.json`` (its ``config`` is the
        run's own, seed and settings values included), the record ``metrics.jsonl`` (one row per
        step: ``env_steps``, ``wall_s`` since the start, ``time`` (unix seconds), the step's scalar
        metrics), the derived ``metrics.json`` / ``learning_curve.png`` / ``summary.json``, and
        ``checkpoints/`` holding that run's slices of the vmapped state (restorable by a solo run
        of its config).
      progress_fn: ``progress_fn(env_steps, rows)`` after each step, ``rows`` one dict per run; it
        may raise ``algos.driver.StopTraining`` to stop after the step in flight, with checkpoints.
      checkpoint_every: also checkpoint every N steps (PPO: iterations; SAC: epochs); with
        ``run_dirs`` a checkpoint is always written at the end (and on a stop).
      keep_checkpoints: keep the N newest checkpoints per run plus the best (None: all).
      checkpoints: False writes no checkpoint at all (records only; e.g. for benchmarks).
      resume: continue from each run's latest checkpoint (all runs must be at the same step).
      xla_options: ``{name: XLA compiler options}`` tried on the group's first steps against XLA's
        defaults, the fastest kept (:class:`rose_jax.optimize.xla_options.TrialStep`, as ``rose-jax
        train`` does; e.g. ``xla_options.candidate_sets()``, empty on a CPU); the decision is one
        line through ``log`` and recorded in every run's ``run.json`` (``xla_options``). None or
        empty: XLA's defaults, no trial. ``xla_options_cache``: the plan cache where the decision
        is stored and found again by a later group of the same program (no trial then).
      transform: a ``rose_jax.optimize`` ``Transform`` (``level="fn"``) applied to the unit step
        before it is vmapped and jitted (e.g. to train a candidate plan's program for
        ``algos.equivalence.learning_check``). None: the step as the algorithm defines it.

    Returns:
      a :class:`SweepResult`. On an exception every seed's summary says ``failed`` with the error.
    """
    import jax

    from algos import checkpoint, driver

    if isinstance(env, str):
        env_name = env
        env = make_env(env, env_kwargs)
    else:
        env_name = getattr(env, "name", str(env))
    seeds = check_seeds(seeds, distinct=settings is None)
    k = len(seeds)
    record, _, _, num_steps = _algo_of(config, env)  # validates; _compiled resolves the env itself
    configs = tuple(dataclasses.replace(config, seed=s) for s in seeds)
    fields: tuple[str, ...] = ()
    values = None
    if settings is not None:
        settings, configs = _check_settings(config, seeds, settings)
        if k == 1:  # one run: its own config, the solo program
            config = configs[0]
        else:
            fields = tuple(sorted(settings[0]))
            values = {f: np.asarray([s[f] for s in settings], np.float32) for f in fields}
    if run_dirs is not None:
        run_dirs = [os.fspath(d) for d in run_dirs]
        if len(run_dirs) != k or len(set(map(os.path.abspath, run_dirs))) != k:
            raise ValueError(f"run_dirs must be {k} distinct directories (one per run), got {run_dirs!r}")
    driver.check_loop_args(run_dirs if checkpoints else None, checkpoint_every, keep_checkpoints)
    if resume and (run_dirs is None or not checkpoints):
        raise ValueError("train_many: resume=True needs run_dirs with checkpoints")

    batched = k > 1
    if transform is not None and getattr(transform, "level", None) != "fn":
        raise ValueError(f"train_many: transform must be a level='fn' Transform, got {transform!r}")
    init_fn, step = _compiled(config, env, batched, fields, transform)
    if values is not None:
        values_step, values = step, jax.device_put(values)  # one transfer; each step reads them

        def step(state):
            return values_step(state, values)
    runs: list[Any] = []
    infos: list[dict] = []  # each run's run.json, rewritten with the option trial's decision
    if xla_options:
        from rose_jax.optimize import xla_options as xo

        if xo.trial_rounds(num_steps, xla_options) == 0:  # too short a run to decide: XLA's defaults
            log(f"[{record.name} x{k}] XLA options: default build "
                f"({num_steps} units are too few for a trial)")
            xla_options = None
    if xla_options:

        raw = _raw_cached(_compiled_key(config, fields), env, batched, fields, transform)[1]
        rounds = xo.trial_rounds(num_steps, xla_options)

        def decided(line: str) -> None:
            log(f"[{record.name} x{k}] {line}")
            for run, info in zip(runs, infos, strict=False):
                run.write_run({**info, "xla_options": trial.describe()})

        if values is None:
            trial = step = xo.TrialStep(raw, dict(xla_options), rounds=rounds, log=decided,
                                        cache_dir=xla_options_cache)
        else:  # the values ride in the carry (donated with the state, returned as they are)
            def unit(carry):
                new_state, metrics = raw(carry[0], carry[1])
                return (new_state, carry[1]), metrics

            trial = xo.TrialStep(unit, dict(xla_options), rounds=rounds, log=decided,
                                 cache_dir=xla_options_cache)

            def step(state):
                nonlocal values
                (state, values), metrics = trial((state, values))
                return state, metrics
    keys = jax.numpy.stack([jax.random.PRNGKey(s) for s in seeds])
    state = init_fn(keys) if batched else init_fn(keys[0])
    ckpt_dirs = [os.path.join(d, CHECKPOINT_DIR) for d in run_dirs] if run_dirs and checkpoints else None
    restored = _restore_all(ckpt_dirs, state, batched) if resume else None
    resume_step = None
    if restored is not None:
        resume_step, state = restored
    elif ckpt_dirs:
        for d in ckpt_dirs:
            if checkpoint.latest_step(d) is not None:
                raise ValueError(f"{d!r} already holds checkpoints; pass resume=True or use empty "
                                 "run directories")

    title = f"{record.name} on {env_name}"
    history: list[list[dict]] = [[] for _ in seeds]
    try:
        if run_dirs is not None:
            for d, run_config in zip(run_dirs, configs, strict=True):
                info = {"algo": record.name, "env": env_name, "env_kwargs": dict(env_kwargs or {}),
                        "config": dataclasses.asdict(run_config), "sweep_seeds": list(seeds)}
                if settings is not None:
                    info["sweep_settings"] = [dict(s) for s in settings]
                infos.append(json.loads(json.dumps(info, default=_json_default)))
                runs.append(_open_run(d, infos[-1], resume_step))
        t0 = time.perf_counter()
        first = _slice(state, 0) if batched else state
        start = record.units_done(config, jax.device_get(first))
        pending, stop = None, False

        def flush(metrics) -> None:
            nonlocal stop
            rows = _rows(metrics, k, batched, time.perf_counter() - t0)
            for i, row in enumerate(rows):
                history[i].append(row)
                if runs:
                    runs[i].append(row)
            if progress_fn is not None:
                try:
                    progress_fn(int(rows[0]["env_steps"]), rows)
                except driver.StopTraining:
                    stop = True

        for i in range(start, num_steps):
            state, metrics = step(state)
            if pending is not None:
                flush(pending)
            pending = metrics
            last = i + 1 == num_steps
            due = last or bool(checkpoint_every and (i + 1) % checkpoint_every == 0)
            if stop or (ckpt_dirs and due):
                flush(pending)
                pending = None
                if ckpt_dirs:
                    _save_all(ckpt_dirs, state, batched, keep_checkpoints, [h[-1] for h in history])
                if stop and not last:
                    break
        if pending is not None:
            flush(pending)
        for run in runs:
            run.finish("interrupted" if stop else "finished", title, {"seeds": list(seeds)})
        stacked = state if batched else jax.tree.map(lambda x: x[None], state)
        return SweepResult(seeds, stacked, tuple(history), tuple(run_dirs) if run_dirs else (None,) * k, stop,
                           settings)
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        for run in runs:
            run.finish(status, title, {"error": _one_line(e)})
        raise


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def _compiled(config: Any, env: Any, batched: bool,
              fields: tuple[str, ...] = (), transform: Any = None) -> tuple[Callable, Callable]:
    """(init, step), jitted and vmapped when ``batched``; cached per (config without seed and
    without the values of ``fields``, env, fields): the seed only enters through the init key,
    ``fields`` (data fields) through ``step(state, values)`` (:func:`settings_step`), so every
    value of them shares one program. The key config holds the class defaults of ``fields``;
    init reads no data field (``DATA_FIELDS``' rule), so its state is each run's."""
    return _compiled_cached(_compiled_key(config, fields), env, batched, tuple(fields), transform)


def _compiled_key(config: Any, fields: Sequence[str]) -> Any:
    """The config a group's program is cached under: seed 0, ``fields`` at their class defaults."""
    defaults = {f: type(config).__dataclass_fields__[f].default for f in fields}
    return dataclasses.replace(config, seed=0, **defaults)


@functools.lru_cache(maxsize=16)
def _raw_cached(config: Any, env: Any, batched: bool,
                fields: tuple[str, ...] = (), transform: Any = None) -> tuple[Callable, Callable]:
    """(init, step) before jit: vmapped when ``batched``; ``step(state[, values])``; ``transform``
    (a Transform) rewrites the unbatched step first."""
    import jax

    record, env_resolved, step, _ = _algo_of(config, env)
    if fields:
        step = settings_step(config, env)  # resolves env itself (PPO's resolve_env wraps again)
    if transform is not None:
        step = transform.apply(step)

    def init(key):
        return record.init(config, env_resolved, key)

    return (jax.vmap(init), jax.vmap(step)) if batched else (init, step)


@functools.lru_cache(maxsize=16)
def _compiled_cached(config: Any, env: Any, batched: bool,
                     fields: tuple[str, ...] = (), transform: Any = None) -> tuple[Callable, Callable]:
    import jax

    init, step = _raw_cached(config, env, batched, fields, transform)
    donate = (0,) if jax.default_backend() != "cpu" else ()  # CPU cannot donate (it would warn)
    return (jax.jit(init) if batched else init), jax.jit(step, donate_argnums=donate)


def _rows(metrics: Any, k: int, batched: bool, wall_s: float) -> list[dict]:
    """Device metrics (leaves of shape (K,) when batched, () otherwise) -> K host rows of scalars."""
    import jax

    if hasattr(metrics, "_asdict"):
        metrics = metrics._asdict()
    host = jax.device_get(dict(metrics))
    now = time.time()
    rows = []
    for i in range(k):
        row: dict[str, Any] = {}
        for name, value in host.items():
            value = np.asarray(value)
            value = value[i] if batched else value
            if value.ndim == 0:
                row[name] = value.item()
        row["env_steps"] = int(row["env_steps"])
        row["wall_s"], row["time"] = wall_s, now
        rows.append(row)
    return rows


def _save_all(ckpt_dirs: Sequence[str], state: Any, batched: bool, keep: int | None,
              rows: Sequence[dict]) -> None:
    import jax

    from algos import checkpoint, driver

    host = jax.device_get(state)  # one transfer; each seed's checkpoint is a slice of it
    for i, d in enumerate(ckpt_dirs):
        one = _slice(host, i) if batched else host
        checkpoint.save(d, one, int(np.asarray(one.env_steps)), keep=keep, score=driver.score_of(rows[i]))


def _restore_all(ckpt_dirs: Sequence[str], like: Any, batched: bool) -> tuple[int, Any] | None:
    """(step, stacked state) from each seed's latest checkpoint; None when no seed has one."""
    import jax

    from algos import checkpoint

    latest = [checkpoint.latest_step(d) for d in ckpt_dirs]
    if all(s is None for s in latest):
        return None
    if len(set(latest)) != 1:
        raise ValueError(f"resume: the seeds' latest checkpoints differ "
                         f"({dict(zip(ckpt_dirs, latest, strict=True))})")
    parts = []
    for i, d in enumerate(ckpt_dirs):
        one_like = _slice(like, i) if batched else like
        parts.append(checkpoint.restore(d, one_like, latest[0])[0])
    state = jax.tree.map(lambda *xs: jax.numpy.stack(xs), *parts) if batched else parts[0]
    return latest[0], state


def _slice(tree: Any, i: int) -> Any:
    """Seed ``i`` of a stacked pytree."""
    import jax

    return jax.tree.map(lambda x: x[i], tree)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:500]


def make_env(name: str, env_kwargs: Mapping[str, Any] | None = None):
    """``envs.make(name, **env_kwargs)``, or a factory named ``"package.module:function"``."""
    import envs

    kwargs = dict(env_kwargs or {})
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"env factory {name!r} cannot be imported: {e}") from None
        return factory(**kwargs)
    return envs.make(name, **kwargs)


# ----------------------------------------------------------------------------------------------
# K configs, K processes (under one MPS daemon where there is one)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One process of a :class:`ProcessSweep`: a config (``algo`` + ``overrides``) and its seeds.

    name: unique in the sweep, ``[A-Za-z0-9_.-]{1,64}``; the run's directory is ``<root>/<name>``
      (with one seed) or ``<root>/<name>/seed-<s>`` (several seeds, vmapped in that process).
    env: a registry name (``envs.names()``) or ``"package.module:factory"``; ``env_kwargs`` go to it.
    overrides: config fields as ``{field: value}`` (JSON-able values), checked here.
    checkpoint_every / keep_checkpoints / checkpoints: as in :func:`train_many`.
    settings: per seed, ``((field, value), ...)`` of data fields (:func:`train_many`'s
      ``settings``; seeds may then repeat); () for none.
    dirs: the runs' directories (one per seed) instead of the layout above (``rose-jax bench``).
    resume: continue every run from its latest checkpoint (:func:`train_many`'s ``resume``).
    xla_options: ``"auto"`` / ``"default"`` / set names, as ``rose-jax train --xla-options``.
    """

    name: str
    algo: str
    env: str
    overrides: tuple[tuple[str, Any], ...] = ()
    seeds: tuple[int, ...] = (0,)
    env_kwargs: tuple[tuple[str, Any], ...] = ()
    checkpoint_every: int | None = None
    keep_checkpoints: int | None = 3
    checkpoints: bool = True
    settings: tuple[tuple[tuple[str, Any], ...], ...] = ()
    dirs: tuple[str, ...] = ()
    resume: bool = False
    xla_options: str = "default"  # `rose-jax train --xla-options`: auto tries option sets (GPU)

    def __post_init__(self):
        from rose_jax.mps.plan import WorkerSpec

        WorkerSpec(self.name)  # the name rule of MPS workers
        for field in ("overrides", "env_kwargs"):
            value = getattr(self, field)
            items = value.items() if isinstance(value, Mapping) else value
            object.__setattr__(self, field, tuple(sorted((str(a), b) for a, b in items)))
        object.__setattr__(self, "seeds", check_seeds(self.seeds, distinct=not self.settings))
        object.__setattr__(self, "settings", tuple(
            tuple(sorted((str(a), b) for a, b in (s.items() if isinstance(s, Mapping) else s)))
            for s in self.settings))
        object.__setattr__(self, "dirs", tuple(os.fspath(d) for d in self.dirs))
        from rose_jax.optimize import xla_options as xo

        xo.sets_from_spec(self.xla_options)  # a bad spec is a one-line error here
        for field, n in (("settings", len(self.settings)), ("dirs", len(self.dirs))):
            if n and n != len(self.seeds):
                raise ValueError(f"RunSpec {self.name!r}: {field} must hold one entry per seed "
                                 f"({len(self.seeds)}), "
                                 f"got {n}")
        if not isinstance(self.env, str) or not self.env:
            raise ValueError(f"RunSpec {self.name!r}: env must be a registry name or 'module:factory'")
        import envs

        if ":" not in self.env and self.env not in envs.names():
            raise ValueError(f"unknown env {self.env!r}; known envs: {', '.join(envs.names())}")
        if "seed" in dict(self.overrides):
            raise ValueError(f"RunSpec {self.name!r}: give seeds=(...), not overrides['seed']")
        self.config()  # a bad config is an error here, before any process starts

    def config(self):
        from algos import registry as algo_registry

        try:
            return algo_registry.make_config(self.algo, **dict(self.overrides))
        except TypeError as e:  # an unknown key: the registry's one line, as a ValueError
            raise ValueError(str(e)) from None

    def num_steps(self) -> int:
        """Progress units (PPO iterations, SAC epochs) of the whole run."""
        from algos import registry as algo_registry

        return algo_registry.get(self.algo).num_units(self.config())

    def run_dirs(self, root: str | os.PathLike) -> list[str]:
        if self.dirs:
            return list(self.dirs)
        base = os.path.join(os.fspath(root), self.name)
        return [base] if len(self.seeds) == 1 else seed_dirs(base, self.seeds)

    def branch_key(self) -> tuple:
        """Runs with equal keys are identical branches: one program and one length (only seeds differ)."""
        return (self.algo, self.env, self.env_kwargs, dataclasses.replace(self.config(), seed=0),
                len(self.seeds), self.settings)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "RunSpec":
        d = dict(d)
        for f in ("overrides", "env_kwargs"):
            d[f] = tuple((a, _tuplify(b)) for a, b in d.get(f, ()))
        d["seeds"] = tuple(d.get("seeds", (0,)))
        d["settings"] = tuple(tuple((a, _tuplify(b)) for a, b in one) for one in d.get("settings", ()))
        d["dirs"] = tuple(d.get("dirs", ()))
        return RunSpec(**d)

    def settings_dicts(self) -> list[dict[str, Any]] | None:
        return [dict(one) for one in self.settings] if self.settings else None


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How one process of a sweep ended.

    status: ``finished``, ``failed`` (raised; ``error`` is its one-line message), ``killed`` (by
      signal ``signal``), or ``stopped`` (ended by the sweep itself: Ctrl-C or its timeout).
    """

    name: str
    status: str
    returncode: int | None
    signal: str | None
    error: str | None
    run_dirs: tuple[str, ...]
    pid: int
    quota: int | None
    start_time: float
    end_time: float
    env_steps: int | None
    final_return: float | None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProcessSweepResult:
    outcomes: tuple[RunOutcome, ...]
    mps: bool
    mps_reason: str
    quotas: tuple[int | None, ...]
    quota_reason: str
    wall_s: float
    quota_search: dict | None = None  # the slack-aware search's points, models and choice, if one ran

    @property
    def ok(self) -> bool:
        return all(o.status == "finished" for o in self.outcomes)

    def to_json(self) -> dict:
        return {"outcomes": [o.to_json() for o in self.outcomes], "mps": self.mps,
                "mps_reason": self.mps_reason, "quotas": list(self.quotas),
                "quota_reason": self.quota_reason, "wall_s": self.wall_s, "quota_search": self.quota_search}


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ProcessSweep:
    """Run :class:`RunSpec` s as concurrent processes, each its own run directory.

        with ProcessSweep(runs, "runs/sweep-1") as sweep:   # starts the daemon and the processes
            result = sweep.wait()                          # every run's RunOutcome

    Args:
      runs: the runs (distinct names).
      run_root: each run writes ``<run_root>/<name>`` (see :class:`RunSpec`); the sweep writes
        ``<run_root>/sweep.json`` when it ends.
      mps: ``"auto"`` (MPS where ``rose_jax.mps.mps_status`` says it is available, else plain
        processes, the reason printed), True (required), False (plain processes).
      daemon: an MPS daemon to join (e.g. ``MPSDaemon`` you started; it is not stopped here).
        Otherwise the process's inherited daemon is joined or, with MPS on, one is started and
        stopped at the end (:func:`rose_jax.mps.worker_daemon`).
      quotas: SM percent per run: ``"auto"`` (runs of one program: the even split, which is the
        slack-aware optimum for identical branches; different programs: the slack-aware search
        of ``rose_jax.mps.search_quotas`` over short probe runs at a few quotas), ``"even"``,
        ``"search"``, a sequence of ints, or None (no limit). Without MPS there are no quotas.
      compile_cache_dir: JAX's persistent compilation cache for every process (probes and runs
        of one program compile once); None: a temporary one for this sweep, "": none.
      log: where progress lines go.
    """

    def __init__(self, runs: Sequence[RunSpec], run_root: str | os.PathLike, *, mps: Any = "auto",
                 daemon: Any = None, quotas: Any = "auto", compile_cache_dir: str | None = None,
                 log: Callable[[str], None] = print, python: str = sys.executable):
        runs = tuple(runs)
        if not runs or not all(isinstance(r, RunSpec) for r in runs):
            raise ValueError("ProcessSweep needs at least one RunSpec")
        names = [r.name for r in runs]
        if len(set(names)) != len(names):
            raise ValueError(f"run names must be unique, got {names}")
        if mps not in ("auto", True, False):
            raise ValueError(f"mps must be 'auto', True or False, got {mps!r}")
        if isinstance(quotas, str):
            if quotas not in ("auto", "even", "search"):
                raise ValueError(f"quotas must be 'auto', 'even', 'search', None or ints, got {quotas!r}")
        elif quotas is not None:
            try:
                quotas = tuple(int(q) for q in quotas)
            except (TypeError, ValueError):
                raise ValueError(f"quotas must be 'auto', 'even', 'search', None or ints, "
                                 f"got {quotas!r}") from None
            if len(quotas) != len(runs) or not all(1 <= q <= 100 for q in quotas):
                raise ValueError(f"quotas must be {len(runs)} ints in 1..100 (one per run), got {quotas!r}")
        self.runs, self.root, self.log, self.python = runs, Path(run_root).absolute(), log, python
        self._mps_arg, self._given_daemon, self._quota_arg = mps, daemon, quotas
        self._cache_arg = compile_cache_dir
        self.daemon = None
        self._own_daemon = None
        self._tmp_cache: str | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Any] = {}
        self._start: dict[str, float] = {}
        self._outcomes: dict[str, RunOutcome] = {}
        self._stopping: set[str] = set()
        self.mps, self.mps_reason = False, ""
        self.quotas: tuple[int | None, ...] = (None,) * len(runs)
        self.quota_reason = "no MPS: no quotas"
        self.quota_search: dict | None = None
        self.t0 = time.monotonic()

    # -------------------------------------------------------------------- lifecycle
    def __enter__(self) -> "ProcessSweep":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "ProcessSweep":
        """Decide MPS and quotas, then start every run's process."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for run in self.runs:
                for d in run.run_dirs(self.root):
                    if read_metrics(d) and not run.resume:
                        raise ValueError(f"run dir {d!r} already holds metrics; use a new run root")
            self._setup_cache()
            self._setup_mps()
            self.quotas, self.quota_reason = self._resolve_quotas()
            self.log(f"[sweep] quotas: {self._quota_text()} ({self.quota_reason})")
            for run, quota in zip(self.runs, self.quotas, strict=True):
                self._spawn(run, quota)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self._procs.items()}

    def poll(self) -> dict[str, RunOutcome]:
        """Collect the runs that ended since the last call; returns every outcome so far."""
        from rose_jax.runtime.process import group_alive, stop_groups

        for run in self.runs:
            p = self._procs.get(run.name)
            if p is not None and run.name not in self._outcomes and p.poll() is not None:
                if group_alive(p.pid):  # the run's process died, its children (plan workers) did not
                    stop_groups([p], STOP_GRACE_S)
                self._finish(run, p.returncode)
        return dict(self._outcomes)

    def wait(self, timeout: float | None = None, *, report_every: float = 30.0) -> ProcessSweepResult:
        """Wait for every run (or ``timeout`` seconds: the rest are stopped); the sweep's result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_report = time.monotonic()
        try:
            while len(self.poll()) < len(self.runs):
                if deadline is not None and time.monotonic() > deadline:
                    self.log(f"[sweep] timeout after {timeout:.0f}s: stopping the runs still going")
                    self._stop_all()
                    break
                if time.monotonic() - last_report > report_every:
                    last_report = time.monotonic()
                    self.log("[sweep] " + self.progress_line())
                time.sleep(0.1)
        except KeyboardInterrupt:
            self.log("[sweep] interrupted: stopping every run")
            self._stop_all()
            raise
        finally:
            self.poll()
        return self.result()

    def result(self) -> ProcessSweepResult:
        outcomes = tuple(self._outcomes[r.name] for r in self.runs if r.name in self._outcomes)
        return ProcessSweepResult(outcomes, self.mps, self.mps_reason, self.quotas, self.quota_reason,
                                  time.monotonic() - self.t0, self.quota_search)

    def close(self) -> None:
        """Stop what still runs, then the daemon this sweep started; write ``sweep.json``. Idempotent."""
        try:
            self._stop_all()
            self.poll()
        finally:
            for f in self._logs.values():
                f.close()
            self._logs.clear()
            if self._own_daemon is not None:
                from rose_jax.mps import stop_own

                stop_own(self._own_daemon)
                self._own_daemon = None
            if self._tmp_cache is not None:
                import shutil

                shutil.rmtree(self._tmp_cache, ignore_errors=True)
                self._tmp_cache = None
            if self._outcomes:
                from rose_jax.io import atomic_write_json

                atomic_write_json(str(self.root / SWEEP_FILE), self.result().to_json())

    def progress_line(self) -> str:
        parts = []
        for run in self.runs:
            rows = [read_metrics(d) for d in run.run_dirs(self.root)]
            steps = min((r[-1]["env_steps"] if r else 0) for r in rows)
            state = self._outcomes[run.name].status if run.name in self._outcomes else "running"
            parts.append(f"{run.name}: {state} {steps:,}")
        return f"{time.monotonic() - self.t0:.0f}s  " + "; ".join(parts)

    # -------------------------------------------------------------------- internals
    def _setup_cache(self) -> None:
        if self._cache_arg is None:
            self._tmp_cache = tempfile.mkdtemp(prefix="rose-sweep-xla-")
            self.cache_dir = self._tmp_cache
        else:
            self.cache_dir = self._cache_arg

    def _setup_mps(self) -> None:
        from rose_jax.mps import inherited_daemon, mps_status

        if self._given_daemon is not None:
            self.daemon, self.mps, self.mps_reason = self._given_daemon, True, "joined the given MPS daemon"
        elif self._mps_arg is False:
            self.mps_reason = "MPS off (mps=False): plain processes"
        elif inherited_daemon() is not None:
            self.daemon, self.mps = inherited_daemon(), True
            self.mps_reason = f"joined the inherited MPS daemon {self.daemon.pipe_dir}"
        else:
            ok, reason = mps_status()
            if not ok:
                if self._mps_arg is True:
                    raise RuntimeError(f"sweep: mps=True but {reason}")
                self.mps_reason = f"{reason}: plain processes, no SM quotas"
            else:
                from rose_jax.mps import worker_daemon

                self.daemon, self._own_daemon = worker_daemon(prefix="rsw")
                self.mps, self.mps_reason = True, f"started an MPS daemon ({self.daemon.pipe_dir})"
        self.log(f"[sweep] {len(self.runs)} processes; {self.mps_reason}")

    def _resolve_quotas(self) -> tuple[tuple[int | None, ...], str]:
        from rose_jax.mps import even_quotas

        k, arg = len(self.runs), self._quota_arg
        if not self.mps:
            return (None,) * k, "no MPS: no quotas"
        if arg is None:
            return (None,) * k, "quotas=None: no limit"
        if isinstance(arg, str):
            same = len({r.branch_key() for r in self.runs}) == 1
            if arg == "even" or (arg == "auto" and same):
                why = ("identical runs (one program, one length): the even split is the slack-aware "
                       "optimum" if same else "even split (asked)")
                return even_quotas(k), why
            result = search_run_quotas(self.runs, self, log=self.log)
            self.quota_search = result.to_dict()
            return result.quotas, (f"slack-aware search over probe runs: modelled join "
                                   f"{result.predicted_join_s:.1f}s vs {result.predicted_even_join_s:.1f}s "
                                   f"even ({result.predicted_gain:+.0%})")
        return arg, "given"

    def _quota_text(self) -> str:
        return ", ".join(f"{r.name}={'-' if q is None else str(q) + '%'}"
                         for r, q in zip(self.runs, self.quotas, strict=True))

    def child_env(self, name: str, quota: int | None) -> dict[str, str]:
        """The explicit environment a run's process is born with (MPS variables and its quota)."""
        from rose_jax.mps.plan import WorkerSpec, worker_environment

        extra = {PARENT_VAR: str(os.getpid())}
        path = os.environ.get("PYTHONPATH", "")
        extra["PYTHONPATH"] = repo_root() + (os.pathsep + path if path else "")
        if self.cache_dir:
            extra["JAX_COMPILATION_CACHE_DIR"] = self.cache_dir
            extra["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
        spec = WorkerSpec(name, quota=quota, env=extra)
        mps_env = self.daemon.client_env() if self.daemon is not None else None
        return worker_environment(spec, mps_env=mps_env)

    def _spawn(self, run: RunSpec, quota: int | None) -> None:
        dirs = run.run_dirs(self.root)
        base = self.root / run.name
        base.mkdir(parents=True, exist_ok=True)
        from rose_jax.io import atomic_write_json

        job = base / JOB_FILE
        atomic_write_json(str(job), {"run": run.to_json(), "run_dirs": dirs, "quota": quota})
        self._logs[run.name] = open(base / LOG_FILE, "ab")
        self._start[run.name] = time.time()
        self._procs[run.name] = subprocess.Popen(
            [self.python, "-m", "algos.sweep", "--child", str(job)],
            env=self.child_env(run.name, quota), cwd=repo_root(), stdin=subprocess.DEVNULL,
            stdout=self._logs[run.name], stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches the sweep, which stops its runs in order
        )
        self.log(f"[sweep] started {run.name} (pid {self._procs[run.name].pid}, "
                 f"quota {quota if quota is not None else '-'}) -> {base}")

    def _stop_all(self) -> None:
        """Stop every run still going, each run's whole process group (its own session: a run's
        plan workers or wrapper's child too), SIGKILL after STOP_GRACE_S."""
        from rose_jax.runtime.process import stop_groups

        live = {n: p for n, p in self._procs.items() if p.poll() is None}
        self._stopping.update(live)
        stop_groups(list(live.values()), STOP_GRACE_S)

    def _finish(self, run: RunSpec, rc: int) -> None:
        from rose_jax.rundir import RunDir

        dirs = run.run_dirs(self.root)
        summaries = [read_summary(d) or {} for d in dirs]
        sig = signal.Signals(-rc).name if rc < 0 else None
        error = next((s.get("error") for s in summaries if s.get("error")), None)
        if rc == 0:
            status = "finished"
        elif run.name in self._stopping:
            status, error = "stopped", "stopped by the sweep"
        elif sig is not None:
            status, error = "killed", f"killed by {sig}"
        else:
            status = "failed"
            error = error or _log_tail(self.root / run.name / LOG_FILE)
        for d, s in zip(dirs, summaries, strict=True):  # each run dir says how it ended
            if not s:
                RunDir(d).finish(status, f"{run.algo} on {run.env} ({run.name})", {"error": error})
        rows = [read_metrics(d) for d in dirs]
        last = [r[-1] for r in rows if r]
        returns = [r["episode_return"] for r in last
                   if isinstance(r.get("episode_return"), float) and math.isfinite(r["episode_return"])]
        outcome = RunOutcome(
            name=run.name, status=status, returncode=rc, signal=sig, error=error, run_dirs=tuple(dirs),
            pid=self._procs[run.name].pid, quota=self.quotas[self.runs.index(run)],
            start_time=self._start[run.name], end_time=time.time(),
            env_steps=min(r["env_steps"] for r in last) if len(last) == len(dirs) else None,
            final_return=float(np.mean(returns)) if returns else None,
        )
        self._outcomes[run.name] = outcome
        self.log(f"[sweep] {run.name}: {status}" + (f" ({error})" if error and status != "finished" else ""))


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:])[:500] or "exited without output"


def run_processes(runs: Sequence[RunSpec], run_root: str | os.PathLike, *, timeout: float | None = None,
                  **kwargs) -> ProcessSweepResult:
    """Start a :class:`ProcessSweep` and wait for it (the runs that fail are in the result)."""
    with ProcessSweep(runs, run_root, **kwargs) as sweep:
        return sweep.wait(timeout)


# ----------------------------------------------------------------------------------------------
# Slack-aware quotas for different configs: short probe runs, one process per quota


def search_run_quotas(runs: Sequence[RunSpec], sweep: ProcessSweep, *, log=print, probe_steps: int = 3,
                      budget: int = 100):
    """``rose_jax.mps.search_quotas`` with branch i = run i's whole run at quota q.

    A probe process per quota (MPS reads the quota at CUDA context creation) runs each asked run's
    config alone, one after the other: a warm-up step (compile), then ``probe_steps`` timed steps.
    Branch time = seconds per step x the run's number of steps, so a longer run gets more SMs.
    """
    from rose_jax.mps import search_quotas

    k = len(runs)
    even = 100 // k
    coarse = sorted({max(5, even // 2), even, min(100 - 5 * (k - 1), 2 * even)})

    def measure(points: Sequence[tuple[int, int]]) -> list[float]:
        by_quota: dict[int, list[int]] = {}
        for b, q in points:
            by_quota.setdefault(q, []).append(b)
        seconds: dict[tuple[int, int], float] = {}
        for q, branches in sorted(by_quota.items()):
            t0 = time.monotonic()
            per_step = probe_runs([runs[b] for b in branches], sweep, q, probe_steps)
            for b, s in zip(branches, per_step, strict=True):
                seconds[(b, q)] = s * runs[b].num_steps()
            times = ", ".join(f"{runs[b].name} {seconds[(b, q)]:.1f}s" for b in branches)
            log(f"[sweep] probe at {q}%: {times} ({time.monotonic() - t0:.0f}s)")
        return [seconds[p] for p in points]

    return search_quotas(measure, k, budget=budget, coarse=coarse, refine_step=max(1, even // 4),
                         refine_rounds=1)


def probe_runs(runs: Sequence[RunSpec], sweep: ProcessSweep, quota: int | None, steps: int) -> list[float]:
    """Seconds per step of each run's config (one vmapped step of its seeds), in one process at ``quota``."""
    out = tempfile.mkdtemp(prefix="rose-probe-")
    try:
        job = os.path.join(out, JOB_FILE)
        with open(job, "w") as f:
            json.dump({"runs": [r.to_json() for r in runs], "steps": steps}, f)
        r = subprocess.run([sweep.python, "-m", "algos.sweep", "--probe", job],
                           env=sweep.child_env(f"probe-{quota}", quota), cwd=repo_root(),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"sweep: probe at quota {quota} failed (exit {r.returncode}): {tail}")
        return json.loads(Path(out, "probe.json").read_text())
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Child processes


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = os.environ.get(PARENT_VAR)
    if parent and os.getppid() != int(parent):  # the sweep died before prctl took effect
        os._exit(3)


def _child_main(job_path: str) -> int:
    """One run of a ProcessSweep: train_many over its seeds into its run dirs."""
    from rose_jax.io import atomic_write_json
    from rose_jax.mps.plan import MPS_PIPE_VAR, MPS_THREAD_VAR
    from rose_jax.optimize import xla_options
    from rose_jax.rundir import RunDir

    _die_with_parent()
    job = json.loads(Path(job_path).read_text())
    run, dirs = RunSpec.from_json(job["run"]), job["run_dirs"]
    born = {k: os.environ.get(k) for k in (MPS_THREAD_VAR, MPS_PIPE_VAR)}  # evidence of the quota
    atomic_write_json(str(Path(job_path).with_name(PROCESS_FILE)), {"pid": os.getpid(), "birth_env": born})
    print(f"[{run.name}] pid {os.getpid()} SM quota {born[MPS_THREAD_VAR] or '-'}", flush=True)
    try:
        train_many(run.config(), run.env, run.seeds, run_dirs=dirs, env_kwargs=dict(run.env_kwargs),
                   checkpoint_every=run.checkpoint_every, keep_checkpoints=run.keep_checkpoints,
                   checkpoints=run.checkpoints, settings=run.settings_dicts(), resume=run.resume,
                   xla_options=xla_options.sets_from_spec(run.xla_options),
                   log=lambda m: print(m, flush=True))  # not cached: timed beside other processes
    except BaseException as e:  # noqa: BLE001 - reported in every run dir and the log, then exit 1
        traceback.print_exc()
        for d in dirs:  # train_many marks its run dirs; a failure before them is marked here
            if read_summary(d) is None:
                RunDir(d).finish("failed", f"{run.algo} on {run.env} ({run.name})", {"error": _one_line(e)})
        return 1
    return 0


def _probe_main(job_path: str) -> int:
    import jax

    _die_with_parent()
    job = json.loads(Path(job_path).read_text())
    steps, out = int(job["steps"]), []
    for d in job["runs"]:
        run = RunSpec.from_json(d)
        env = make_env(run.env, dict(run.env_kwargs))
        config = run.config()
        batched = len(run.seeds) > 1
        init_fn, step = _compiled(config, env, batched)
        keys = jax.numpy.stack([jax.random.PRNGKey(s) for s in run.seeds])
        state = init_fn(keys) if batched else init_fn(keys[0])
        state, m = step(state)
        jax.block_until_ready((state, m))
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = step(state)
        jax.block_until_ready((state, m))
        out.append((time.perf_counter() - t0) / steps)
    Path(job_path).with_name("probe.json").write_text(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------------------------
# rose-jax sweep


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``rose-jax sweep`` flags (the subparser itself is made in ``rose_jax/cli.py``)."""
    from algos.registry import count_arg, names

    p.add_argument("--env", default="pendulum",
                   help="environment name, see `rose-jax envs` (default: %(default)s)")
    p.add_argument("--algo", choices=names(), default="ppo", help="algorithm (default: %(default)s)")
    p.add_argument("--backend", help="physics backend of Brax envs: mjx, generalized, positional, spring")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword of the env's factory (repeatable)")
    p.add_argument("--steps", type=count_arg, metavar="N", help="environment steps per run, e.g. 1e6")
    p.add_argument("--seeds", default="4",
                   help="N (seeds 0..N-1) or a comma-separated list (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyperparameter of every run (repeatable)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="one process per combination of grid values, each vmapping all seeds (repeatable)")
    p.add_argument("--processes", action="store_true",
                   help="one process per seed instead of one vmapped program")
    p.add_argument("--quotas", default="auto",
                   help="SM quotas of the processes under MPS: auto, even, search, none, or percents "
                        "like 30,70 (default: %(default)s)")
    p.add_argument("--no-mps", action="store_true", help="plain processes even where MPS is available")
    p.add_argument("--xla-options", default="auto", metavar="auto|default|SETS",
                   help="XLA option sets tried on the first steps, the fastest kept (GPU only), as `rose-jax "
                        "train --xla-options` (default: %(default)s)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="the sweep's root (default: runs/sweep-<algo>-<env>-<time>)")
    p.add_argument("--checkpoint-every", type=count_arg, metavar="K",
                   help="also checkpoint every K iterations (SAC: epochs); always at the end")
    p.add_argument("--keep-checkpoints", type=count_arg, default=3, metavar="N",
                   help="keep the N newest checkpoints per run plus the best; 0 keeps all "
                        "(default: %(default)s)")


def parse_seeds(text: str) -> tuple[int, ...]:
    try:
        parts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--seeds expects N or comma-separated ints, got {text!r}") from None
    if not parts:
        raise ValueError(f"--seeds expects N or comma-separated ints, got {text!r}")
    seeds = tuple(range(parts[0])) if "," not in text else tuple(parts)
    return check_seeds(seeds)


def parse_grid(record: Any, items: Sequence[str]) -> list[dict[str, Any]]:
    """``["lr=1e-3,3e-4", "num_envs=64,128"]`` -> every combination, values typed by the config."""
    if not items:
        return []
    axes = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values.strip():
            raise ValueError(f"--grid expects KEY=V1,V2,..., got {item!r}")
        axes.append([(key.strip(), record.parse_overrides([f"{key.strip()}={v}"])[key.strip()])
                     for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def _grid_name(i: int, combo: Mapping[str, Any]) -> str:
    import re

    text = "_".join(f"{k}-{v}" for k, v in combo.items())
    return re.sub(r"[^A-Za-z0-9_.-]", "", f"{i}-{text}")[:64]


def parse_quotas(text: str) -> Any:
    if text in ("auto", "even", "search"):
        return text
    if text == "none":
        return None
    try:
        return tuple(int(q) for q in text.split(","))
    except ValueError:
        raise ValueError(f"--quotas expects auto, even, search, none or percents like 30,70; "
                         f"got {text!r}") from None


def main_sweep(args: argparse.Namespace) -> int:
    """``rose-jax sweep``: seeds only -> one vmapped program; ``--grid`` / ``--processes`` -> processes.

    Every mistake in the arguments is one line (exit status 2) before anything runs or any directory
    is made. Exit status 1 when a run failed (the table says which and why).
    """
    from algos import registry as algo_registry

    try:
        record = algo_registry.get(args.algo)
        seeds = parse_seeds(args.seeds)
        overrides = record.parse_overrides(args.set)
        if "seed" in overrides:
            raise ValueError("give seeds with --seeds, not --set seed=...")
        if args.steps is not None:
            if args.steps <= 0:
                raise ValueError(f"--steps must be > 0, got {args.steps}")
            overrides["num_timesteps"] = args.steps
        combos = parse_grid(record, args.grid)
        env_kwargs = algo_registry.parse_env_args(args.backend, args.env_arg)
        keep = args.keep_checkpoints or None
        if args.checkpoint_every is not None and args.checkpoint_every <= 0:
            raise ValueError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
        quotas = parse_quotas(args.quotas)
        from rose_jax.optimize import xla_options as xo

        xo.sets_from_spec(args.xla_options)  # a bad spec: one line
        if combos:
            runs = [RunSpec(_grid_name(i, c), args.algo, args.env, {**overrides, **c}, seeds, env_kwargs,
                            args.checkpoint_every, keep, xla_options=args.xla_options)
                    for i, c in enumerate(combos)]
        elif args.processes:
            runs = [RunSpec(f"seed-{s}", args.algo, args.env, overrides, (s,), env_kwargs,
                            args.checkpoint_every, keep, xla_options=args.xla_options) for s in seeds]
        else:
            runs = None
            config = record.make_config(**overrides)
            env = make_env(args.env, env_kwargs)
            _algo_of(config, env)
    except (ValueError, TypeError) as e:
        print(f"rose-jax sweep: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = args.run_dir or os.path.join("runs", f"sweep-{args.algo}-{args.env}-{stamp}")
    if runs is None:
        return _sweep_vmapped(record, env, args.env, config, seeds, env_kwargs, root,
                              args.checkpoint_every, keep, args.xla_options)
    print(f"rose-jax sweep: {len(runs)} processes ({args.algo} on {args.env}) -> {root}", flush=True)
    try:
        result = run_processes(runs, root, quotas=quotas, mps=False if args.no_mps else "auto")
    except (ValueError, RuntimeError) as e:
        print(f"rose-jax sweep: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(format_outcomes(result))
    return 0 if result.ok else 1


def _sweep_vmapped(record, env, env_name, config, seeds, env_kwargs, root, checkpoint_every, keep,
                   xla_options_spec: str = "auto") -> int:
    from tqdm import tqdm

    from algos import driver
    from rose_jax.rundir import format_return

    dirs = seed_dirs(root, seeds)
    print(f"rose-jax sweep: {len(seeds)} seeds of {record.name} on {env_name} as one vmapped program "
          f"-> {root}", flush=True)
    total = config.num_timesteps
    bar = tqdm(total=total, unit="step", unit_scale=True, dynamic_ncols=True, file=sys.stdout,
               mininterval=1.0 if sys.stdout.isatty() else 10.0)
    interrupted = False

    def progress(env_steps: int, rows: list[dict]) -> None:
        bar.update(max(0, min(env_steps, total) - bar.n))
        if interrupted:
            raise driver.StopTraining

    def on_sigint(*_):
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    t0 = time.perf_counter()
    try:
        from rose_jax.optimize import cache, xla_options

        result = train_many(config, env, seeds, run_dirs=dirs, env_kwargs=env_kwargs, progress_fn=progress,
                            checkpoint_every=checkpoint_every, keep_checkpoints=keep,
                            xla_options=xla_options.sets_from_spec(xla_options_spec),
                            xla_options_cache=cache.default_dir(),
                            log=lambda m: bar.write(m, file=sys.stdout))
    except (ValueError, TypeError) as e:
        bar.close()
        print(f"rose-jax sweep: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGINT, previous)
    bar.close()
    lines = [f"{'seed':>6} {'env steps':>12} {'return':>10}  run dir"]
    for s, rows, d in zip(result.seeds, result.metrics, result.run_dirs, strict=True):
        last = rows[-1] if rows else {}
        ret = format_return(last.get("episode_return"))
        lines.append(f"{s:>6} {last.get('env_steps', 0):>12,} {ret:>10}  {d}")
    print("\n".join(lines))
    state = ("stopped (Ctrl-C) with checkpoints; continue with train_many(..., resume=True)"
             if result.stopped else "done")
    print(f"{state} in {time.perf_counter() - t0:.1f}s")
    return 0


def format_outcomes(result: ProcessSweepResult) -> str:
    """A table of a process sweep's runs (status, quota, env steps, final return, error)."""
    lines = [f"{'run':<28} {'status':<9} {'quota':>5} {'env steps':>12} {'return':>10}  note"]
    for o in result.outcomes:
        ret = "-" if o.final_return is None else f"{o.final_return:.1f}"
        quota = "-" if o.quota is None else f"{o.quota}%"
        steps = "-" if o.env_steps is None else f"{o.env_steps:,}"
        note = o.error or o.run_dirs[0]
        lines.append(f"{o.name:<28} {o.status:<9} {quota:>5} {steps:>12} {ret:>10}  {note}")
    lines.append(f"{sum(o.status == 'finished' for o in result.outcomes)}/{len(result.outcomes)} finished in "
                 f"{result.wall_s:.1f}s; {result.mps_reason}; quotas: {result.quota_reason}")
    return "\n".join(lines)


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "--child":
        return _child_main(argv[1])
    if len(argv) == 2 and argv[0] == "--probe":
        return _probe_main(argv[1])
    p = argparse.ArgumentParser(prog="python -m algos.sweep", description="rose-jax sweep")
    add_arguments(p)
    return main_sweep(p.parse_args(argv))


__all__ = [
    "ProcessSweep",
    "ProcessSweepResult",
    "RunOutcome",
    "RunSpec",
    "SweepResult",
    "add_arguments",
    "format_outcomes",
    "main_sweep",
    "make_env",
    "probe_runs",
    "read_metrics",
    "read_summary",
    "run_processes",
    "search_run_quotas",
    "data_fields",
    "seed_dirs",
    "settings_config",
    "settings_step",
    "train_many",
]

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
