"""The ``rose-jax`` command line: ``train``, ``inspect``, ``profile``, ``envs``, ``sweep``.

    rose-jax                              # the default job: PPO on cartpole (CPU) or MJX ant (GPU)
    rose-jax train --env pendulum --algo sac --steps 6e4
    rose-jax train --env ant --algo ppo --set num_envs=2048 --set unroll_length=10 --optimize
    rose-jax train --run-dir runs/x --resume          # continue a stopped run where it stopped
    rose-jax inspect --env ant --algo ppo --json tree.json --png tree.png
    rose-jax profile --env ant --algo ppo --num-envs 1024

This is the impure host layer: files, progress bars, signals, processes. The algorithms stay
pure. Every mistake in the input is a one-line message, found before anything is trained or any
directory is made. A run directory is a durable record (``rose_jax.rundir``): metrics are
appended as the run goes, a Ctrl-C stops after the current iteration with a checkpoint, and
``--resume`` continues the same record.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import io
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import threading
import time
from typing import Any, Sequence

from algos import presets, registry  # light: no JAX (argparse types, --env-arg, default jobs)

# Defaults of the no-argument job, per platform (algos.presets.DEFAULT_JOBS).
CPU_DEFAULT = presets.DEFAULT_JOBS["cpu"]
GPU_DEFAULT = presets.DEFAULT_JOBS["gpu"]
DEFAULT_KEEP = 3  # checkpoints kept: the newest few, plus the best


class UsageError(Exception):
    """A mistake in the command line or its files: printed as one line, exit status 2."""


def _fail(message: Any) -> "UsageError":
    return UsageError(str(message).strip().replace("\n", " "))


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _env_kwargs(backend: str | None, items: Sequence[str]) -> dict[str, Any]:
    """``--backend`` / ``--env-arg`` as the env factory's keywords; a malformed item is a UsageError."""
    try:
        return registry.parse_env_args(backend, items)
    except ValueError as e:
        raise _fail(e) from None


def _make_env(name: str, kwargs: dict[str, Any]):
    import envs

    try:
        return envs.make(name, **kwargs)
    except ValueError as e:
        hint = " (pass factory arguments with --env-arg KEY=VALUE)" if "bad arguments" in str(e) else ""
        raise _fail(f"{e}{hint}") from None
    except ImportError as e:
        raise _fail(f"env {name!r} needs a package that is not installed: {e}") from None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


# ---------------------------------------------------------------------------------------------
# One resolution of (algorithm, env, config) for every command


@dataclasses.dataclass
class Job:
    """What a command runs: the algorithm record, the environment and the validated config."""

    algo: Any
    env_name: str
    env_kwargs: dict[str, Any]
    env: Any
    config: Any

    @property
    def title(self) -> str:
        return f"{self.algo.name} on {self.env_name}"

    def program_kwargs(self) -> dict[str, Any]:
        return dict(env_name=self.env_name, env_kwargs=tuple(sorted(self.env_kwargs.items())))


def _resolve(
    args,
    *,
    base: dict[str, Any] | None = None,
    flags: Sequence[tuple[str, str, Any]] = (),
    stored: dict[str, Any] | None = None,
    default_algo: str = "ppo",
) -> Job:
    """Build the job of a command, checking everything a user can get wrong (one line each).

    base: config fields before the command line's (``--set`` and ``flags`` win over them).
    flags: ``(flag, config key, value)`` of options that set a config field (``--steps``);
      None values are not given. A ``--set`` of the same key must agree.
    stored: a resumed run's ``run.json``: options given must equal what the run was started with.
    """
    import algos

    if stored is not None:
        env_kwargs = dict(stored.get("env_kwargs") or {})
        given_env_kwargs = _env_kwargs(getattr(args, "backend", None), getattr(args, "env_arg", []))
        differ = []
        for flag, given, have in (("--env", args.env, stored["env"]), ("--algo", args.algo, stored["algo"])):
            if given is not None and given != have:
                differ.append(f"{flag} {given} (the run has {have})")
        for key, value in given_env_kwargs.items():
            if _jsonable(value) != env_kwargs.get(key):
                differ.append(f"env argument {key}={value} (the run has {env_kwargs.get(key)})")
        env_name, algo_name = stored["env"], stored["algo"]
        if stored.get("env_factory"):  # an env registered from a user module (envs.register)
            import envs

            envs.ensure_registered(env_name, stored["env_factory"])
        base = dict(stored["config"])
    else:
        differ = []
        env_name = args.env
        algo_name = args.algo or default_algo
        env_kwargs = _env_kwargs(getattr(args, "backend", None), getattr(args, "env_arg", []))
    try:
        algo = algos.get(algo_name)
        given = algo.parse_overrides(args.set)
    except ValueError as e:
        raise _fail(e) from None
    for flag, key, value in flags:
        if value is None:
            continue
        if key in given and given[key] != value:
            raise _fail(f"{flag} {value} and --set {key}={given[key]} disagree; give one of them")
        given[key] = value
    if stored is not None:
        for key, value in given.items():
            if _jsonable(value) != base.get(key):
                differ.append(f"{key}={value} (the run has {base.get(key)})")
        if differ:
            raise _fail(
                f"--resume: options differ from the run's run.json: {'; '.join(differ)}; "
                "drop them to continue the run as it was started, or choose another --run-dir"
            )
    try:
        config = algo.make_config(**{**(base or {}), **given})
    except (ValueError, TypeError) as e:
        raise _fail(e) from None
    env = _make_env(env_name, env_kwargs)
    job = Job(algo, env_name, env_kwargs, env, config)
    _abstract_state(job)  # config vs env (sizes, types), before any file is written
    return job


def _abstract_state(job: Job):
    """The job's TrainState as shapes (``jax.eval_shape``: traced, not run); one-line errors."""
    import jax

    try:
        return jax.eval_shape(lambda k: job.algo.init(job.config, job.env, k), jax.random.PRNGKey(0))
    except (ValueError, TypeError) as e:
        raise _fail(e) from None


# ---------------------------------------------------------------------------------------------
# train


class _CtrlC:
    """SIGINT while training: the first asks the loop to stop after the current iteration (one
    line), the second stops at once (KeyboardInterrupt). Installed only in the main thread."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        try:  # stderr may be a pipe whose reader died with the same Ctrl-C (`... 2>&1 | tee log`)
            os.write(2, b"\nrose-jax: Ctrl-C: stopping after the current iteration "
                        b"(with a checkpoint); press Ctrl-C again to stop at once\n")
        except OSError:
            pass


class _SafeStream(io.TextIOBase):
    """stdout / stderr of the CLI: when the reader of a pipe is gone (``rose-jax train | tee log``
    and a Ctrl-C that stopped ``tee`` too), further output is dropped instead of raising
    BrokenPipeError into the training loop, so the run still ends with its checkpoint. The file
    descriptor is pointed at /dev/null then, so the interpreter's last flush succeeds too."""

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def _drop(self, e: BaseException) -> None:
        if isinstance(e, ValueError) or getattr(e, "errno", None) in (errno.EPIPE, errno.EINVAL):
            self.broken = True
            try:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, self._stream.fileno())
                os.close(null)
            except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
                pass
            return
        raise e

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as e:
                self._drop(e)
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError) as e:
                self._drop(e)

    def isatty(self) -> bool:
        try:
            return not self.broken and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _default_run_dir(env: str, algo: str) -> str:
    return os.path.join("runs", f"{algo}-{env}-{time.strftime('%Y%m%d-%H%M%S')}")


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def train_job(argv: Sequence[str]) -> Job:
    """The job ``rose-jax train ARGV`` would run: algorithm, env and validated config, resolved
    exactly as the command does (no file is touched). For tools that rebuild a run's program."""
    return _train_job(build_parser().parse_args(["train", *argv]), None)


def _train_job(args, stored: dict[str, Any] | None) -> Job:
    if stored is not None:
        return _resolve(args, flags=(("--steps", "num_timesteps", args.steps), ("--seed", "seed", args.seed)),
                        stored=stored)
    default = GPU_DEFAULT if _on_gpu() else CPU_DEFAULT
    env_name = args.env or default["env"]
    algo_name = args.algo or (default["algo"] if env_name == default["env"] else "ppo")
    base = dict(default["overrides"]) if (env_name, algo_name) == (default["env"], default["algo"]) else {}
    base["num_timesteps"] = default["steps"]
    args.env, args.algo = env_name, algo_name
    if getattr(args, "preset", None):  # another trainer's defaults (algos/commands.py)
        from algos import commands

        make_env = lambda: _make_env(env_name, _env_kwargs(args.backend, args.env_arg))  # noqa: E731
        preset = commands.preset_overrides(algo_name, args.preset, make_env)
        base = {**preset, "num_timesteps": base["num_timesteps"]}
    return _resolve(
        args, base=base, flags=(("--steps", "num_timesteps", args.steps), ("--seed", "seed", args.seed))
    )


def cmd_train(args) -> int:
    if getattr(args, "mps_client", False):
        from rose_jax.mps.client import CLIENT_MARK

        if not os.environ.get(CLIENT_MARK):  # (in the child the mark is set: it trains)
            return _train_as_mps_client(args)
    locked: list[Any] = []  # the run directory whose lock this call holds, released on every path
    try:
        return _train(args, locked)
    finally:
        for run in locked:
            run.unlock()


def _train_as_mps_client(args) -> int:
    """``--mps-client``: this same command again, as the client of a new MPS daemon (started here,
    stopped when the child exits), so that worker processes (an offloaded evaluation) run their
    kernels concurrently with the training instead of time-sliced against it. Starts before this
    process touches the GPU: MPS reads its pipe directory when a CUDA context is created."""
    from rose_jax.mps import MPSError, mps_status, run_as_client

    ok, reason = mps_status()
    if not ok:
        raise _fail(f"--mps-client: {reason}")
    argv = [sys.executable, "-m", "rose_jax.cli", *args.argv]
    try:
        return run_as_client(argv, log=lambda line: print(line, flush=True))
    except MPSError as e:
        raise _fail(f"--mps-client: the MPS daemon did not start: {e}") from None


def _train(args, locked: list[Any]) -> int:
    from algos import checkpoint, driver
    from rose_jax import rundir

    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise _fail(
            f"--checkpoint-every must be >= 1 (iterations between checkpoints), got {args.checkpoint_every}; "
            "leave it out to checkpoint only at the end and on Ctrl-C"
        )
    if args.keep_checkpoints < 0:
        raise _fail(f"--keep-checkpoints must be >= 0 (0 keeps all), got {args.keep_checkpoints}")
    if args.steps is not None and args.steps <= 0:
        raise _fail(f"--steps must be > 0, got {args.steps}")
    if args.resume and not args.run_dir:
        raise _fail("--resume needs --run-dir DIR: the directory of the run to continue")
    if args.plan_only and not args.optimize:
        raise _fail("--plan-only needs --optimize: it runs the search alone (the plan cache is its result)")
    if args.plan_only and (args.resume or args.run_dir):
        raise _fail("--plan-only writes no run directory: leave out --run-dir and --resume "
                    "(train with the same command without --plan-only)")

    # 1. what to run (no file is touched)
    stored = None
    if args.run_dir:
        try:
            rundir.check_path(args.run_dir)
        except ValueError as e:
            raise _fail(e) from None
        run = rundir.RunDir(args.run_dir)
        stored = run.read_run()
        if _has_record(run, stored) and not args.resume:
            raise _fail(
                f"{args.run_dir} already holds a run; pass --resume to continue it, "
                "or choose another --run-dir"
            )
    job = _train_job(args, stored if args.resume else None)
    abstract = _check_memory(job)
    from rose_jax.optimize import xla_options

    try:
        trial_sets = xla_options.sets_from_spec(args.xla_options)
    except ValueError as e:
        raise _fail(e) from None
    budget = _optimize_budget(args.optimize_budget)
    budget.update(_learning_check_kw(job, args.learning_check_steps))
    if args.plan_only:
        return _plan_only(job, trial_sets, budget)
    path = args.run_dir or _default_run_dir(job.env_name, job.algo.name)
    run = rundir.RunDir(path)
    if args.resume and stored is not None and run.finished():
        summary = run.read_summary() or {}
        print(f"rose-jax train: {path} already finished ({summary.get('env_steps', 0):,} env steps); "
              f"nothing to do (its results: {run.file(rundir.METRICS)})")
        return 0

    # 2. the run directory: writable, ours alone (a lock), leftovers of a crash removed, the
    #    record cut to the newest checkpoint that restores
    created = not os.path.exists(path)
    try:
        rundir.check_writable(path)
        run.lock()
        locked.append(run)
    except ValueError as e:
        raise _fail(e) from None
    if not args.resume and _has_record(run, run.read_run()):  # started here while we resolved
        raise _fail(f"{path} already holds a run; pass --resume to continue it, or choose another --run-dir")
    run.clean()
    checkpoint.clean(run.checkpoint_dir)
    latest = None
    if args.resume:
        latest, _ = checkpoint.newest_restorable(
            run.checkpoint_dir, abstract, log=lambda m: print(f"rose-jax train: --resume: {m}", flush=True)
        )
    kept: list[dict[str, Any]] = []
    if args.resume and stored is None:
        print(f"rose-jax train: --resume: {path} holds no run (no {rundir.RUN}); starting afresh", flush=True)
    elif args.resume and latest is None:
        print(f"rose-jax train: --resume: {path} has no checkpoint that restores; starting afresh "
              f"(its record is restarted)", flush=True)
    elif latest is not None:
        kept = [r for r in run.rows() if r.get("env_steps", math.inf) <= latest]
    info = _run_info(job)
    try:
        run.write_run(info)
        run.restart_record(kept)
    except OSError as e:
        raise _fail(f"cannot write to run directory {path!r}: {e.strerror or e}") from None

    # 3. train
    from tqdm import tqdm

    total = job.config.num_timesteps
    resumed_at = int(kept[-1]["env_steps"]) if kept else 0
    wall_offset = float(kept[-1].get("wall_s", 0.0)) if kept else 0.0
    where = f" (resuming at {resumed_at:,} env steps)" if latest is not None else ""
    print(f"rose-jax train: {job.title} for {total:,} env steps -> {path}{where}", flush=True)
    bar = tqdm(total=total, initial=min(resumed_at, total), unit="step", unit_scale=True,
               dynamic_ncols=True, file=sys.stdout, mininterval=1.0 if sys.stdout.isatty() else 10.0)
    t0 = time.perf_counter()
    last_row: dict[str, Any] = kept[-1] if kept else {}

    from algos import commands  # compile cache, matmul precision, TensorBoard, final policy

    extras = commands.TrainExtras(args, path, print_fn=lambda m: print(m, flush=True),
                                  purge_step=resumed_at + 1 if latest is not None else None)
    try:
        with _CtrlC() as ctrl_c:

            def progress(env_steps: int, metrics: dict[str, Any]) -> None:
                nonlocal last_row
                extras.progress(env_steps, metrics)
                row = {"env_steps": int(env_steps), "wall_s": wall_offset + time.perf_counter() - t0,
                       **_scalars(metrics)}
                row["env_steps"] = int(env_steps)
                run.append(row)
                last_row = row
                bar.set_postfix(ret=rundir.format_return(row.get("episode_return")), refresh=False)
                bar.update(max(0, min(int(env_steps), total) - bar.n))  # redraws at most once per mininterval
                if ctrl_c.requested:
                    raise driver.StopTraining

            kwargs = dict(
                progress_fn=progress,
                checkpoint_dir=os.path.abspath(run.checkpoint_dir),
                checkpoint_every=args.checkpoint_every,
                keep_checkpoints=args.keep_checkpoints or None,
                resume=latest is not None,
            )
            def record_in_run(key: str, value: dict[str, Any]) -> None:  # run.json: what trained
                info[key] = value
                run.write_run(info)

            # the option trial: what trains without --optimize, and with it where the run is too
            # short to pay for a search
            trial = _trial_step_maker(
                job, trial_sets, lambda m: tqdm.write(f"rose-jax train: {m}", file=sys.stdout),
                lambda record: record_in_run("xla_options", record),
            ) if trial_sets else None
            if args.optimize:
                # the search's baseline is the unit under the fastest of the same sets, and every
                # candidate is timed under it
                kwargs["make_step"] = _optimized_step_maker(
                    job, lambda m: tqdm.write(m, file=sys.stdout), {**budget, "option_sets": trial_sets},
                    fallback=trial, record=lambda r: record_in_run("optimize", r),
                )
            elif trial is not None:
                kwargs["make_step"] = trial
            try:
                state, _ = job.algo.train_with_config(job.config, job.env, **kwargs)
            except (ValueError, TypeError) as e:
                _discard_failed(run, created)
                raise _fail(e) from None
            except Exception as e:
                if not _out_of_memory(e):
                    raise
                _discard_failed(run, created)
                raise _fail(
                    f"out of device memory while training {job.title} (num_envs={job.config.num_envs}): "
                    f"{_first_line(e)}; lower num_envs or the batch sizes"
                ) from None
            finally:
                bar.close()
            finished = job.algo.units_done(job.config, state) >= job.algo.num_units(job.config)
            if finished:
                extras.finish(job, state)
    finally:
        extras.logger.close()  # also after a crash: no event-writer traceback at exit
        run.close()

    summary = run.finish("finished" if finished else "interrupted", job.title,
                         extra={"algo": job.algo.name, "env": job.env_name})
    ret = rundir.format_return(last_row.get("episode_return"))
    steps = summary["env_steps"]
    if finished:
        print(f"done: {steps:,} env steps in {time.perf_counter() - t0:.1f}s, mean episode return {ret}; "
              f"wrote {path}/{rundir.METRICS} and {rundir.CURVE}")
        return 0
    print(f"stopped at {steps:,} env steps (mean episode return {ret}), checkpoint saved; "
          f"continue with: rose-jax train --run-dir {path} --resume")
    return 130


def _has_record(run, stored: dict[str, Any] | None) -> bool:
    """Whether a run directory already holds (part of) a run: its run.json, rows or a checkpoint."""
    from algos import checkpoint

    return stored is not None or bool(run.rows()) or checkpoint.latest_step(run.checkpoint_dir) is not None


def _run_info(job: Job) -> dict[str, Any]:
    """``run.json``: what was run, and how to rebuild an env registered from outside the package
    (``env_factory``: its ``module:function``; None for the package's own envs)."""
    import envs

    return {
        "algo": job.algo.name,
        "env": job.env_name,
        "env_factory": envs.user_factory(job.env_name),
        "env_kwargs": _jsonable(job.env_kwargs),
        "config": _jsonable(dataclasses.asdict(job.config)),
    }


def _tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _available_memory() -> tuple[int | None, str]:
    """Bytes the run can use at most: the device's memory limit on a GPU, available RAM on a CPU."""
    import jax

    device = jax.devices()[0]
    if device.platform == "gpu":
        try:
            limit = (device.memory_stats() or {}).get("bytes_limit")
        except Exception:  # a backend without memory stats
            limit = None
        return (int(limit) if limit else None), f"usable on {device.device_kind}"
    import psutil

    return int(psutil.virtual_memory().available), "of available memory on this machine"


def _largest_result_bytes(jaxpr) -> int:
    """The largest total size of one equation's results, over every equation of ``jaxpr`` and of
    the jaxprs inside it (a rollout scan's stacked trajectory, an MJX step's contact arrays)."""
    from rose_jax.jaxpr import compat as C

    best = 0
    stack = [C.open_jaxpr(jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            best = max(best, sum(C.aval_bytes(C.aval_of(v)) for v in eqn.outvars))
            stack.extend(C.open_jaxpr(j) for j in C.sub_jaxprs(eqn.params))
    return best


def _check_memory(job: Job):
    """Refuse, before any work, a config that cannot fit in memory. The estimate is a lower bound
    of what one iteration holds at once: the train state plus the largest result of one of its
    operations (the iteration is traced, not compiled or run). Returns the abstract train state
    (``jax.ShapeDtypeStruct`` leaves)."""
    import jax

    state = _abstract_state(job)
    state_bytes = _tree_bytes(state)
    avail, where = _available_memory()
    if avail is None:
        return state
    need, what = state_bytes, "its train state alone"
    if state_bytes <= avail:
        try:
            jaxpr = jax.make_jaxpr(job.algo.iteration(job.config, job.env))(state)
        except (ValueError, TypeError) as e:
            raise _fail(e) from None
        need = state_bytes + _largest_result_bytes(jaxpr)
        what = "the train state and the largest array of one iteration"
    if need > avail:
        sizes = f"num_envs={job.config.num_envs}"
        if getattr(job.config, "replay_capacity", None) is not None:
            sizes += f", replay capacity {job.config.replay_capacity:,}"
        raise _fail(
            f"{job.title} with {sizes} needs at least {need / 2**30:,.1f} GiB ({what}), "
            f"more than the {avail / 2**30:,.1f} GiB {where}; lower num_envs"
            + (" or max_replay_size" if "replay" in sizes else "")
        )
    return state


def _out_of_memory(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or isinstance(e, MemoryError)


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


def _discard_failed(run, created: bool) -> None:
    """A run that failed before its first checkpoint in a directory it created leaves nothing
    behind; otherwise the directory's record stays for --resume."""
    from algos import checkpoint

    run.close()
    run.unlock()
    if created and checkpoint.latest_step(run.checkpoint_dir) is None:
        shutil.rmtree(run.path, ignore_errors=True)


def _trial_step_maker(job: Job, sets: dict[str, dict[str, Any]], log, record):
    """``train`` without ``--optimize``: ``make_step(state)`` compiles the unit under XLA's
    defaults and each option set of ``sets``, runs the first units alternating between them and
    keeps the fastest (the default build unless a set is faster), saying so in one line and
    recording it in ``run.json`` (:func:`rose_jax.optimize.xla_options.trial_maker`); the decision
    is cached for the next run of the same program."""
    from rose_jax.optimize import xla_options

    return xla_options.trial_maker(job.algo.unit_fn(job.config, job.env), job.algo.num_units(job.config),
                                   sets,
                                   log=log, on_decide=record, cache_dir=plan_cache_dir())


def plan_cache_dir() -> str:
    """Where searched plans are cached: ``$ROSE_JAX_PLAN_CACHE`` or ``~/.cache/rose-jax/plans``."""
    from rose_jax.optimize import cache

    return cache.default_dir()


def _optimize_budget(text: str) -> dict[str, Any]:
    """``--optimize-budget`` as ``optimize`` keywords; one-line error for anything else."""
    if text == "auto":
        return {}
    if text == "none":
        return {"run_units": None}
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise _fail(f"--optimize-budget must be auto, none or seconds >= 0, got {text!r}")
    return {"run_units": None, "budget_s": seconds}


def _learning_check_kw(job: Job, steps: int) -> dict[str, Any]:
    """``--learning-check-steps N`` as ``optimize`` keywords: candidates kept under a tolerance
    (not bitwise) must also learn alike over 5 seeds of N env steps per side
    (``algos.equivalence``); 0: no learning check (the search's report says so)."""
    if steps is None or steps == 0:
        return {}
    if steps < 0:
        raise _fail(f"--learning-check-steps must be >= 0, got {steps}")
    from algos import equivalence

    try:
        return {"learning_check": equivalence.checker(job.config, job.env, steps=steps)}
    except ValueError as e:
        raise _fail(f"--learning-check-steps {steps}: {e}") from None


def _optimized_step_maker(job: Job, log, budget: dict[str, Any] | None = None, fallback=None, record=None):
    """``train --optimize``: ``make_step(state)`` searches (or loads the cached) rose-jax plan of
    what train runs per report (PPO: the iteration program, or with ``num_evals`` set the epoch of
    iterations and its evaluation; SAC: the epoch with its evaluation).

    The search measures the untransformed unit and each candidate end to end and keeps a
    candidate only if it is faster and computes the same result (``rose_jax.optimize.optimize``);
    plans are cached per (program, env, batch, GPU, jax version), so a second run skips the search.
    Where the run is too short to pay for a search (``report.skipped``), ``fallback(state)`` (the
    option trial of a run without ``--optimize``) makes the step, when given. ``record(dict)``
    (when given) receives :func:`plan_record` of the plan the run trains with (for ``run.json``).
    """

    def make_step(state):
        from rose_jax import optimize as rj_optimize
        from rose_jax.optimize.base import close

        program = job.algo.unit_program(job.config, job.env, **job.program_kwargs())
        # a long unit (SAC's published epoch: ~36 s; PPO's published ant epoch: ~6.8 s) is searched
        # on a shorter one with the same loops and components (Algo.search_unit), its plan then
        # applied to the whole unit
        shorter = job.algo.search_unit(job.config, job.env)
        # the run's length in searched units, for the default budget (a tenth of the run): a shorter
        # searched unit is the whole one scaled down, its iterations and its evaluation by one factor,
        # so a whole unit is about of / iterations of them (floored: the evaluation's steps round up,
        # so the default never lets a search take more than its share)
        run_units = job.algo.num_units(job.config)
        if shorter is not None:
            run_units *= max(1, shorter.of // shorter.iterations)
            log(f"rose-jax train: --optimize: searching on {shorter.describe()} (the same program, "
                "scaled down); the plan then runs the whole unit")
        # profile windows first and SM quotas for multi-process plans (each says in the report
        # why it was skipped where there is no GPU / MPS)
        # by default the search may take at most a tenth of the run it serves (stopped early otherwise);
        # the run pays for the search, so only candidates that won on time are compared (each
        # comparison recompiles under deterministic ops: on MJX ant's epoch about as long as a compile)
        limits = {"run_units": run_units, "check_slower": False, **(budget or {})}
        searched = program if shorter is None else shorter.fn
        step, report = rj_optimize.optimize(searched, state, cache_dir=plan_cache_dir(),
                                            env_name=job.env_name, batch_size=job.config.num_envs,
                                            windows="profile", quotas="auto", log=log, **limits)
        if shorter is not None:  # the whole unit under the plan (or the baseline) found on the shorter one
            close(step)  # the searched unit's workers, if its plan has any
            if not report.skipped:
                report.notes.append(f"searched on {shorter.describe()}; equality checked there, "
                                    "the plan applied to the whole unit")
            step = rj_optimize.plan_of(program, report)
            if report.plan and not isinstance(step, rj_optimize.HostStep):
                step = _first_call_falls_back(step, rj_optimize.plan_of(program, _no_plan(report)), log)
        if report.skipped:
            log(f"rose-jax train: --optimize: {report.skipped}"
                + ("; training as without --optimize (its XLA option trial)" if fallback else ""))
            step = fallback(state) if fallback is not None else step
        else:
            log(rj_optimize.format_report(report))
        if record is not None:
            record(plan_record(report, step))
        return step

    return make_step


class _PlanFound(Exception):
    """Raised by ``--plan-only``'s step maker once the plan is cached: no training follows."""


PLAN_KEY_LINE = "rose-jax train --plan-only: plan cache key "  # then the key, alone on its line


def _plan_only(job: Job, trial_sets, budget: dict[str, Any]) -> int:
    """``train --optimize --plan-only``: the search ``train --optimize`` would run (or resume, or
    its cache hit) on the state training would start from, its plan written to the plan cache, and
    no training and no run directory. The same command without ``--plan-only`` then trains with
    the cached plan from its first unit: a search paid once for many runs (seeds, a sweep), or
    one too long to share a job with the training."""
    from rose_jax.optimize.base import close

    found: list[dict[str, Any]] = []
    maker = _optimized_step_maker(job, lambda m: print(m, flush=True),
                                  {**budget, "option_sets": trial_sets}, record=found.append)

    def make_step(state):
        close(maker(state))  # the plan's worker processes, if it has any
        raise _PlanFound

    t0 = time.perf_counter()
    print(f"rose-jax train --plan-only: searching the plan of {job.title} (no training)", flush=True)
    try:
        job.algo.train_with_config(job.config, job.env, make_step=make_step)
    except _PlanFound:
        pass
    except (ValueError, TypeError) as e:
        raise _fail(e) from None
    rec = found[0] if found else {}
    labels = [t.get("label") or t.get("name") for t in rec.get("plan") or []] or ["the unit itself"]
    if rec.get("skipped"):
        print(f"rose-jax train --plan-only: no search: {rec['skipped']}; pass --optimize-budget SECONDS "
              "to search anyway", flush=True)
        return 0
    where = "cache hit" if rec.get("cache_hit") else f"searched in {rec.get('search_s') or 0.0:.1f}s"
    print(f"rose-jax train --plan-only: plan {', '.join(labels)} (XLA options: {rec.get('base_options')}; "
          f"{where}; {time.perf_counter() - t0:.1f}s in all) cached in {plan_cache_dir()}; the same command "
          "without --plan-only trains with it, and a search its budget stopped resumes there", flush=True)
    if rec.get("cache_key"):  # which entry: a plan-only run has no run.json to say so
        print(f"{PLAN_KEY_LINE}{rec['cache_key']}", flush=True)
    return 0


def _no_plan(report):
    """``report`` without its transforms: the unit under the same XLA options (``plan_of``)."""
    return dataclasses.replace(report, plan=[])


def _first_call_falls_back(step, baseline, log):
    """``step`` (a plan found on a shorter unit, applied to the whole one, never run whole before),
    or ``baseline`` from its first call on where that call raises (e.g. a hoist whose batched work
    outgrows the memory at the whole unit's length): one line says so and the run goes on. The
    first call is waited for; the state is not donated, so the baseline starts from the same one."""
    import jax

    chosen: list = []

    def run(state):
        if not chosen:
            try:
                out = jax.block_until_ready(step(state))
                chosen.append(step)
                return out
            except Exception as e:  # noqa: BLE001 - the run goes on without the plan
                log(f"rose-jax train: --optimize: the plan failed on the whole unit ({_first_line(e)}); "
                    "training with the unit under the plan's XLA options alone")
                chosen.append(baseline)
        return chosen[0](state)

    return run


def plan_record(report, step) -> dict[str, Any]:
    """``run.json``'s ``optimize`` entry: the plan a run trained with (transform names and
    parameters, its XLA options, the plan cache's key), where it came from (a cache hit or a
    search of ``search_s`` seconds, or ``skipped`` with the reason), and ``defers_metrics``:
    whether ``step``, what the run trains with, returns metrics that a worker finishes behind the
    next call (``HostStep.pipelined``; then the interval up to the run's last report times that
    trailing work alone, not a unit)."""
    return {
        "plan": list(report.plan or []),
        "base_options": (report.base_options or {}).get("name"),
        "cache_hit": bool(report.cache_hit),
        "cache_key": report.cache_key,  # the plan cache's entry (program, env, batch, GPU, jax)
        "search_s": report.search_time_s,
        "speedup_on_unit": report.speedup,
        "equal": report.equal,
        "skipped": report.skipped,
        "defers_metrics": bool(getattr(step, "pipelined", False)),
        "notes": list(report.notes or []),
    }


# ---------------------------------------------------------------------------------------------
# inspect, profile, envs


def cmd_inspect(args) -> int:
    from rose_jax import trace as rtrace

    job = _resolve(args)
    state = _abstract_state(job)
    fn = job.algo.iteration(job.config, job.env)
    t0 = time.perf_counter()
    tree = rtrace.trace(fn, state, arg_names=("train_state",))
    dt = time.perf_counter() - t0
    print(rtrace.format_tree(tree, max_depth=args.depth))
    print(f"(traced in {dt:.2f}s)")
    for out, write in ((args.json, rtrace.save_json), (args.png, rtrace.plot_tree)):
        if out:
            try:
                write(tree, out)
            except OSError as e:
                raise _fail(f"cannot write {out}: {e.strerror or e}") from None
            print(f"wrote {out}")
    return 0


def cmd_profile(args) -> int:
    import jax

    from rose_jax import profile as rprofile

    job = _resolve(args, flags=(("--num-envs", "num_envs", args.num_envs),))
    ok, reason = rprofile.available()
    if not ok:
        raise _fail(f"profile: {reason}")
    state = job.algo.init(job.config, job.env, jax.random.PRNGKey(0))
    fn = job.algo.iteration(job.config, job.env)
    timeline = rprofile.profile(fn, state)
    windows = rprofile.find_windows(timeline)
    print(rprofile.format_windows(windows))
    out = args.out or f"profile-{job.algo.name}-{job.env_name}"
    timeline.save(out + ".json")
    rprofile.plot_timeline(timeline, out + ".png", title=job.title)
    print(f"wrote {out}.json and {out}.png")
    return 0


def cmd_envs(args) -> int:
    import envs

    from algos import commands

    print("\n".join(envs.names() + commands.external_env_lines()))
    print(
        "# Brax envs take --backend (mjx, generalized, positional, spring); environments whose factory "
        "needs arguments take them as --env-arg KEY=VALUE, e.g. --env mjcf --env-arg xml=model.xml"
    )
    return 0


# ---------------------------------------------------------------------------------------------
# Parser


def _set_keys_help() -> str:
    """The valid ``--set`` keys of every algorithm, with their defaults (for ``--help``)."""
    import algos

    lines = ["--set keys (KEY=VALUE; bools true/false, ints also as 1e5, sequences as 64,64):"]
    for name in algos.names():
        algo = algos.get(name)
        items = ", ".join(f"{k}={_show(v)}" for k, v in algo.defaults().items())
        lines.append(textwrap.fill(f"{name}: {items}", width=100, initial_indent="  ",
                                   subsequent_indent="    "))
    return "\n".join(lines) + "\n"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and the ``--set`` keys appended to ``--help`` where they apply."""

    set_keys = False

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        text = super().format_help()
        return text + "\n" + _set_keys_help() if self.set_keys else text


def _add_job_args(
    p: argparse.ArgumentParser, env_help: str, algo_help: str, env_required: bool = False
) -> None:
    p.add_argument("--env", help=env_help, required=env_required)
    import algos  # the registry only (no JAX)

    p.add_argument("--algo", choices=algos.names(), help=algo_help)
    p.add_argument("--backend", help="physics backend of Brax envs: mjx, generalized, positional, spring "
                                     "(default: the env's own)")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword of the env's factory, e.g. xml=model.xml for --env mjcf (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyperparameter of the algorithm's config (repeatable; keys below)")
    p.set_keys = True


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rose-jax", description="GPU-resident RL training, traced and overlapped. "
                                              "With no command: `train` with its defaults.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    t = sub.add_parser("train", help="train an agent (the default command)",
                       description="Train an agent; metrics, curve, config and checkpoints go to the run "
                                   "directory. Ctrl-C stops after the current iteration with a checkpoint.")
    _add_job_args(t, "environment name, see `rose-jax envs` (default: cartpole on CPU, ant on GPU)",
                  "algorithm (default: ppo)")
    t.add_argument("--steps", type=registry.count_arg, metavar="N",
                   help="total environment steps, e.g. 400000 or 4e5 (default: 400000 on CPU, 2e7 on GPU)")
    t.add_argument("--seed", type=registry.count_arg, help="PRNG seed (default: 0)")
    t.add_argument("--run-dir", metavar="DIR", help="the run directory (default: runs/<algo>-<env>-<time>)")
    t.add_argument("--checkpoint-every", type=registry.count_arg, metavar="K",
                   help="also checkpoint every K iterations (SAC: epochs); K >= 1 (default: only at the end "
                        "and on Ctrl-C)")
    t.add_argument("--keep-checkpoints", type=registry.count_arg, default=DEFAULT_KEEP, metavar="N",
                   help="keep the N newest checkpoints plus the best one; 0 keeps all (default: %(default)s)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its latest checkpoint "
                        "(a finished run is left as is)")
    t.add_argument("--optimize", action="store_true", help="apply (or search for) a rose-jax plan")
    t.add_argument("--plan-only", action="store_true",
                   help="with --optimize: run (or resume) the search and cache its plan, then stop: no "
                        "training, no run directory; the same command without --plan-only trains with the "
                        "plan")
    t.add_argument("--mps-client", action="store_true",
                   help="run as the client of a new MPS daemon (NVIDIA GPUs), so that a plan's worker "
                        "processes (an offloaded evaluation) run concurrently with the training, not "
                        "time-sliced against it")
    t.add_argument("--optimize-budget", default="auto", metavar="auto|none|SECONDS",
                   help="with --optimize: how long the search may take before it stops early and keeps the "
                        "best plan so far: auto = a tenth of the run at the untransformed speed, none = no "
                        "limit, or seconds (default: %(default)s); with auto or seconds a cached search "
                        "its budget stopped resumes: the candidates it left are measured")
    t.add_argument("--learning-check-steps", type=int, default=0, metavar="N",
                   help="with --optimize: a candidate kept under a tolerance (not bitwise equal) must also "
                        "learn alike: 5 seeds per side trained for N env steps, final returns not different "
                        "(Welch, 5%%) and means within 5%%; 0 = no learning check (default: %(default)s)")
    t.add_argument("--xla-options", default="auto", metavar="auto|default|SETS",
                   help="XLA option sets tried on the first iterations, the fastest kept (GPU only; with "
                        "--optimize the search's baseline and every candidate run under the fastest): auto = "
                        "CONCURRENT command buffers with and without loops; default = XLA's defaults, no "
                        "trial; or names from rose_jax.optimize.xla_options.SETS (default: %(default)s)")
    t.set_defaults(func=cmd_train)
    from algos import commands  # --preset, --no-compile-cache, --matmul-precision, --no-tensorboard; play

    commands.add_train_args(t)

    for name, func, helptext in (
        ("inspect", cmd_inspect, "print the traced loop tree of one iteration"),
        ("profile", cmd_profile, "profile one iteration on the GPU"),
    ):
        s = sub.add_parser(name, help=helptext, description=helptext)
        _add_job_args(s, "environment name, see `rose-jax envs`", "algorithm (default: ppo)",
                      env_required=True)
        s.set_defaults(func=func)
    sub.choices["inspect"].add_argument("--json", help="write the tree as JSON")
    sub.choices["inspect"].add_argument("--png", help="write the tree as a picture")
    sub.choices["inspect"].add_argument("--depth", type=registry.count_arg, default=None,
                                        help="max depth printed (default: all)")
    sub.choices["profile"].add_argument("--num-envs", type=registry.count_arg,
                                        help="environments (default: the config's)")
    sub.choices["profile"].add_argument("--out", help="output prefix for .json/.png "
                                                      "(default: profile-<algo>-<env>)")

    e = sub.add_parser("envs", help="list the registered environments")
    e.set_defaults(func=cmd_envs)
    commands.add_play_parser(sub)

    from algos import sweep  # the command lives in algos/sweep.py

    w = sub.add_parser("sweep", help="train many seeds or configs on one GPU", description=sweep.DESCRIPTION)
    sweep.add_arguments(w)
    w.set_keys = True
    w.set_defaults(func=sweep.main_sweep)

    from algos import bench  # envs x algos x seeds x settings, packed, with one report

    b = sub.add_parser("bench", help="a benchmark: envs x algos x seeds x settings on one GPU, one report",
                       description=bench.DESCRIPTION)
    bench.add_arguments(b)
    b.set_keys = True
    b.set_defaults(func=bench.main_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv or ["train"])
    if args.command is None:
        argv = ["train", *argv]
        args = parser.parse_args(argv)
    args.argv = list(argv or ["train"])  # the command line as given (train --mps-client runs it again)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _SafeStream(sys.stdout), _SafeStream(sys.stderr)
    try:
        return args.func(args)
    except UsageError as e:
        raise SystemExit(f"rose-jax {args.command}: {e}") from None
    except KeyboardInterrupt:
        print(f"\nrose-jax {args.command}: stopped at once (Ctrl-C); "
              "a run continues from its last checkpoint with --resume", file=sys.stderr)
        return 130
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
