"""benchmarks/experiments/informed_peer.py: the rules behind its table (no training here; the
experiment's whole path runs with ``--smoke``, ~5 min on a 2-core CPU, and on the H200)."""

from __future__ import annotations

import json
import math
import os

import pytest

from helpers_children import wait_gone

from algos import bench
from benchmarks.experiments import informed_peer as ip


@pytest.mark.parametrize("name", sorted(ip.workloads()))
def test_every_brax_keyword_reaches_the_rose_run(name):
    """Each published Brax keyword becomes a --set of a config field (or --steps/--seed/--env-arg),
    and the CLI resolves the whole command to a config holding those values."""
    from rose_jax import cli

    w = ip.workloads()[name]
    argv = ip.rose_argv(w, 1000, smoke=name == "smoke")
    ns = cli.build_parser().parse_args(["train", *argv, "--run-dir", "/nonexistent/x"])
    assert ns.env == w["env"] and ns.algo == w["algo"] and ns.preset == "brax"
    sets = dict(
        a.split("=", 1) for a in argv[argv.index("--set") + 1 :: 2] if "=" in a and not a.startswith("--")
    )
    for key, value in w["kwargs"].items():
        if key in ("num_timesteps", "seed", "max_devices_per_host") or (
            w["algo"] == "sac" and key in ("episode_length", "action_repeat")
        ):
            continue
        assert sets[key] == bench.cli_value(value), key
    assert f"episode_length={w['kwargs'].get('episode_length', 1000)}" in argv


def test_unknown_keyword_is_refused():
    w = dict(ip.workloads()["ppo-ant"])
    w["kwargs"] = dict(w["kwargs"], not_a_field=1)
    with pytest.raises(ValueError, match="not_a_field"):
        ip.rose_argv(w, 1000, smoke=False)


def test_peer_steady_leaves_out_brax_two_compile_epochs():
    # step-0 eval, epoch 1 (compile: 50 s), epoch 2 (recompile: 40 s), then 4 epochs of 1 s per 1M steps
    t, reports = 0.0, [{"env_steps": 0, "t": 5.0, "sps": None}]
    t = 5.0
    for i, dt in enumerate([50, 40, 1, 1, 1.25, 1]):
        t += dt
        reports.append({"env_steps": (i + 1) * 1_000_000, "t": t, "sps": 1e6 / dt})
    median, rates, sps = ip._peer_steady(reports)
    assert len(rates) == 4  # the two compile epochs are out
    assert median == pytest.approx(1e6)
    assert sps == pytest.approx(1e6)  # Brax's own training/sps of epochs 3..6


def test_peer_steady_needs_three_intervals():
    reports = [{"env_steps": i * 10, "t": float(i), "sps": 1.0} for i in range(4)]
    assert ip._peer_steady(reports)[0] is None


def test_rose_steady_leaves_out_the_option_trial():
    info = {
        "xla_options": {
            "rounds": 1,
            "median_ms": {"default": 12.0, "concurrent_scheduling": 10.0, "concurrent_no_loops": 11.0},
            "chosen": "concurrent_scheduling",
        }
    }
    rows, t = [], 0.0
    for i, dt in enumerate([30, 12, 11, 10, 10, 10, 10]):  # unit 1 compiles; units 1-3 are the trial
        t += dt
        rows.append({"env_steps": (i + 1) * 100, "wall_s": t})
    median, rates = ip._rose_steady(rows, info)
    assert len(rates) == 4 and median == pytest.approx(10.0)
    assert ip._trial_cost_s(info) == pytest.approx((0.002 + 0.0 + 0.001))
    cached = {"xla_options": {**info["xla_options"], "cached": True}}
    assert len(ip._rose_steady(rows, cached)[1]) == 6
    # the last two reports written together (6 ms apart): that interval is not a unit's rate
    together = [*rows, {"env_steps": 800, "wall_s": t + 0.006}]
    median, rates = ip._rose_steady(together, info)
    assert len(rates) == 4 and median == pytest.approx(10.0) and max(rates) < 20.0
    assert ip._trial_cost_s(cached) == 0.0


def test_rose_steady_leaves_out_a_deferring_plans_last_interval():
    """An offloaded evaluation: each report waits for its unit's evaluation while the next unit
    trains (a 2 s cadence); the last report waits for the last evaluation alone (0.8 s after the one
    before): that interval is not a unit's rate and is left out only for a plan that defers metrics."""
    rows, t = [], 0.0
    for i, dt in enumerate([30, 2, 2, 2, 2, 0.8]):
        t += dt
        rows.append({"env_steps": (i + 1) * 100, "wall_s": t})
    plain = {"xla_options": {"cached": True}}
    deferred = {**plain, "optimize": {"plan": [{"name": "offload_component"}], "defers_metrics": True}}
    median, rates = ip._rose_steady(rows, deferred)
    assert rates == pytest.approx([50.0] * 4) and median == pytest.approx(50.0)
    assert max(ip._rose_steady(rows, plain)[1]) == pytest.approx(125.0)  # counted without the flag


def test_plan_record_says_whether_the_plan_defers_metrics():
    """defers_metrics is the trained step's own ``pipelined`` (stand-ins for an OffloadedStep and a
    jitted step here; the real OffloadedStep is pipelined in tests/test_offload.py)."""
    from types import SimpleNamespace

    from rose_jax.cli import plan_record
    from rose_jax.optimize.report import PlanReport

    offloaded, jitted = SimpleNamespace(pipelined=True), SimpleNamespace()

    def report(names, **kw):
        r = PlanReport("run_epoch", "fp", "key", "cpu", "0", 1, 3, "stepwise")
        r.plan = [{"name": n, "params": {}} for n in names]
        for k, v in kw.items():
            setattr(r, k, v)
        return r

    rec = plan_record(report(["offload_component"], cache_hit=True, speedup=1.14, equal=True), offloaded)
    assert rec["defers_metrics"] is True and rec["cache_hit"] is True and rec["speedup_on_unit"] == 1.14
    assert plan_record(report(["exit_idle_loops"]), jitted)["defers_metrics"] is False
    empty = plan_record(report([]), jitted)
    assert empty["plan"] == [] and empty["defers_metrics"] is False
    skipped = plan_record(report(["offload_component"], skipped="search skipped: too short"), jitted)
    assert skipped["defers_metrics"] is False and skipped["skipped"].startswith("search skipped")


def _rec(variant, wall, rate, repeat=1, call="c1", **kw):
    return {
        "workload": "ppo-ant",
        "variant": variant,
        "repeat": repeat,
        "call": call,
        "num_timesteps": 1000,
        "returncode": 0,
        "end_to_end_s": wall,
        "steady_env_steps_per_s": rate,
        "command": "cmd",
        **kw,
    }


def test_summary_compares_with_the_faster_peer_and_reports_spread(tmp_path):
    xo = {
        "chosen": "concurrent_scheduling",
        "options": {},
        "rounds": 1,
        "median_ms": {"default": 2.0, "concurrent_scheduling": 1.0},
    }
    recs = [
        _rec("peer_default", 100, 900.0),
        _rec("peer_default", 110, 910.0, 2),
        _rec("peer_flags", 90, 1000.0),
        _rec("peer_flags", 94, 1010.0, 2),
        _rec("rose_first", 60, 1100.0, xla_options=xo, trial_cost_s=0.5),
        _rec("rose_first", 70, 1100.0, 2, xla_options=xo, trial_cost_s=0.7),
        _rec("rose_cached", 40, 1100.0, xla_options=xo),
        _rec("rose_cached", 44, 1100.0, 2, xla_options=xo),
        {**_rec("rose_cached", 1, None, 3), "returncode": 1},  # a failed run: counted as failed, not timed
    ]
    (row,) = ip.summarize(recs, {"ppo-ant": {"equal": True, "max_abs_diff": 0.0}})
    assert row["speedup_vs_informed_peer"] == pytest.approx(1100 / 1005, abs=1e-3)
    assert row["end_to_end_s"] == {"peer_default": 105, "peer_flags": 92, "rose_first": 65, "rose_cached": 42}
    assert row["spread"]["rose_cached"] == [40, 44]
    assert row["repeats"]["rose_cached"] == 2 and row["failed"]["rose_cached"] == 1
    assert row["same_call"] is True
    assert row["plan"] == "concurrent_scheduling" and row["equal"] is True
    assert row["search_s"] == pytest.approx(0.6)
    assert row["breakeven_env_steps"] == round(0.6 / (1 / 1005 - 1 / 1100))
    assert row["rose_cached_vs_peer_flags"] == pytest.approx(92 / 42, abs=1e-3)
    recs[0]["call"] = "c2"
    assert ip.summarize(recs)[0]["same_call"] is False

    ip.write(str(tmp_path), recs, {}, "test")
    data = json.loads((tmp_path / "results.json").read_text())
    for field in (
        "workload",
        "num_timesteps",
        "peer",
        "peer_flags",
        "peer_default_env_steps_per_s",
        "peer_flags_env_steps_per_s",
        "rose_env_steps_per_s",
        "speedup_vs_informed_peer",
        "end_to_end_s",
        "spread",
        "repeats",
        "same_call",
        "search_s",
        "breakeven_env_steps",
        "plan",
        "equal",
        "max_abs_diff",
        "command",
        "date",
    ):
        assert field in data["summary"][0], field
    assert "| ppo-ant |" in (tmp_path / "results.md").read_text()
    assert os.path.getsize(tmp_path / "results.png") > 1000


@pytest.mark.slow
def test_equality_child_compares_the_kept_options_with_the_default_build(tmp_path):
    """The child that checks the kept option set: the rose-jax unit of the workload's command built
    twice (here both XLA's defaults on a CPU), two units from one state, compared bitwise."""
    argv = ip.rose_argv(ip.workloads()["smoke"], 64, smoke=True)
    out = tmp_path / "equal.json"
    assert ip.child_equal(argv, {}, str(out)) == 0
    data = json.loads(out.read_text())
    assert data["equal"] is True and data["max_abs_diff"] == 0.0 and data["units"] == 2


@pytest.mark.slow
def test_plan_only_run_caches_the_plan_the_cached_run_then_trains_with(tmp_path):
    """Real `rose-jax train` children: the ``rose_optimize_plan`` run (`--optimize --plan-only`)
    searches and caches a plan and trains nothing; the ``rose_optimize_cached`` run on the same
    plan cache hits it and trains."""
    caches = {"compile": str(tmp_path / "compile"), "plans": str(tmp_path / "plans")}
    steps = ip.workloads()["smoke"]["steps"]
    first = ip.rose_run("smoke", "rose_optimize_plan", steps, True, caches, 600.0, ("--optimize-budget", "0"))
    assert first["returncode"] == 0, first["error"]
    assert "--plan-only" in first["command"] and first["rows"] == 0 and first["env_steps"] is None
    data = json.loads((tmp_path / "plans" / "plans.json").read_text())
    (entry,) = [e for e in data.values() if "plan" in e]
    budget = ("--optimize-budget", "none")
    second = ip.rose_run("smoke", "rose_optimize_cached", steps, True, caches, 600.0, budget)
    assert second["returncode"] == 0, second["error"]
    assert second["optimize"]["cache_hit"] is True and second["optimize"]["plan"] == entry["plan"]
    assert second["finished"] and second["env_steps"] >= steps  # whole epochs (Brax rounds up)


def test_run_streams_the_log_and_keeps_it_on_timeout(tmp_path):
    """A real child process: its output lands in the log as written, and a child cut by the
    timeout leaves what it printed, with the timeout as the last line."""
    import sys

    from benchmarks.experiments import informed_peer as ip

    log = str(tmp_path / "logs" / "ok.log")
    rc, out, err, _ = ip._run([sys.executable, "-c", "import sys; print('a'); print('b', file=sys.stderr)"],
                              {}, 30.0, log)
    assert rc == 0 and "a" in open(log).read() and "b" in out
    log = str(tmp_path / "logs" / "cut.log")
    code = "import time; print('started', flush=True); time.sleep(30)"
    rc, out, err, wall = ip._run([sys.executable, "-c", code], {}, 2.0, log)
    assert rc is None and wall < 20 and "started" in open(log).read()
    assert err.strip().splitlines()[-1] == "timed out after 2s"


_GRANDCHILD = (  # a wrapper whose child (the trainer of `train --mps-client`) does the work
    "import subprocess, sys; subprocess.call([sys.executable, '-c', "
    "\"import os, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)\", sys.argv[1]])"
)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc (Linux)")
def test_run_timeout_ends_the_grandchild_too(tmp_path, monkeypatch):
    """A timeout ends the whole process group: the grandchild of a wrapper (as with
    ``rose-jax train --mps-client``) does not train on beside the next variant. Real processes."""
    import sys
    import time

    monkeypatch.setattr(ip, "KILL_GRACE_S", 2.0)
    pid_file = tmp_path / "grandchild.pid"
    code = _GRANDCHILD.replace("sys.argv[1]", repr(str(pid_file)))
    rc, _, err, wall = ip._run([sys.executable, "-c", code], dict(os.environ), 3.0, str(tmp_path / "g.log"))
    assert rc is None and "timed out after 3s" in err and wall < 30
    for _ in range(50):  # the grandchild wrote its pid before the timeout (it starts in < 3 s)
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    assert wait_gone(int(pid_file.read_text())), "the grandchild outlived the timeout"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc (Linux)")
def test_a_harness_stopped_by_sigterm_ends_its_runs_session(tmp_path):
    """The harness stopped while a run goes on (a call's limit: GNU timeout signals the harness's
    group, which the run's own session is not in): ``sigterm_exits`` unwinds through ``_run``,
    which ends the run's whole group, the wrapper's child included. Real processes."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "grandchild.pid"
    code = _GRANDCHILD.replace("sys.argv[1]", repr(str(pid_file)))
    log = str(tmp_path / "h.log")
    harness = (
        "import os, sys\n"
        "from benchmarks.experiments import informed_peer as ip\n"
        "with ip.sigterm_exits():\n"
        f"    ip._run([sys.executable, '-c', {code!r}], dict(os.environ), 120.0, {log!r})\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", harness], env=env)
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert wait_gone(grandchild), "the run's grandchild outlived the harness"
    finally:
        proc.kill()


def test_published_epochs_keep_brax_s_epoch_size():
    """sac-hopper-5ep: five epochs of the published run's size by Brax's own rounding (and our
    config's, which follows it), evaluation count cut instead of the epoch."""
    import envs
    from algos import presets, sac

    kw = presets.published("sac", "hopper")

    def brax_epoch(k):  # brax/training/agents/sac/train.py's num_training_steps_per_epoch
        prefill = -(-k["min_replay_size"] // k["num_envs"]) * k["num_envs"]
        return -(-(k["num_timesteps"] - prefill) // (max(k["num_evals"] - 1, 1) * k["num_envs"]))

    short = ip.published_epochs(kw, 5)
    assert short["num_evals"] == 6 and brax_epoch(short) == brax_epoch(kw) == 2692
    assert short["num_timesteps"] == 8192 + 5 * 2692 * 128
    config, _ = presets.brax_run("sac", short)
    cfg = presets.make_config("sac", "brax", envs.make("pendulum"), **config)  # train's --preset brax
    assert cfg.num_epochs == 5 and sac.iterations_per_epoch(cfg) == 2692
    w = ip.workloads()["sac-hopper-5ep"]
    assert w["kwargs"] == short and w["acceptance_steps"] == short["num_timesteps"]
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        ip.published_epochs(kw, 0)


@pytest.mark.parametrize("env,per_epoch", [("ant", 17), ("reacher", 2)])
def test_ppo_published_epochs_keep_brax_s_epoch_size(env, per_epoch):
    """ppo-{ant,reacher}-6ep: six epochs of the published run's size by Brax's PPO rounding (and
    our config's, which follows it, through `rose-jax train`'s own arguments), where the 20M rows'
    shorter epochs (ant 7 training steps, reacher 1) make the evaluation's share larger."""
    from algos import presets
    from rose_jax import cli

    kw = presets.published("ppo", env)

    def brax_epoch(k):  # brax/training/agents/ppo/train.py's num_training_steps_per_epoch
        step = k["batch_size"] * k["unroll_length"] * k["num_minibatches"] * k["action_repeat"]
        return math.ceil(k["num_timesteps"] / (max(k["num_evals"] - 1, 1) * step))

    short = ip.published_epochs(kw, 6, "ppo")
    assert short["num_evals"] == 7 and brax_epoch(short) == brax_epoch(kw) == per_epoch
    assert brax_epoch(dict(kw, num_timesteps=20_000_000)) < per_epoch  # the 20M rows' shorter epochs
    assert {k: v for k, v in short.items() if k not in ("num_evals", "num_timesteps")} == {
        k: v for k, v in kw.items() if k not in ("num_evals", "num_timesteps")}
    w = ip.workloads()[f"ppo-{env}-6ep"]
    assert w["kwargs"] == short and w["acceptance_steps"] == w["steps"] == short["num_timesteps"]
    job = cli.train_job(ip.rose_argv(w, w["acceptance_steps"], False))
    assert job.config.num_evals == 7 and job.config.iterations_per_eval == per_epoch
    assert job.config.num_iterations == 6 * per_epoch
    with pytest.raises(ValueError, match="algo must be 'sac' or 'ppo'"):
        ip.published_epochs(kw, 5, "ddpg")


def test_sac_hopper_5ep_through_rose_jax_train_s_own_arguments():
    """The row's `rose-jax train` arguments build the published epoch five times over (the user's
    path: argv -> job -> config), and `--optimize` searches 128 of its 2,692 iterations and 48 of its
    evaluation's 1,000 steps."""
    from algos import sac
    from rose_jax import cli

    w = ip.workloads()["sac-hopper-5ep"]
    job = cli.train_job(ip.rose_argv(w, w["acceptance_steps"], False))
    assert (job.config.num_epochs, sac.iterations_per_epoch(job.config)) == (5, 2692)
    assert job.config.replay_capacity == 1048576 and job.config.initial_eval
    unit = job.algo.search_unit(job.config, job.env)
    assert (unit.iterations, unit.of) == (128, 2692) and job.algo.num_units(job.config) == 5
    assert (unit.eval_steps, unit.eval_of) == (48, 1000)  # the evaluation scaled alike


@pytest.mark.parametrize("name, unit", [
    ("ppo-ant-6ep", (4, 17, 236, 1000)),  # 4 of 17 iterations, the evaluation scaled alike
    ("ppo-ant", (4, 7, 572, 1000)),  # the 20M rows' shorter epochs
    # 2 iterations of 1.6M env steps (action repeat 4): a 1-iteration unit would not be its loop
    ("ppo-reacher-6ep", None),
    ("smoke", None),  # no num_evals: the unit is the iteration, searched as it is
])
def test_ppo_rows_search_unit_through_rose_jax_train_s_own_arguments(name, unit):
    """`rose-jax train --optimize` on the PPO rows' arguments searches a scaled epoch where the
    published epoch is long (algos.ppo.search_unit: about SEARCH_UNIT_ENV_STEPS of training), the
    evaluation shortened by the same factor, and the unit itself where it is short."""
    from rose_jax import cli

    w = ip.workloads()[name]
    job = cli.train_job(ip.rose_argv(w, w.get("acceptance_steps", w["steps"]), False))
    got = job.algo.search_unit(job.config, job.env)
    assert (None if got is None else (got.iterations, got.of, got.eval_steps, got.eval_of)) == unit
