"""A benchmark report over run directories: many runs (seeds x configs x envs) as one benchmark.

It reads only run directories (:mod:`rose_jax.rundir`'s layout), so it aggregates runs made by
any path: ``rose-jax sweep`` (``<root>/seed-<s>``, ``<root>/<name>/seed-<s>``), runs made one
at a time with ``rose-jax train``, or anything else that writes that layout.

What is computed:

- per run (:class:`RunResult`, :func:`collect`): its **final score** is the last finite value of
  its score key in the record, and the score key is the first of :data:`SCORE_KEYS` that has a
  finite value in any row: the evaluation return where the run evaluates (for a finished run
  the final evaluation, the score Brax reports), else the mean training episode return. Its
  curve is that key over env steps. A failed run keeps its status and error and has no score
  (NaN).
- per task, the runs of one (env, algo, settings) where the settings are the config fields
  (and ``env_kwargs``) that differ between runs of one env and algo, seeds aside
  (:class:`TaskStats`, :func:`aggregate`): over the runs that finished with a finite score,
  their number, mean, median, IQM and percentile-bootstrap 95% confidence intervals of the mean
  and of the IQM. Runs that failed, were interrupted, never wrote a summary, or have no finite
  score are not counted; they are listed with the reason.
- the benchmark's wall-clock (:func:`benchmark_span`): from the earliest run start to the
  latest run end (every run, failed ones too).

Estimators follow rliable (Agarwal et al. 2021, "Deep RL at the edge of the statistical
precipice"): IQM is the interquartile mean, ``scipy.stats.trim_mean(scores, 0.25)`` (the mean
after dropping ``floor(n / 4)`` runs at each end: the middle 50% when 4 divides n; with fewer
than 4 runs nothing is dropped and the IQM is the plain mean); intervals are percentile
bootstraps over runs (:data:`BOOTSTRAP_RESAMPLES` resamples, seed :data:`BOOTSTRAP_SEED`, so a
report is a pure function of its runs; every task draws from the same seed). One run gives a
zero-width interval: a bootstrap cannot show spread that was not sampled. Tasks are reported
separately: returns of different envs are on different scales and no normalisation is defined
here, so there is no across-task aggregate.

Outputs (:func:`write_report`), each written atomically: ``report.md`` (a Markdown table, a
row per task; a table of the runs not counted with their one-line error, the benchmark's wall-clock),
``scores.json`` (the score matrix, strict JSON: NaN -> null) and ``curves.png`` (one panel per
env with a counted run, a line per algo/settings: the mean over seeds on a common env-step grid, with its 95%
bootstrap band). ``python -m rose_jax.benchreport RUN_ROOT [--out DIR]`` prints the table and
writes the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import sys
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from rose_jax.io import atomic_write_bytes, atomic_write_text
from rose_jax.rundir import RECORD, RUN, SUMMARY, RunDir, strict_json

# the score of a row: the first finite one of these keys. A copy of algos.driver.SCORE_KEYS (the
# rule of algos.driver.score_of, checkpoint retention): rose_jax does not import algos.
# (algos.ppo_brax writes Brax's "eval/episode_reward" as "eval_episode_return" too.)
SCORE_KEYS = ("eval_episode_return", "episode_return")
# Why not rliable 1.2.0 itself: it installs on Python 3.12 (an sdist requiring arch>=5.3.1,<8,
# which brings statsmodels, patsy and formulaic) but does not import here: arch 7.2.0 (the newest
# below 8) fails at import with pandas 3 (pandas.util._decorators.deprecate_kwarg changed), the
# pandas of this venv. What a per-task report needs of it is two estimators, reproduced below
# with numpy/scipy: its IQM (scipy.stats.trim_mean(x, 0.25)) and its percentile bootstrap over
# runs (arch's IIDBootstrap). Checked once against rliable 1.2.0 (with pandas 2.3 on a scratch
# path; metrics.aggregate_iqm, library.get_interval_estimates, 3-20 runs): IQM equal; interval
# ends within 0.6% of the score range at 50,000 resamples each, within 2% at 2,000 (resampling noise).
BOOTSTRAP_RESAMPLES = 10_000  # per task; the curves' per-point bands use CURVE_RESAMPLES
CURVE_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
GRID_POINTS = 100  # curves of seeds with different env steps are interpolated onto this many points
REPORT, SCORES, CURVES = "report.md", "scores.json", "curves.png"
_SKIP_DIRS = ("checkpoints", "__pycache__")  # never searched for runs (a run's checkpoints: big trees)


# ----------------------------------------------------------------------------------------------
# runs


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run directory, read.

    path: the run directory. algo, env: from ``run.json``, else ``summary.json`` (``"?"`` if
    neither says). seed: the
    config's seed (None if absent). settings: the config fields that differ between the runs of
    this env and algo that were collected together, seed aside, as ``"name=value, ..."`` (``""``
    when they all agree). status: ``summary.json``'s status (``"finished"``, ``"failed"``,
    ``"interrupted"``, ...), ``"unfinished"`` without a summary (a run going on, or killed).
    error: the summary's one-line error, if any. score_key: the row key its scores come from
    (None: no finite score in any row). score: the final score (module docstring); NaN when
    there is none and always for a failed run. score_env_steps: the env steps of that score.
    env_steps, wall_s: the last row's (0 / NaN without rows). start_time, end_time: unix seconds
    (:func:`run_span`), None when unknown. curve_steps, curve_scores: the score key over env steps.
    """

    path: str
    algo: str
    env: str
    seed: int | None
    settings: str
    status: str
    error: str | None
    score_key: str | None
    score: float
    score_env_steps: int | None
    env_steps: int
    wall_s: float
    start_time: float | None
    end_time: float | None
    curve_steps: tuple[float, ...]
    curve_scores: tuple[float, ...]

    @property
    def task(self) -> tuple[str, str, str]:
        """``(env, algo, settings)``: the runs of one task are seeds of one configuration."""
        return (self.env, self.algo, self.settings)

    @property
    def counted(self) -> bool:
        """Whether the run enters the scores: it finished, with a finite final score."""
        return self.status == "finished" and math.isfinite(self.score)

    @property
    def reason(self) -> str:
        """Why the run is not counted (``""`` if it is): its error, else what is missing."""
        if self.counted:
            return ""
        if self.error:
            return self.error
        if self.status == "unfinished":
            return "no summary.json: the run is going on, or was killed"
        if self.status != "finished":
            return f"status {self.status}"
        return "no finite score in its record (no episode finished?)"


def find_run_dirs(path: str | os.PathLike) -> list[str]:
    """The run directories at or under ``path``, sorted: directories holding ``run.json``, or
    ``summary.json`` alone (a run that failed before it started, e.g. its env factory raised: a
    sweep still writes its failed summary). A run directory is not searched further, nor are
    ``checkpoints`` folders and hidden ones.

    Raises a one-line ValueError when ``path`` does not exist or holds no run directory.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) == RUN:
        path = os.path.dirname(path) or "."
    if not os.path.exists(path):
        raise ValueError(f"benchreport: {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"benchreport: {path!r} is a file, not a run directory or a folder of runs")
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        if RUN in filenames or SUMMARY in filenames:
            found.append(os.path.normpath(dirpath))
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
    if not found:
        raise ValueError(f"benchreport: {path!r} holds no run directory (no {RUN} or {SUMMARY} "
                         "at or under it)")
    return sorted(found)


def collect(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[RunResult]:
    """Read every run directory at or under ``paths`` (run directories, or roots searched with
    :func:`find_run_dirs`) into :class:`RunResult` s, in path order, each directory once.

    The settings label of a run needs the other runs of its env and algo: it is computed over
    all runs collected in this call.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError("benchreport: no run directory given")
    dirs: dict[str, str] = {}
    for p in paths:
        for d in find_run_dirs(p):
            dirs.setdefault(os.path.realpath(d), d)
    raw = [_read(d) for d in sorted(dirs.values())]
    labels = _settings_labels([(r["env"], r["algo"], r["settings"]) for r in raw])
    return [RunResult(settings=label, **{k: v for k, v in r.items() if k != "settings"})
            for r, label in zip(raw, labels, strict=True)]


def _read(path: str) -> dict[str, Any]:
    run = RunDir(path)
    summary = run.read_summary()
    info = run.read_run() or {}
    for name in ("algo", "env"):  # no run.json (failed at start): what the summary says, if anything
        if name not in info and summary is not None and name in summary:
            info[name] = summary[name]
    rows = run.rows()
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    seed = config.get("seed")
    status = str(summary.get("status", "unknown")) if summary is not None else "unfinished"
    error = summary.get("error") if summary is not None else None
    key = next((k for k in SCORE_KEYS if any(_finite(r.get(k)) for r in rows)), None)
    curve = [(float(r["env_steps"]), float(r[key])) for r in rows
             if key and _finite(r.get(key)) and _finite(r.get("env_steps"))]
    scored = bool(curve) and status != "failed"
    score, score_steps = (curve[-1][1], int(curve[-1][0])) if scored else (math.nan, None)
    last = rows[-1] if rows else {}
    start, end = run_span(path, rows)
    settings = {f"config.{k}": v for k, v in _flatten(config).items() if k != "seed"}
    env_kwargs = info.get("env_kwargs")
    if isinstance(env_kwargs, dict):
        settings.update({f"env_kwargs.{k}": v for k, v in _flatten(env_kwargs).items()})
    return {
        "path": path,
        "algo": str(info.get("algo", "?")),
        "env": str(info.get("env", "?")),
        "seed": seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        "settings": settings,
        "status": status,
        "error": _one_line(error) if error else None,
        "score_key": key,
        "score": score,
        "score_env_steps": score_steps,
        "env_steps": int(last.get("env_steps", 0) or 0),
        "wall_s": float(last["wall_s"]) if _finite(last.get("wall_s")) else math.nan,
        "start_time": start,
        "end_time": end,
        "curve_steps": tuple(s for s, _ in curve),
        "curve_scores": tuple(v for _, v in curve),
    }


def run_span(path: str | os.PathLike,
             rows: Sequence[dict[str, Any]] | None = None) -> tuple[float | None, float | None]:
    """``(start, end)`` of a run in unix seconds, None where unknown.

    With rows that carry ``time`` (unix seconds at the row, as ``rose-jax sweep`` writes): the
    start is the first such row's ``time - wall_s`` (``wall_s``: seconds since the run's start),
    the end the last such row's ``time``. Otherwise the end is the modification time of
    ``summary.json`` (else of the record) and the start the end minus the last row's ``wall_s``,
    else the modification time of ``run.json`` (written when the run starts).
    """
    run = RunDir(os.fspath(path))
    rows = run.rows() if rows is None else rows
    timed = [r for r in rows if _finite(r.get("time"))]
    if timed:
        first = timed[0]
        start = float(first["time"]) - (float(first["wall_s"]) if _finite(first.get("wall_s")) else 0.0)
        return start, float(timed[-1]["time"])
    end = _mtime(run.file(SUMMARY))
    if end is None:
        end = _mtime(run.file(RECORD))
    wall = rows[-1].get("wall_s") if rows else None
    start = end - float(wall) if end is not None and _finite(wall) else _mtime(run.file(RUN))
    return start, end


def _settings_labels(keys: Sequence[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Per run, ``"name=value, ..."`` over the settings that differ within its (env, algo)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (env, algo, _) in enumerate(keys):
        groups.setdefault((env, algo), []).append(i)
    labels = [""] * len(keys)
    for members in groups.values():
        names = sorted({n for i in members for n in keys[i][2]})
        differ = [n for n in names if len({_canonical(keys[i][2], n) for i in members}) > 1]
        for i in members:
            labels[i] = ", ".join(
                f"{n.removeprefix('config.')}="
                f"{_compact(keys[i][2][n]) if n in keys[i][2] else '(unset)'}"
                for n in differ
            )
    return labels


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _canonical(settings: dict[str, Any], name: str) -> str:
    """A setting's value as comparable text; a missing setting differs from every value."""
    if name not in settings:
        return "\0unset"
    return json.dumps(settings[name], sort_keys=True, default=str)


def _compact(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), default=str)


def _nanmean(xs: Sequence[float]) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return float(np.mean(finite)) if finite else math.nan


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _one_line(text: Any, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ----------------------------------------------------------------------------------------------
# estimators


def iqm(scores: Any, axis: int = -1) -> Any:
    """The interquartile mean (rliable's IQM): ``scipy.stats.trim_mean(scores, 0.25)``, the mean
    after dropping ``floor(n / 4)`` scores at each end (so the plain mean for n < 4)."""
    from scipy.stats import trim_mean

    return trim_mean(np.asarray(scores, dtype=float), 0.25, axis=axis)


def _mean(x: Any, axis: int = -1) -> Any:
    return np.mean(x, axis=axis)


def bootstrap_ci(
    scores: Any,
    statistic: Callable[..., Any] = _mean,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float]:
    """The percentile-bootstrap ``confidence`` interval of ``statistic`` over runs.

    ``scores``: one score per run (or shape ``(runs, points)``: one interval per point, returned
    as two arrays). Draws ``resamples`` resamples of the runs with replacement from
    ``numpy.random.default_rng(seed)``, applies ``statistic(x, axis=...)`` over the runs, and
    takes its ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles. NaN without runs.
    """
    x = np.asarray(scores, dtype=float)
    if x.ndim not in (1, 2):
        raise ValueError(f"bootstrap_ci: scores must be 1-D (runs) or 2-D (runs, points), "
                         f"got shape {x.shape}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"bootstrap_ci: resamples must be a positive int, got {resamples!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence!r}")
    n = x.shape[0]
    if n == 0:
        return (math.nan, math.nan)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    stats = statistic(x[idx], axis=1)  # (resamples,) or (resamples, points)
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [tail, 1 - tail], axis=0)
    if x.ndim == 1:
        return (float(lo), float(hi))
    return (lo, hi)


@dataclasses.dataclass(frozen=True)
class TaskStats:
    """The aggregates of one task (the runs of one env, algo and settings).

    runs: all its runs, by seed then path. n: the runs counted (finished, finite score). mean,
    median, iqm: of their final scores (NaN when n is 0). mean_ci, iqm_ci: percentile-bootstrap
    intervals (:func:`bootstrap_ci`). env_steps: ``(min, max)`` of the counted runs' final env
    steps. wall_s: the counted runs' mean wall-clock seconds (the last row's ``wall_s``).
    """

    env: str
    algo: str
    settings: str
    runs: tuple[RunResult, ...]
    n: int
    mean: float
    median: float
    iqm: float
    mean_ci: tuple[float, float]
    iqm_ci: tuple[float, float]
    env_steps: tuple[int, int] | None
    wall_s: float

    @property
    def label(self) -> str:
        """``"algo on env"``, with ``" (settings)"`` when there are any."""
        base = f"{self.algo} on {self.env}"
        return f"{base} ({self.settings})" if self.settings else base

    @property
    def scores(self) -> np.ndarray:
        """The counted runs' final scores."""
        return np.array([r.score for r in self.runs if r.counted], dtype=float)

    @property
    def score_keys(self) -> tuple[str, ...]:
        return tuple(sorted({r.score_key for r in self.runs if r.counted and r.score_key}))


def task_stats(runs: Sequence[RunResult], *, resamples: int = BOOTSTRAP_RESAMPLES,
               seed: int = BOOTSTRAP_SEED) -> TaskStats:
    """The :class:`TaskStats` of ``runs``, which must all be of one task."""
    if not runs:
        raise ValueError("benchreport: task_stats needs at least one run")
    tasks = {r.task for r in runs}
    if len(tasks) != 1:
        raise ValueError(f"benchreport: task_stats got runs of {len(tasks)} tasks; pass one task's runs")
    env, algo, settings = runs[0].task
    runs = tuple(sorted(runs, key=lambda r: (r.seed is None, r.seed or 0, r.path)))
    ok = [r for r in runs if r.counted]
    x = np.array([r.score for r in ok], dtype=float)
    nan2 = (math.nan, math.nan)
    return TaskStats(
        env=env, algo=algo, settings=settings, runs=runs, n=len(ok),
        mean=float(np.mean(x)) if ok else math.nan,
        median=float(np.median(x)) if ok else math.nan,
        iqm=float(iqm(x)) if ok else math.nan,
        mean_ci=bootstrap_ci(x, _mean, resamples=resamples, seed=seed) if ok else nan2,
        iqm_ci=bootstrap_ci(x, iqm, resamples=resamples, seed=seed) if ok else nan2,
        env_steps=(min(r.env_steps for r in ok), max(r.env_steps for r in ok)) if ok else None,
        wall_s=_nanmean([r.wall_s for r in ok]),
    )


def aggregate(runs: Sequence[RunResult], *, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> list[TaskStats]:
    """One :class:`TaskStats` per task of ``runs``, sorted by (env, algo, settings)."""
    groups: dict[tuple[str, str, str], list[RunResult]] = {}
    for r in runs:
        groups.setdefault(r.task, []).append(r)
    return [task_stats(groups[t], resamples=resamples, seed=seed) for t in sorted(groups)]


def benchmark_span(runs: Sequence[RunResult]) -> tuple[float | None, float | None, float | None]:
    """``(start, end, seconds)`` of the benchmark: the earliest run start to the latest run end
    (every run, failed ones too; :func:`run_span`); Nones when no run has both."""
    starts = [r.start_time for r in runs if r.start_time is not None and r.end_time is not None]
    ends = [r.end_time for r in runs if r.start_time is not None and r.end_time is not None]
    if not starts:
        return (None, None, None)
    return (min(starts), max(ends), max(ends) - min(starts))


# ----------------------------------------------------------------------------------------------
# outputs


def markdown(runs: Sequence[RunResult], *, title: str | None = None,
             stats: Sequence[TaskStats] | None = None, curves: str | None = None) -> str:
    """The report as Markdown: the table of tasks, the runs not counted, the wall-clock."""
    stats = aggregate(runs) if stats is None else stats
    span = benchmark_span(runs)[2]
    summed = sum(r.wall_s for r in runs if math.isfinite(r.wall_s))
    n_ok = sum(r.counted for r in runs)
    lines = [f"# {title or 'Benchmark report'}", ""]
    lines.append(f"{_count(len(runs), 'run')} in {_count(len(stats), 'task')}, {n_ok} counted. "
                 f"Benchmark wall-clock: "
                 f"{_duration(span)} (earliest run start to latest run end); the runs' own wall-clock "
                 f"summed: {_duration(summed)}.")
    lines += ["", "| task | runs (ok/failed) | env steps | score | mean [95% CI] | IQM [95% CI] | median "
              "| wall-clock per run (mean) |", "|---|---|---|---|---|---|---|---|"]
    for t in stats:
        steps = "—" if t.env_steps is None else f"{t.env_steps[0]:,}"
        if t.env_steps is not None and t.env_steps[0] != t.env_steps[1]:
            steps += f"–{t.env_steps[1]:,}"
        lines.append(
            f"| {_cell(t.label)} | {t.n}/{len(t.runs) - t.n} | {steps} | {', '.join(t.score_keys) or '—'} "
            f"| {_num(t.mean)} [{_num(t.mean_ci[0])}, {_num(t.mean_ci[1])}] "
            f"| {_num(t.iqm)} [{_num(t.iqm_ci[0])}, {_num(t.iqm_ci[1])}] | {_num(t.median)} "
            f"| {_duration(t.wall_s)} |"
        )
    lines += ["", f"Score: each run's final score: the last value of its score key "
              f"(`eval_episode_return`: the final evaluation; else `episode_return`: the mean "
              f"training episode return at the end). IQM: the mean after dropping floor(n/4) runs "
              f"at each end (rliable's; the plain mean for n < 4). 95% CI: percentile bootstrap "
              f"over runs, {BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}. \"failed\": "
              f"every run not counted (below)."]
    left = [r for t in stats for r in t.runs if not r.counted]
    lines += ["", "## Runs not counted", ""]
    if left:
        lines += ["| run | task | seed | status | error |", "|---|---|---|---|---|"]
        for r in left:
            lines.append(f"| {_cell(r.path)} | {_cell(_label(r))} | {'—' if r.seed is None else r.seed} "
                         f"| {r.status} | {_cell(r.reason)} |")
    else:
        lines.append("None: every run finished with a finite score.")
    if curves:
        lines += ["", "## Learning curves", "", f"![learning curves]({curves})"]
    return "\n".join(lines) + "\n"


def score_matrix(runs: Sequence[RunResult], *, title: str | None = None,
                 stats: Sequence[TaskStats] | None = None) -> dict[str, Any]:
    """The score matrix as a strict-JSON-ready dict: per task its aggregates and, per run, its
    path, seed, status, final score (None when there is none), whether it is counted, and error."""
    stats = aggregate(runs) if stats is None else stats
    start, end, span = benchmark_span(runs)
    tasks = []
    for t in stats:
        tasks.append({
            "env": t.env, "algo": t.algo, "settings": t.settings, "label": t.label,
            "n": t.n, "runs_total": len(t.runs), "score_keys": list(t.score_keys),
            "mean": t.mean, "median": t.median, "iqm": t.iqm,
            "mean_ci": list(t.mean_ci), "iqm_ci": list(t.iqm_ci),
            "env_steps": None if t.env_steps is None else list(t.env_steps), "wall_s_mean": t.wall_s,
            "scores": [r.score for r in t.runs],
            "runs": [{"path": r.path, "seed": r.seed, "status": r.status, "counted": r.counted,
                      "score": r.score, "score_key": r.score_key, "score_env_steps": r.score_env_steps,
                      "env_steps": r.env_steps, "wall_s": r.wall_s, "start_time": r.start_time,
                      "end_time": r.end_time, "error": r.error or (r.reason or None)}
                     for r in t.runs],
        })
    return strict_json({
        "title": title,
        "score": "per run: the last finite value of its score key (the first of score_keys with a "
                 "finite value: the final evaluation return, else the training episode return); "
                 "counted: finished with a finite score",
        "estimators": {
            "iqm": "scipy.stats.trim_mean(scores, 0.25) (rliable's IQM; the plain mean for n < 4)",
            "ci": {"method": "percentile bootstrap over runs", "resamples": BOOTSTRAP_RESAMPLES,
                   "seed": BOOTSTRAP_SEED, "confidence": CONFIDENCE},
        },
        "benchmark": {"start_time": start, "end_time": end, "wall_s": span, "runs": len(runs),
                      "counted": sum(r.counted for r in runs)},
        "tasks": tasks,
    })


def mean_curve(runs: Sequence[RunResult], *, resamples: int = CURVE_RESAMPLES,
               seed: int = BOOTSTRAP_SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(steps, mean, low, high)``: the counted runs' curves on a common env-step grid, their mean
    and its percentile-bootstrap interval per point; None without a counted run with a curve.

    The grid is the runs' env steps when they all share them, else :data:`GRID_POINTS` points
    spanning the env steps that every run covers, each curve linearly interpolated onto it.
    """
    curves = [(np.asarray(r.curve_steps), np.asarray(r.curve_scores)) for r in runs
              if r.counted and r.curve_steps]
    if not curves:
        return None
    if all(len(s) == len(curves[0][0]) and np.array_equal(s, curves[0][0]) for s, _ in curves):
        grid = curves[0][0].astype(float)
        ys = np.stack([v for _, v in curves])
    else:
        lo, hi = max(s[0] for s, _ in curves), min(s[-1] for s, _ in curves)
        grid = np.linspace(lo, hi, GRID_POINTS) if hi > lo else np.array([float(hi)])
        ys = np.stack([np.interp(grid, s, v) for s, v in curves])
    low, high = bootstrap_ci(ys, _mean, resamples=resamples, seed=seed)
    return grid, ys.mean(axis=0), np.asarray(low), np.asarray(high)


def plot_curves(runs: Sequence[RunResult], path: str | os.PathLike, *, title: str | None = None,
                stats: Sequence[TaskStats] | None = None, dpi: int = 110) -> list[str]:
    """Write ``curves.png``-style learning curves to ``path`` (atomically); returns the envs, one
    panel each in that order: the envs with a counted run (a single placeholder panel, and ``[]``,
    when there is none). A line per algo/settings (:func:`mean_curve`, the mean over seeds) with
    its shaded 95% band."""
    from matplotlib import ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stats = aggregate(runs) if stats is None else stats
    envs = sorted({t.env for t in stats if t.n})
    cols = min(3, max(1, len(envs)))
    rows = max(1, math.ceil(len(envs) / cols))
    fig = Figure(figsize=(5.2 * cols, 3.6 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[max(1, len(envs)):]:
        ax.set_visible(False)
    if not envs:
        axes.flat[0].text(0.5, 0.5, "no finished run with a score", ha="center", va="center",
                          transform=axes.flat[0].transAxes, color="0.4")
        axes.flat[0].set_axis_off()
    for ax, env in zip(axes.flat, envs, strict=False):
        keys = set()
        for i, t in enumerate(s for s in stats if s.env == env):
            curve = mean_curve(t.runs)
            if curve is None:
                continue
            steps, mean, low, high = curve
            keys.update(t.score_keys)
            color = f"C{i % 10}"
            label = (f"{t.algo} ({t.settings})" if t.settings else t.algo) + f", n={t.n}"
            ax.plot(steps, mean, color=color, label=label, marker="." if len(steps) < 20 else None)
            ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        ax.set_title(env)
        ax.set_xlabel("env steps")
        ax.set_ylabel(" / ".join(sorted(keys)) or "score")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=5, integer=True))
        ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
    fig.suptitle(f"{title or 'Benchmark'}: mean over seeds, shaded 95% bootstrap CI", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(os.fspath(path), buf.getvalue())
    return envs


def write_report(runs_or_root: Any, out_dir: str | os.PathLike, *,
                 title: str | None = None) -> dict[str, str]:
    """Write ``report.md``, ``scores.json`` and ``curves.png`` into ``out_dir`` (created), each
    atomically, ``report.md`` last; returns ``{"report": path, "scores": path, "curves": path}``.

    ``runs_or_root``: :class:`RunResult` s (from :func:`collect`), or what :func:`collect` takes.
    """
    runs = _runs(runs_or_root)
    out_dir = os.fspath(out_dir)
    paths = {"report": os.path.join(out_dir, REPORT), "scores": os.path.join(out_dir, SCORES),
             "curves": os.path.join(out_dir, CURVES)}
    stats = aggregate(runs)
    plot_curves(runs, paths["curves"], title=title, stats=stats)
    matrix = score_matrix(runs, title=title, stats=stats)
    atomic_write_text(paths["scores"], json.dumps(matrix, indent=1, allow_nan=False) + "\n")
    atomic_write_text(paths["report"], markdown(runs, title=title, stats=stats, curves=CURVES))
    return paths


def _runs(runs_or_root: Any) -> list[RunResult]:
    if isinstance(runs_or_root, (str, os.PathLike)):
        return collect(runs_or_root)
    items = list(runs_or_root)
    if items and all(isinstance(r, RunResult) for r in items):
        return items
    if any(isinstance(r, RunResult) for r in items):
        raise ValueError("benchreport: pass RunResults or paths, not a mix")
    return collect(items)


def _label(r: RunResult) -> str:
    base = f"{r.algo} on {r.env}"
    return f"{base} ({r.settings})" if r.settings else base


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _num(x: float) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _duration(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "unknown"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


# ----------------------------------------------------------------------------------------------
# command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rose_jax.benchreport RUN_ROOT... [--out DIR] [--title T]``: print the report
    and write it (default ``--out``: the first RUN_ROOT). Exit status 1 with a one-line error
    when a path holds no run directory."""
    p = argparse.ArgumentParser(prog="python -m rose_jax.benchreport",
                                description="A benchmark report (report.md, scores.json, curves.png) "
                                            "over run directories.")
    p.add_argument("roots", nargs="+", metavar="RUN_ROOT",
                   help="run directories, or folders searched for them (by run.json)")
    p.add_argument("--out", default=None, help="where to write the report (default: the first RUN_ROOT)")
    p.add_argument("--title", default=None, help="the report's title")
    args = p.parse_args(argv)
    try:
        runs = collect(args.roots)
        out = args.out or (args.roots[0] if os.path.isdir(args.roots[0]) else os.path.dirname(args.roots[0]))
        paths = write_report(runs, out, title=args.title)
    except ValueError as e:  # this module's messages start with "benchreport:"
        print(_one_line(e), file=sys.stderr)
        return 1
    except OSError as e:
        print(f"benchreport: cannot write the report: {_one_line(e)}", file=sys.stderr)
        return 1
    with open(paths["report"], encoding="utf-8") as f:
        print(f.read(), end="")
    print(f"\nwrote {paths['report']}, {paths['scores']}, {paths['curves']}")
    return 0


__all__ = [
    "BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "CONFIDENCE", "CURVE_RESAMPLES", "SCORE_KEYS", "RunResult",
    "TaskStats",
    "aggregate", "benchmark_span", "bootstrap_ci", "collect", "find_run_dirs", "iqm", "main",
    "markdown", "mean_curve", "plot_curves", "run_span", "score_matrix", "task_stats", "write_report",
]

if __name__ == "__main__":
    sys.exit(main())
