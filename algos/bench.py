"""``rose-jax bench``: envs x algos x seeds x settings as one benchmark, packed on one GPU.

    rose-jax bench --env ant,hopper --algo ppo,sac --seeds 5 --steps 1e6 --run-dir runs/bench
    rose-jax bench --env cartpole --algo ppo --seeds 4 --grid learning_rate=1e-3,3e-4 --preset brax
    rose-jax bench --run-dir runs/bench --resume           # finish an interrupted benchmark

1. **Expand** the request into runs: one per (env, algo, setting combination, seed), each with
   its own run directory ``<root>/<env>/<algo>[/<setting label>]/seed-<s>`` (``rose_jax.rundir``'s
   layout, so each is what ``rose-jax train`` would have written for that config).
2. **Pack by what the programs allow** (:func:`plan`): runs whose programs have the same shapes
   (same env, algorithm and non-data config fields) become ONE vmapped program: seeds, and
   settings of the algorithm's data fields (``DATA_FIELDS``: learning rates, entropy cost,
   discount, ...) vmapped as data (:func:`algos.sweep.train_many` with ``settings``: one compile
   whatever the values). Programs that differ in shape run one after another in this process or
   side by side as processes (under one MPS daemon with SM quotas where available:
   :class:`algos.sweep.ProcessSweep`), chosen by :func:`choose_mode` from a measured probe of the
   programs alone and together (on a GPU), never a fixed rule; ``bench.json`` says why.
3. **Run**, with one progress display; a group that fails is reported in its runs' summaries and
   the table, the others finish. ``--resume`` skips finished groups and resumes the others from
   their checkpoints.
4. **Report** (:mod:`rose_jax.benchreport`): ``<root>/report/report.md`` (final returns: mean, IQM,
   bootstrap 95 % CIs; failed runs), ``scores.json`` (the score matrix), ``curves.png`` (per-env
   learning curves with seed bands), and the wall-clock of each run and of the whole benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shutil
import sys
import time
from typing import Any, Mapping, Sequence

PLAN_FILE = "bench.json"
REPORT_DIR = "report"
MODES = ("auto", "sequential", "processes")
DESCRIPTION = (
    "Train envs x algos x seeds x settings as one benchmark on one GPU: runs whose programs share "
    "shapes are one vmapped program (seeds and data settings such as learning rates as data), the "
    "rest run one after another or side by side as processes (MPS quotas where available), as a "
    "measured probe decides; then a report of final returns (mean, IQM, bootstrap CIs), learning "
    "curves with seed bands and wall-clocks. A run that fails is reported; the others finish."
)


# ----------------------------------------------------------------------------------------------
# The request, expanded into runs


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One run: its env, algorithm, seed and config overrides (``(key, value)`` pairs, sorted)."""

    env: str
    algo: str
    seed: int
    overrides: tuple[tuple[str, Any], ...]
    label: str  # the setting label of its directory ("" when the benchmark has no grid)
    env_kwargs: tuple[tuple[str, Any], ...] = ()

    def run_dir(self, root: str) -> str:
        parts = [root, _safe(self.env), self.algo] + ([self.label] if self.label else [])
        return os.path.join(*parts, f"seed-{self.seed}")

    def train_argv(self) -> list[str]:
        """``rose-jax train`` arguments of this run alone (the same config, env and seed)."""
        over = dict(self.overrides)
        argv = ["--env", self.env, "--algo", self.algo, "--seed", str(self.seed)]
        if over.get("preset"):
            argv += ["--preset", over.pop("preset")]
        over.pop("preset", None)
        if "num_timesteps" in over:
            argv += ["--steps", str(over.pop("num_timesteps"))]
        for key, value in over.items():
            argv += ["--set", f"{key}={cli_value(value)}"]
        for key, value in self.env_kwargs:
            argv += ["--env-arg", f"{key}={cli_value(value)}"]
        return argv


def cli_value(v: Any) -> str:
    """A config value as `--set` spells it (sequences as ``[a,b]``)."""
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def _safe(text: str) -> str:
    """A directory name: other characters become ``_``; a longer name keeps 71 characters and a hash
    of the whole (two labels that share their first 80 characters stay apart)."""
    out = re.sub(r"[^A-Za-z0-9_.=-]", "_", text) or "_"
    if len(out) > 80:
        import hashlib

        out = out[:71] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return out


def _split_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} expects a comma-separated list, got {text!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"--{what} lists a name twice: {text!r}")
    return items


def _scoped(items: Sequence[str], algo: str, record: Any) -> list[str]:
    """``--set`` / ``--grid`` items for ``algo``: ``key=...`` (a field of every algorithm asked) or
    ``algo.key=...`` (that algorithm's only)."""
    out = []
    for item in items:
        key = item.partition("=")[0].strip()
        if "." in key:
            scope, _, field = key.partition(".")
            if scope != algo:
                continue
            item = field + item[len(key) :]
        elif key not in record.keys():
            raise ValueError(
                f"{key!r} is not a {algo} config field; give it as <algo>.{key}=... to set it "
                f"for one algorithm only (valid {algo} keys: {', '.join(record.keys())})"
            )
        out.append(item)
    return out


def expand(
    envs: Sequence[str],
    algos: Sequence[str],
    seeds: Sequence[int],
    sets: Sequence[str] = (),
    grid: Sequence[str] = (),
    steps: int | None = None,
    preset: str | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> list[BenchRun]:
    """Every run of the request, in a stable order (env, algo, setting, seed); one-line ValueErrors.

    ``pairs``: ``(algo, env)`` pairs to run instead of every env x every algo. ``preset``:
    ``"brax"`` (Brax's defaults) or ``"published"`` (Brax's published configuration of each
    (algo, env), :func:`algos.presets.published_run`; its length unless ``steps`` is given).
    ``--set`` / ``--grid`` items go on top (``algo.key=...`` for one algorithm's runs)."""
    import envs as env_registry
    from algos import presets, registry
    from algos import sweep

    if not seeds:
        raise ValueError("a benchmark needs at least one seed")
    sweep.check_seeds(seeds)
    pairs = list(pairs) if pairs else [(a, e) for e in envs for a in algos]
    for _, env in pairs:
        if ":" not in env and not env_registry.known(env):
            raise ValueError(
                f"unknown env {env!r}; see `rose-jax envs` (or give a factory as package.module:function)"
            )
    if preset not in (None, "brax", "published"):
        raise ValueError(f"unknown preset {preset!r}; presets: brax, published")
    runs = []
    for algo, env in pairs:
        record = registry.get(algo)
        base: dict[str, Any] = {}
        run_env_kwargs = dict(env_kwargs or {})
        if preset == "published":
            base, published_env = presets.published_run(algo, env)
            run_env_kwargs = {**published_env, **run_env_kwargs}
        base.update(record.parse_overrides(_scoped(sets, algo, record)))
        if "seed" in base and preset != "published":
            raise ValueError("give seeds with --seeds, not --set seed=...")
        base.pop("seed", None)
        if steps is not None:
            base["num_timesteps"] = int(steps)
        if preset:
            base["preset"] = "brax"  # "published" is Brax's defaults changed by the published keywords
        combos = sweep.parse_grid(record, _scoped(grid, algo, record)) or [{}]
        for combo in combos:
            label = "_".join(f"{k}={v}" for k, v in combo.items())
            over = tuple(sorted({**base, **combo}.items()))
            for s in seeds:
                runs.append(
                    BenchRun(
                        env,
                        algo,
                        int(s),
                        over,
                        _safe(label) if label else "",
                        tuple(sorted(run_env_kwargs.items())),
                    )
                )
    dirs: dict[str, BenchRun] = {}
    for r in runs:
        d = r.run_dir("")
        if d in dirs:
            raise ValueError(
                f"two runs of the request would share the directory {d!r} ({dict(dirs[d].overrides)} "
                f"and {dict(r.overrides)}); give fewer or shorter grid values"
            )
        dirs[d] = r
    return runs


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``"ppo/ant,sac/hopper"`` -> ``[("ppo", "ant"), ("sac", "hopper")]``; one-line ValueError."""
    from algos import registry

    out = []
    for item in _split_list(text, "runs"):
        algo, sep, env = item.partition("/")
        if not sep or not algo or not env:
            raise ValueError(f"--runs expects ALGO/ENV pairs like ppo/ant,sac/hopper; got {item!r}")
        registry.get(algo)
        out.append((algo, env))
    return out


# ----------------------------------------------------------------------------------------------
# Packing: which runs share a program


@dataclasses.dataclass(frozen=True)
class Group:
    """Runs that are one vmapped program: same env, algorithm and shape fields; per run a seed and
    the values of the data fields that differ (``settings``, empty when only seeds differ)."""

    name: str
    env: str
    algo: str
    overrides: tuple[tuple[str, Any], ...]  # the fields every run of the group shares
    runs: tuple[BenchRun, ...]
    settings: tuple[tuple[tuple[str, Any], ...], ...]  # per run: its data-field values
    env_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(r.seed for r in self.runs)

    def settings_dicts(self) -> list[dict[str, Any]] | None:
        return [dict(s) for s in self.settings] if any(self.settings) else None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "env": self.env,
            "algo": self.algo,
            "overrides": dict(self.overrides),
            "runs": [dataclasses.asdict(r) for r in self.runs],
            "settings": [dict(s) for s in self.settings],
            "env_kwargs": dict(self.env_kwargs),
        }


def data_fields_of(algo: str) -> tuple[str, ...]:
    from algos import registry

    return tuple(getattr(registry.get(algo).module, "DATA_FIELDS", ()))


def plan(runs: Sequence[BenchRun], max_group: int | None = None) -> list[Group]:
    """Runs grouped into vmapped programs: the same (env, env kwargs, algo, non-data overrides) share
    one; the data fields whose values differ inside a group become per-run settings. ``max_group``
    caps a group's runs (memory); a larger group is split in order."""
    if max_group is not None and max_group < 1:
        raise ValueError(f"--max-group must be >= 1, got {max_group}")
    buckets: dict[tuple, list[BenchRun]] = {}
    for r in runs:
        data = set(data_fields_of(r.algo))
        shape = tuple((k, v) for k, v in r.overrides if k not in data)
        buckets.setdefault((r.env, r.env_kwargs, r.algo, shape), []).append(r)
    groups = []
    for (env, env_kwargs, algo, shape), members in buckets.items():
        data = set(data_fields_of(algo))
        differing = sorted(
            {
                k
                for r in members
                for k, _ in r.overrides
                if k in data and len({dict(m.overrides).get(k) for m in members}) > 1
            }
        )
        shared = shape + tuple((k, v) for k, v in members[0].overrides if k in data and k not in differing)
        chunks = (
            [members]
            if not max_group
            else [members[i : i + max_group] for i in range(0, len(members), max_group)]
        )
        for j, chunk in enumerate(chunks):
            tail = f"-{algo}-{len(groups)}" + (f"-part{j}" if len(chunks) > 1 else "")
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", env)[: 64 - len(tail)] + tail  # an MPS worker name
            settings = tuple(tuple((k, dict(r.overrides)[k]) for k in differing) for r in chunk)
            groups.append(Group(name, env, algo, tuple(sorted(shared)), tuple(chunk), settings, env_kwargs))
    return groups


@functools.lru_cache(maxsize=64)
def _group_overrides(group: Group) -> tuple[tuple[str, Any], ...]:
    """The group's config fields: a preset's values (resolved once per group: SAC's depends on the
    env, which is then built), its shared fields over them, the first run's settings (the others'
    come from ``settings``)."""
    from algos import commands
    from algos import sweep

    over = dict(group.overrides)
    preset = over.pop("preset", None)
    base = commands.preset_overrides(
        group.algo, preset, lambda: sweep.make_env(group.env, dict(group.env_kwargs))
    )
    first = dict(group.settings[0]) if group.settings else {}
    return tuple({**base, **over, **first}.items())


def group_config(group: Group) -> Any:
    """The group's config (validated; one-line errors)."""
    from algos import registry

    return registry.get(group.algo).make_config(**dict(_group_overrides(group)))


# ----------------------------------------------------------------------------------------------
# How to run groups of different shapes


def choose_mode(
    solo_s: Sequence[float], together_s: Sequence[float], units: Sequence[int], margin: float = 0.1
) -> tuple[str, str]:
    """("sequential" | "processes", why) from a measured probe: ``solo_s[i]`` = seconds per unit of
    program i alone, ``together_s[i]`` = the same while all run side by side, ``units[i]`` = its
    number of units. One after another takes ``sum(solo * units)``; side by side about
    ``max(together * units)``; processes are chosen when that is shorter by ``margin``."""
    seq = sum(s * u for s, u in zip(solo_s, units, strict=True))
    par = max(t * u for t, u in zip(together_s, units, strict=True))
    if par < (1 - margin) * seq:
        return "processes", (
            f"side by side ~{par:.0f} s vs one after another ~{seq:.0f} s of steady units "
            f"(probe: alone {', '.join(f'{s * 1e3:.1f}' for s in solo_s)} ms/unit; together "
            f"{', '.join(f'{t * 1e3:.1f}' for t in together_s)} ms/unit)"
        )
    return "sequential", (
        f"side by side ~{par:.0f} s is not {margin:.0%} shorter than one after another "
        f"~{seq:.0f} s (probe: alone {', '.join(f'{s * 1e3:.1f}' for s in solo_s)}, together "
        f"{', '.join(f'{t * 1e3:.1f}' for t in together_s)} ms/unit)"
    )


def decide(groups: Sequence[Group], mode: str, log=print) -> tuple[str, str]:
    """The mode for these groups and why: one group -> one program in this process; ``auto`` on a
    CPU -> one after another (processes would share its cores); ``auto`` on a GPU -> measured by
    :func:`probe` and :func:`choose_mode`."""
    if len(groups) == 1:
        return "sequential", "one program: every run is vmapped into it"
    if mode != "auto":
        return mode, f"--mode {mode}"
    import jax

    if jax.default_backend() != "gpu":
        return "sequential", (
            f"{jax.default_backend()} backend: processes side by side would share the same "
            "cores, one after another"
        )
    try:
        solo, together = probe(groups, log=log)
    except Exception as e:  # noqa: BLE001 - a failed probe must not take the benchmark down
        return "sequential", f"probe failed ({' '.join(str(e).split())[:200]}): one after another"
    units = [_num_units(g) for g in groups]
    return choose_mode(solo, together, units)


def _num_units(group: Group) -> int:
    from algos import registry

    return registry.get(group.algo).num_units(group_config(group))


def _run_spec(
    group: Group,
    checkpoint_every: int | None = None,
    keep: int | None = 3,
    root: str | None = None,
    resume: bool = False,
    xla_options: str = "default",
):
    """The group as a :class:`algos.sweep.RunSpec` (one process training its vmapped program)."""
    from algos import sweep

    settings = group.settings if any(group.settings) else ()
    return sweep.RunSpec(
        group.name,
        group.algo,
        group.env,
        _group_overrides(group),
        group.seeds,
        group.env_kwargs,
        checkpoint_every,
        keep,
        settings=settings,
        dirs=tuple(r.run_dir(root) for r in group.runs) if root else (),
        resume=resume,
        xla_options=xla_options,
    )


def probe(groups: Sequence[Group], steps: int = 3, log=print) -> tuple[list[float], list[float]]:
    """Seconds per unit of each group's vmapped program alone, then all at once as processes
    (each after a compile and a warm-up unit)."""
    import subprocess
    import tempfile

    from algos import sweep

    specs = [_run_spec(g) for g in groups]
    with sweep.ProcessSweep(specs, tempfile.mkdtemp(prefix="rose-bench-probe-"), mps=False) as ps:
        solo = sweep.probe_runs(specs, ps, None, steps)
        log(
            "[bench] probe alone: "
            + ", ".join(f"{g.name} {s * 1e3:.1f} ms/unit" for g, s in zip(groups, solo, strict=True))
        )
        outs, procs = [], []
        for spec in specs:
            out = tempfile.mkdtemp(prefix="rose-bench-probe-")
            job = os.path.join(out, sweep.JOB_FILE)
            with open(job, "w") as f:
                json.dump({"runs": [spec.to_json()], "steps": steps}, f)
            procs.append(
                subprocess.Popen(
                    [ps.python, "-m", "algos.sweep", "--probe", job],
                    env=ps.child_env(f"probe-{spec.name}", None),
                    cwd=sweep.repo_root(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            outs.append(out)
        together = []
        for p, out in zip(procs, outs, strict=True):
            _, err = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"probe process exited {p.returncode}: {' '.join(err.split()[-30:])}")
            with open(os.path.join(out, "probe.json")) as f:
                together.append(json.load(f)[0])
            shutil.rmtree(out, ignore_errors=True)
    log(
        "[bench] probe together: "
        + ", ".join(f"{g.name} {t * 1e3:.1f} ms/unit" for g, t in zip(groups, together, strict=True))
    )
    return solo, together


# ----------------------------------------------------------------------------------------------
# Running


def _group_state(group: Group, root: str) -> str:
    """ "finished" (every run finished), "resumable" (checkpoints at one step), "fresh" (nothing
    usable: its directories are cleared) for ``--resume``."""
    from algos import checkpoint
    from rose_jax.rundir import RunDir

    dirs = [r.run_dir(root) for r in group.runs]
    if all((RunDir(d).read_summary() or {}).get("status") == "finished" for d in dirs):
        return "finished"
    steps = {checkpoint.latest_step(os.path.join(d, "checkpoints")) for d in dirs}
    if len(steps) == 1 and None not in steps:
        return "resumable"
    return "fresh"


def run_group(
    group: Group,
    root: str,
    *,
    resume: bool = False,
    progress=None,
    checkpoint_every: int | None = None,
    keep: int | None = 3,
    xla_options: str = "auto",
    log=print,
) -> str:
    """Train the group's runs as one vmapped program in this process (under the fastest XLA option
    set of a trial on its first steps, ``xla_options`` as ``rose-jax train --xla-options``);
    returns its status."""
    from algos import sweep
    from rose_jax.optimize import cache
    from rose_jax.optimize import xla_options as xo

    dirs = [r.run_dir(root) for r in group.runs]
    state = _group_state(group, root) if resume else "fresh"
    if state == "finished":
        return "finished (already)"
    if state == "fresh":
        for d in dirs:
            if os.path.exists(d):
                shutil.rmtree(d)
    env = sweep.make_env(group.env, dict(group.env_kwargs))
    config = group_config(group)
    sweep.train_many(
        config,
        env,
        group.seeds,
        settings=group.settings_dicts(),
        run_dirs=dirs,
        env_kwargs=dict(group.env_kwargs),
        progress_fn=progress,
        resume=state == "resumable",
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep,
        xla_options=xo.sets_from_spec(xla_options),
        xla_options_cache=cache.default_dir(),
        log=log,
    )
    return "finished"


def run_benchmark(
    groups: Sequence[Group],
    root: str,
    mode: str,
    *,
    resume: bool = False,
    log=print,
    checkpoint_every: int | None = None,
    keep: int | None = 3,
    quotas: Any = "auto",
    mps: Any = "auto",
    compile_cache_dir: str | None = None,
    xla_options: str = "auto",
) -> dict[str, str]:
    """Every group, in ``mode``; ``{group name: status}`` (a failure is a status, not an exception)."""
    statuses: dict[str, str] = {}
    if mode == "processes":
        from algos import sweep

        todo, specs = [], []
        for g in groups:
            st = _group_state(g, root) if resume else "fresh"
            if st == "finished":
                statuses[g.name] = "finished (already)"
                continue
            if st == "fresh":
                for r in g.runs:
                    if os.path.exists(r.run_dir(root)):
                        shutil.rmtree(r.run_dir(root))
            todo.append(g)
            specs.append(_run_spec(g, checkpoint_every, keep, root, st == "resumable", xla_options))
        if todo:
            result, why = None, ""
            for attempt_quotas in (quotas, None) if quotas is not None else (None,):
                try:  # a failing quota probe (one group's broken program) must not end the benchmark
                    result = sweep.run_processes(
                        specs,
                        os.path.join(root, "processes"),
                        quotas=attempt_quotas,
                        mps=mps,
                        log=log,
                        compile_cache_dir=compile_cache_dir,
                    )
                    break
                except (RuntimeError, ValueError, OSError) as e:
                    why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                    log(
                        f"[bench] processes with quotas {attempt_quotas!r} could not start ({why})"
                        + ("; again without quotas" if attempt_quotas is not None else "")
                    )
            if result is None:
                for g in todo:
                    statuses[g.name] = f"failed: {why}"
                    _mark_failed(g, root, statuses[g.name])
                return statuses
            for o in result.outcomes:
                statuses[o.name] = o.status + (f": {o.error}" if o.status != "finished" and o.error else "")
        return statuses
    import signal

    from tqdm import tqdm

    from algos import driver

    steps = {g.name: len(g.runs) * group_config(g).num_timesteps for g in groups}  # env steps per group
    total = sum(steps.values())
    bar = tqdm(
        total=total,
        unit="step",
        unit_scale=True,
        dynamic_ncols=True,
        file=sys.stdout,
        mininterval=1.0 if sys.stdout.isatty() else 10.0,
        desc="bench",
    )
    interrupted = False

    def on_sigint(*_):  # the first Ctrl-C: stop after the step in flight, with checkpoints
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True
        tqdm.write(
            "[bench] Ctrl-C: stopping after the current step with checkpoints (again: at once)",
            file=sys.stdout,
        )

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for g in groups:
            if interrupted:
                statuses[g.name] = "not started (interrupted)"
                continue
            done = bar.n

            def progress(env_steps: int, rows: list[dict], g=g, done=done) -> None:
                bar.update(max(0, done + env_steps * len(g.runs) - bar.n))
                if interrupted:
                    raise driver.StopTraining

            t0 = time.perf_counter()
            try:
                statuses[g.name] = run_group(
                    g,
                    root,
                    resume=resume,
                    progress=progress,
                    checkpoint_every=checkpoint_every,
                    keep=keep,
                    xla_options=xla_options,
                    log=lambda m: tqdm.write(f"[bench] {m}", file=sys.stdout),
                )
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - one failing group is reported; the others run
                statuses[g.name] = f"failed: {' '.join(f'{type(e).__name__}: {e}'.split())[:300]}"
                _mark_failed(g, root, statuses[g.name])
            if interrupted and statuses[g.name] == "finished":
                statuses[g.name] = "interrupted (checkpointed; --resume continues it)"
            tqdm.write(
                f"[bench] {g.name}: {len(g.runs)} runs, {statuses[g.name]} "
                f"({time.perf_counter() - t0:.1f} s)",
                file=sys.stdout,
            )
            if not interrupted:
                bar.update(max(0, done + steps[g.name] - bar.n))
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
    return statuses


def _add_packing(report_path: str, record: dict[str, Any]) -> None:
    """Append how the runs were packed, and why, to the report (rewritten atomically)."""
    from rose_jax.io import atomic_write_text

    lines = [
        "",
        "## Packing",
        "",
        f"Programs of different shapes ran **{record['mode']}**: {record['why']}.",
        f"Whole benchmark: {record.get('wall_s', 0):.1f} s in this process.",
        "",
        "| program | runs | why | status |",
        "|---|---|---|---|",
    ]
    for g in record["groups"]:
        lines.append(
            f"| {g['name']} | {len(g['runs'])} | {g['why']} | "
            f"{record.get('statuses', {}).get(g['name'], '')} |"
        )
    with open(report_path) as f:
        text = f.read()
    atomic_write_text(report_path, text.rstrip("\n") + "\n" + "\n".join(lines) + "\n")


def _mark_failed(group: Group, root: str, why: str) -> None:
    """A group that failed before its run directories were made still leaves a summary per run."""
    from rose_jax.rundir import RunDir

    for r in group.runs:
        run = RunDir(r.run_dir(root))
        if run.read_summary() is None:
            os.makedirs(run.path, exist_ok=True)
            if run.read_run() is None:  # what the run was, for the report's table
                run.write_run(
                    {
                        "algo": r.algo,
                        "env": r.env,
                        "env_kwargs": dict(r.env_kwargs),
                        "config": {**dict(r.overrides), "seed": r.seed},
                    }
                )
            run.finish("failed", f"{r.algo} on {r.env}", {"error": why})


# ----------------------------------------------------------------------------------------------
# rose-jax bench


def add_arguments(p: argparse.ArgumentParser) -> None:
    from algos.registry import count_arg

    p.add_argument("--env", help="comma-separated environment names (see `rose-jax envs`)")
    p.add_argument(
        "--runs",
        metavar="ALGO/ENV,...",
        help="algorithm/env pairs instead of every --env x every --algo, e.g. ppo/ant,sac/hopper",
    )
    p.add_argument("--algo", default="ppo", help="comma-separated algorithms (default: %(default)s)")
    p.add_argument(
        "--seeds", default="4", help="N (seeds 0..N-1) or a comma-separated list (default: %(default)s)"
    )
    p.add_argument("--steps", type=count_arg, metavar="N", help="environment steps per run, e.g. 1e6")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[ALGO.]KEY=VALUE",
        help="a hyperparameter of every run (or of one algorithm's runs); repeatable",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="[ALGO.]KEY=V1,V2",
        help="every combination of the values; data fields (learning rates, discount, ...) "
        "are vmapped as data in one program; repeatable",
    )
    p.add_argument(
        "--preset",
        choices=["brax", "published"],
        help="below --set: brax = Brax's defaults; published = Brax's published configuration of "
        "each algo/env (ppo/ant, ppo/humanoid, sac/hopper), its length unless --steps",
    )
    p.add_argument("--backend", help="physics backend of Brax envs: mjx, generalized, positional, spring")
    p.add_argument(
        "--env-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a keyword of every env's factory (repeatable)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="how programs of different shapes run: auto = a measured probe decides (GPU), "
        "sequential, processes (default: %(default)s)",
    )
    p.add_argument("--max-group", type=count_arg, metavar="K", help="at most K runs per vmapped program")
    p.add_argument("--quotas", default="auto", help="SM quotas of processes under MPS (as `rose-jax sweep`)")
    p.add_argument("--no-mps", action="store_true", help="plain processes even where MPS is available")
    p.add_argument("--run-dir", metavar="DIR", help="the benchmark's root (default: runs/bench-<time>)")
    p.add_argument(
        "--resume", action="store_true", help="finish the benchmark in --run-dir (finished runs kept)"
    )
    p.add_argument("--checkpoint-every", type=count_arg, metavar="K", help="also checkpoint every K units")
    p.add_argument(
        "--xla-options",
        default="auto",
        metavar="auto|default|SETS",
        help="XLA option sets tried on each program's first steps, the fastest kept (GPU only), as "
        "`rose-jax train --xla-options` (default: %(default)s)",
    )
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compile cache (on by default, as for `rose-jax train`; "
        "$ROSE_JAX_COMPILE_CACHE moves it)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=count_arg,
        default=3,
        metavar="N",
        help="keep the N newest checkpoints per run plus the best; 0 keeps all (default: %(default)s)",
    )


def request_of(args) -> dict[str, Any]:
    from algos import registry
    from algos import sweep

    if not args.env and not args.runs:
        raise ValueError(
            "--env is required (comma-separated names, see `rose-jax envs`), or --runs ALGO/ENV,..."
        )
    if args.env and args.runs:
        raise ValueError("give --env/--algo or --runs, not both")
    if args.steps is not None and args.steps <= 0:
        raise ValueError(f"--steps must be > 0, got {args.steps}")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    pairs = parse_pairs(args.runs) if args.runs else None
    algos = sorted({a for a, _ in pairs}) if pairs else _split_list(args.algo, "algo")
    for a in algos:
        registry.get(a)
    envs = list(dict.fromkeys(e for _, e in pairs)) if pairs else _split_list(args.env, "env")
    return {
        "env": envs,
        "algo": algos,
        "pairs": pairs,
        "seeds": list(sweep.parse_seeds(args.seeds)),
        "steps": args.steps,
        "set": list(args.set),
        "grid": list(args.grid),
        "preset": args.preset,
        "env_kwargs": registry.parse_env_args(args.backend, args.env_arg),
        "mode": args.mode,
        "xla_options": _check_xla_options(args.xla_options),
        "quotas": _quotas_arg(args.quotas),
        "max_group": args.max_group,
    }


def _quotas_arg(text: str) -> Any:
    from algos import sweep

    q = sweep.parse_quotas(text)  # one-line ValueError
    return list(q) if isinstance(q, tuple) else q


def _check_xla_options(spec: str) -> str:
    from rose_jax.optimize import xla_options as xo

    xo.sets_from_spec(spec)  # one-line ValueError
    return spec


def _quota_value(q: Any) -> Any:
    return tuple(q) if isinstance(q, list) else q


def main_bench(args: argparse.Namespace) -> int:
    """``rose-jax bench``. Exit 0 when every run finished, 1 when one failed (the table says which),
    2 for a bad request (one line, nothing made)."""
    from rose_jax import benchreport
    from rose_jax.io import atomic_write_json

    def fail(msg: str) -> int:
        print(f"rose-jax bench: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2

    root = args.run_dir or os.path.join("runs", f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    plan_path = os.path.join(root, PLAN_FILE)
    try:
        from rose_jax import rundir

        rundir.check_path(root)  # under a file, or a file itself: one line
        if args.resume:
            if not os.path.exists(plan_path):
                return fail(f"--resume: {root!r} holds no benchmark ({PLAN_FILE} missing)")
            with open(plan_path) as f:
                request = json.load(f)["request"]
        else:
            if os.path.exists(plan_path):
                return fail(
                    f"{root!r} already holds a benchmark; pass --resume to finish it, or another --run-dir"
                )
            request = request_of(args)
        runs = expand(
            request["env"],
            request["algo"],
            request["seeds"],
            request["set"],
            request["grid"],
            request["steps"],
            request["preset"],
            request["env_kwargs"],
            [tuple(p) for p in request["pairs"]] if request.get("pairs") else None,
        )
        groups = plan(runs, request.get("max_group"))
        for g in groups:
            group_config(g)  # every config validated before anything runs
    except (ValueError, TypeError) as e:
        return fail(e)
    os.makedirs(root, exist_ok=True)
    cache_dir = ""
    if not args.no_compile_cache:  # a group's program compiles once; a rerun or resume finds it on disk
        from rose_jax import startup

        try:
            cache_dir = startup.enable_compile_cache()
        except ValueError as e:
            print(f"rose-jax bench: compile cache off ({e})", flush=True)
    mode, why = decide(groups, request["mode"])
    record = {
        "request": request,
        "mode": mode,
        "why": why,
        "groups": [
            {
                **g.to_json(),
                "why": (
                    f"{len(g.runs)} runs of one shape: one vmapped program"
                    + (f", settings {sorted(dict(g.settings[0]))} as data" if any(g.settings) else "")
                ),
            }
            for g in groups
        ],
        "started": time.time(),
    }
    atomic_write_json(plan_path, record)
    print(
        f"rose-jax bench: {len(runs)} runs in {len(groups)} program(s), {mode} ({why}) -> {root}", flush=True
    )
    t0 = time.perf_counter()
    statuses = run_benchmark(
        groups,
        root,
        mode,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep_checkpoints or None,
        quotas=_quota_value(request.get("quotas", "auto")),
        mps=False if args.no_mps else "auto",
        compile_cache_dir=cache_dir or None,
        xla_options=request.get("xla_options", "auto"),
    )
    record.update(statuses=statuses, wall_s=round(time.perf_counter() - t0, 2), finished=time.time())
    atomic_write_json(plan_path, record)
    made = [r.run_dir(root) for r in runs if os.path.isdir(r.run_dir(root))]  # not started: no directory
    try:
        if not made:
            raise ValueError("no run directory was made")
        paths = benchreport.write_report(
            made,
            os.path.join(root, REPORT_DIR),
            title=f"rose-jax bench: {', '.join(request['env'])} x {', '.join(request['algo'])}",
        )
    except (ValueError, OSError) as e:  # the runs stay; the report can be made later from them
        print(
            f"rose-jax bench: no report ({' '.join(str(e).split())}); "
            f"`python -m rose_jax.benchreport {root}` makes it from the run directories",
            file=sys.stderr,
        )
        return 1
    _add_packing(paths["report"], record)
    with open(paths["report"]) as f:
        print(f.read())
    print(f"rose-jax bench: report {paths['report']}, curves {paths['curves']}, scores {paths['scores']}")
    return 0 if all(s.startswith("finished") for s in statuses.values()) else 1


__all__ = [
    "BenchRun",
    "Group",
    "choose_mode",
    "decide",
    "expand",
    "main_bench",
    "plan",
    "run_benchmark",
    "run_group",
]
