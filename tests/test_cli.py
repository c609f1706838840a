"""The rose-jax command line, run for real in-process on tiny settings."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rose_jax import cli
from rose_jax.optimize import search


def test_train_writes_metrics_and_curve(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = cli.main(
        [
            "train",
            "--env",
            "cartpole",
            "--algo",
            "ppo",
            "--steps",
            "8192",
            "--run-dir",
            str(run_dir),
            "--set",
            "num_envs=16",
            "--set",
            "unroll_length=32",
            "--set",
            "num_minibatches=4",
        ]
    )
    assert rc == 0
    history = json.loads((run_dir / "metrics.json").read_text())
    assert history and history[-1]["env_steps"] >= 8192
    assert all("episode_return" in row for row in history)
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert "done:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--env", "nope"], "unknown env 'nope'"),
        (["train", "--env", "cartpole", "--steps", "-5"], "--steps must be > 0"),
        (["train", "--env", "cartpole", "--set", "num_minibatches=7", "--steps", "1000"], "num_minibatches"),
        (["train", "--env", "cartpole", "--set", "bogus=1", "--steps", "1000"], "bogus"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--run-dir", str(tmp_path / "r")])
    text = str(e.value)
    assert message in text and "\n" not in text


def test_inspect_prints_the_loop_tree(tmp_path, capsys):
    out = tmp_path / "tree.json"
    rc = cli.main(
        [
            "inspect",
            "--env",
            "pendulum",
            "--algo",
            "ppo",
            "--set",
            "num_envs=8",
            "--set",
            "unroll_length=4",
            "--set",
            "num_minibatches=2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("rollout", "policy", "sim", "advantage", "update", "loss", "optimizer"):
        assert name in text
    assert "x4" in text  # the rollout scan's trip count = unroll_length
    assert json.loads(out.read_text())["root"]["kind"] == "root"


def test_profile_says_no_gpu_on_cpu():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU message")
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--env", "pendulum", "--algo", "ppo"])
    assert "GPU" in str(e.value) or "NVML" in str(e.value)


def test_envs_lists_registry(capsys):
    assert cli.main(["envs"]) == 0
    names = capsys.readouterr().out.split()
    assert {"cartpole", "pendulum", "point_mass", "ant"} <= set(names)


@pytest.mark.slow
def test_train_optimize_searches_once_then_uses_the_cached_plan(tmp_path, capsys, monkeypatch):
    """`train --optimize` runs the real plan search (baseline vs candidates, equality checked for
    those that won on time: the run pays for the search), caches the plan, and a second run applies
    the cached plan without measuring; both train the same. The search's baseline is timed under
    the --xla-options sets first (on a CPU the GPU sets are none: a CPU-valid one through the
    variable), and the plan's report records which build it kept."""
    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.setenv("ROSE_JAX_XLA_OPTION_SETS", '{"o1": {"xla_backend_optimization_level": 1}}')
    argv = ["train", "--env", "pendulum", "--algo", "ppo", "--optimize", "--optimize-budget", "none",
            "--steps", "2048", "--set", "num_envs=16", "--set", "unroll_length=8",
            "--set", "num_minibatches=2"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out
    assert "CACHE HIT" not in first and "candidate" in first
    assert (tmp_path / "plans" / "plans.json").exists()
    cached = json.loads((tmp_path / "plans" / "plans.json").read_text())
    (entry,) = [e for e in cached.values() if "plan" in e]
    base = entry["report"]["base_options"]
    assert base["name"] in ("default", "o1") and set(base["ms_per_iter"]) == {"default", "o1"}
    assert "XLA options of the baseline and every candidate" in first
    measured = [c for c in entry["report"]["candidates"] if c.get("speedup") is not None]
    assert measured and all(c["equal"] is not None for c in measured if c["kept"])
    # a single candidate is compared only when it won on time (combinations of kept ones always are)
    alone = [c for c in measured if c["stage"] != "combine"]
    assert alone and all(c["speedup"] > 1.0 for c in alone if c["equal"] is not None)
    assert cli.main([*argv, "--run-dir", str(tmp_path / "b")]) == 0
    second = capsys.readouterr().out
    assert "CACHE HIT" in second
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert [r["env_steps"] for r in a] == [r["env_steps"] for r in b]
    assert a[-1]["policy_loss"] == b[-1]["policy_loss"]
    # run.json says which plan trained each run: the search's, then the cache's same plan
    ra = json.loads((tmp_path / "a" / "run.json").read_text())["optimize"]
    rb = json.loads((tmp_path / "b" / "run.json").read_text())["optimize"]
    assert ra["cache_hit"] is False and rb["cache_hit"] is True and ra["plan"] == rb["plan"] == entry["plan"]
    assert ra["base_options"] == base["name"] and ra["defers_metrics"] is False
    (key,) = [k for k, e in cached.items() if "plan" in e]
    assert ra["cache_key"] == rb["cache_key"] == key  # which entry: a harness reads that one


@pytest.mark.slow
def test_train_optimize_resumes_a_search_its_budget_stopped(tmp_path, capsys, monkeypatch):
    """`train --optimize --optimize-budget 0` caches a search stopped before its first candidate; the
    next run with a budget resumes it (no profile or option trial again: the candidates it left are
    measured, the entry rewritten, run.json says it searched); a run with `none` then hits the
    cache as is."""
    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    argv = ["train", "--env", "pendulum", "--algo", "ppo", "--optimize", "--steps", "2048",
            "--set", "num_envs=16", "--set", "unroll_length=8", "--set", "num_minibatches=2"]

    def entry():
        data = json.loads((tmp_path / "plans" / "plans.json").read_text())
        return [e for e in data.values() if "plan" in e]

    assert cli.main([*argv, "--optimize-budget", "0", "--run-dir", str(tmp_path / "a")]) == 0
    (first,) = entry()
    pending = [c for c in first["report"]["candidates"] if c["reason"] == search.BUDGET_SPENT]
    assert pending and len(pending) == len(first["report"]["candidates"])
    logged = "s] windows='profile' but no SM activity"  # the search's log line (its report repeats it)
    assert logged in capsys.readouterr().out  # the first search profiled (on a CPU: says why not)
    assert cli.main([*argv, "--optimize-budget", "600", "--run-dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "resuming the cached search" in out and "CACHE HIT" not in out
    assert logged not in out  # no profile (its windows are the first search's)
    (second,) = entry()
    assert second["report"]["notes"][0].startswith("search resumed on a cache hit")
    # the candidates the first run left were measured, refused or analysed this time
    assert not [c for c in second["report"]["candidates"] if c["reason"] == search.BUDGET_SPENT]
    assert json.loads((tmp_path / "b" / "run.json").read_text())["optimize"]["cache_hit"] is False
    assert cli.main([*argv, "--optimize-budget", "none", "--run-dir", str(tmp_path / "c")]) == 0
    assert "CACHE HIT" in capsys.readouterr().out
    assert json.loads((tmp_path / "c" / "run.json").read_text())["optimize"]["plan"] == second["plan"]


def test_train_plan_only_caches_the_plan_and_trains_nothing(tmp_path, capsys, monkeypatch):
    """`train --optimize --plan-only` runs the search on the state training starts from, caches its
    plan and stops: no run directory, no training; the same command without --plan-only then
    trains with the cached plan (a cache hit, run.json says so)."""
    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--env", "pendulum", "--algo", "ppo", "--optimize", "--steps", "2048",
            "--set", "num_envs=16", "--set", "unroll_length=8", "--set", "num_minibatches=2"]
    assert cli.main([*argv, "--optimize-budget", "0", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "--plan-only: plan" in out and "cached in" in out and "rose-jax train: ppo" not in out
    assert not (tmp_path / "runs").exists()  # no run directory
    data = json.loads((tmp_path / "plans" / "plans.json").read_text())
    (entry,) = [e for e in data.values() if "plan" in e]
    (key,) = [k for k, e in data.items() if "plan" in e]
    assert f"{cli.PLAN_KEY_LINE}{key}\n" in out  # which entry (no run.json): what a harness reads
    from benchmarks.experiments import informed_peer

    assert informed_peer._plan_key(out) == {"cache_key": key} and informed_peer._plan_key("x") is None
    # the budget stopped it before its first candidate: the pending ones are in the cache
    assert any(c["reason"] == search.BUDGET_SPENT for c in entry["report"]["candidates"])
    assert cli.main([*argv, "--optimize-budget", "none", "--run-dir", str(tmp_path / "b")]) == 0
    assert "CACHE HIT" in capsys.readouterr().out
    record = json.loads((tmp_path / "b" / "run.json").read_text())["optimize"]
    assert record["cache_hit"] is True and record["plan"] == entry["plan"]
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())[-1]["env_steps"] == 2048


@pytest.mark.parametrize(
    "extra, says",
    [([], "--plan-only needs --optimize"),
     (["--optimize", "--run-dir", "x"], "--plan-only writes no run directory")],
)
def test_train_plan_only_bad_arguments_are_one_line(tmp_path, monkeypatch, extra, says):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--env", "pendulum", "--plan-only", *extra])
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_train_optimize_searches_a_long_sac_epoch_on_a_shorter_one(tmp_path, capsys, monkeypatch):
    """`train --optimize` on SAC epochs longer than sac.SEARCH_UNIT_GRAD_STEPS gradient steps (made
    small here: a module knob, not a mock) searches the epoch with fewer iterations (the cached
    entry is that program's), trains whole epochs (the run's own length), and says so in its log
    and run.json; a second run hits the cache and trains the same; the default budget counts the
    run as one searched unit per epoch (a lower bound), so this short run's share skips the search."""
    import jax

    import envs
    from algos import sac
    from rose_jax.optimize import cache

    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.setattr(sac, "SEARCH_UNIT_GRAD_STEPS", 16)
    argv = ["train", "--env", "pendulum", "--algo", "sac", "--optimize", "--optimize-budget", "0",
            "--steps", "1200", "--set", "num_envs=8", "--set", "grad_updates_per_step=2",
            "--set", "batch_size=32", "--set", "min_replay_size=64", "--set", "num_evals=4",
            "--set", "num_eval_envs=2", "--set", "policy_hidden_sizes=16", "--set", "q_hidden_sizes=16"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "searching on 8 of the unit's 36 iterations" in out
    data = json.loads((tmp_path / "plans" / "plans.json").read_text())
    (entry,) = [e for e in data.values() if "plan" in e]
    config = sac.SACConfig(num_timesteps=1200, num_envs=8, grad_updates_per_step=2, batch_size=32,
                           min_replay_size=64, num_evals=4, num_eval_envs=2, policy_hidden_sizes=(16,),
                           q_hidden_sizes=(16,))
    env = envs.make("pendulum")
    state = sac.init(config, env, jax.random.PRNGKey(0))
    unit = sac.search_unit(config, env)
    assert entry["report"]["fingerprint"] == cache.fingerprint(unit.fn, state)  # the shorter unit's
    assert entry["report"]["fingerprint"] != cache.fingerprint(sac.epoch(config, env), state)
    record = json.loads((tmp_path / "a" / "run.json").read_text())["optimize"]
    assert record["cache_hit"] is False
    assert any("searched on 8 of the unit's 36" in n for n in record["notes"])
    assert unit.eval_steps < unit.eval_of
    assert any(f"searched on {unit.describe()};" in n for n in record["notes"])
    assert f"searching on {unit.describe()} (the same program, scaled down)" in out
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert [r["env_steps"] for r in a][-1] >= 1200 and len(a) >= 4  # whole epochs: the run's own length
    assert cli.main([*argv, "--optimize-budget", "none", "--run-dir", str(tmp_path / "b")]) == 0
    assert "CACHE HIT" in capsys.readouterr().out
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert [r["env_steps"] for r in a] == [r["env_steps"] for r in b]
    assert a[-1]["critic_loss"] == b[-1]["critic_loss"]  # the same plan (baseline here) trains alike
    auto = [a for a in argv if a not in ("--optimize-budget", "0")]
    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans-auto"))  # no cached plan to hit
    assert cli.main([*auto, "--run-dir", str(tmp_path / "c")]) == 0
    # 4 epochs of 36 iterations, each 36 // 8 = 4 searched units (the unit is the epoch scaled down)
    assert "search skipped: the run's share for it (10% of 16 units" in capsys.readouterr().out


def test_a_plan_that_fails_on_the_whole_unit_falls_back_to_the_unit():
    """cli._first_call_falls_back with stand-in steps (a unit test of the wrapper alone; the real
    path is the test above): a plan whose first call raises is replaced by the baseline from that
    call on, with one line; one that runs is kept and the baseline never called."""
    lines, calls = [], []

    def failing(state):
        calls.append("plan")
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 21x the buffer\ndetail")

    def baseline(state):
        calls.append("base")
        return state + 1, {}

    step = cli._first_call_falls_back(failing, baseline, lines.append)
    assert step(1)[0] == 2 and step(2)[0] == 3 and calls == ["plan", "base", "base"]
    assert len(lines) == 1 and "the plan failed on the whole unit (RESOURCE_EXHAUSTED" in lines[0]
    calls.clear()
    kept = cli._first_call_falls_back(lambda s: (s * 10, {}), baseline, lines.append)
    assert kept(2)[0] == 20 and kept(3)[0] == 30 and calls == [] and len(lines) == 1


def test_train_optimize_on_a_run_too_short_for_a_search_trains_as_without(tmp_path, capsys, monkeypatch):
    """`train --optimize` with the default budget on a run whose tenth is under MIN_SEARCH_UNITS
    units skips the search (one line says why) and runs the option trial of a plain `train` (on a
    CPU the GPU sets are none: a CPU-valid one through the variable); no plan is cached (the
    trial's decision is, as without --optimize)."""
    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.setenv("ROSE_JAX_XLA_OPTION_SETS", '{"o1": {"xla_backend_optimization_level": 1}}')
    from rose_jax.optimize import xla_options

    made, real = [], xla_options.trial_maker

    def spy(unit_fn, units, sets, **kw):  # records the sets the fallback's trial was made with
        made.append(sets)
        return real(unit_fn, units, sets, **kw)

    monkeypatch.setattr(xla_options, "trial_maker", spy)
    argv = ["train", "--env", "pendulum", "--algo", "ppo", "--optimize", "--steps", "8192",
            "--set", "num_envs=16", "--set", "unroll_length=8", "--set", "num_minibatches=2",
            "--run-dir", str(tmp_path / "a")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "--optimize: search skipped" in out and "training as without --optimize" in out
    assert "candidate  " not in out  # no plan table
    # the step is the option trial's (whether it decides before this short run ends depends on
    # its background compile: its own tests check the decision)
    assert made and set(made[0]) == {"o1"}
    run_info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run_info["optimize"]["skipped"].startswith("search skipped") and run_info["optimize"]["plan"] == []
    plans = tmp_path / "plans" / "plans.json"  # at most the trial's decision, never a searched plan
    assert not plans.exists() or not [e for e in json.loads(plans.read_text()).values() if "plan" in e]


def test_optimize_budget_bad_value_is_one_line(tmp_path, capsys):
    argv = ["train", "--env", "pendulum", "--optimize", "--optimize-budget", "soon",
            "--run-dir", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert "--optimize-budget must be auto, none or seconds" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


PPO_KEYS = "valid keys: num_timesteps, num_envs"


@pytest.mark.parametrize(
    "command, sets, message",
    [
        ("train", ["nosuchkey=3"], "unknown key 'nosuchkey'"),
        ("train", ["learning_rat=1e-3"], "did you mean 'learning_rate'"),
        ("train", ["normalize_observations=maybe"], "expected true or false"),
        ("train", ["num_envs=1.5"], "expected an integer"),
        ("train", ["num_envs"], "--set expects key=value"),
        ("train", ["num_envs=0"], "num_envs must be a positive int"),
        ("inspect", ["nosuchkey=3"], "unknown key 'nosuchkey'"),
        ("inspect", ["num_envs=0"], "num_envs must be a positive int"),
        ("profile", ["nosuchkey=3"], "unknown key 'nosuchkey'"),
    ],
)
def test_each_bad_set_is_one_line_and_creates_no_directory(command, sets, message, tmp_path, monkeypatch,
                                                            capsys):
    monkeypatch.chdir(tmp_path)
    argv = [command, "--env", "pendulum"] + [x for item in sets for x in ("--set", item)]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    text = str(e.value)
    assert message in text and "\n" not in text, text
    if "unknown key" in message or "expects" in message:
        assert PPO_KEYS in text  # the valid keys are listed
    assert not list(tmp_path.iterdir())  # no runs/<algo>-<env>-<time>/ left behind
    assert "rose-jax train:" not in capsys.readouterr().out  # no start line, no progress bar


def test_sac_replay_smaller_than_one_env_step_is_rejected(tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--env", "pendulum", "--algo", "sac", "--set", "max_replay_size=10",
                  "--run-dir", str(tmp_path / "r")])
    assert "max_replay_size" in str(e.value) and "num_envs=128" in str(e.value)
    assert not (tmp_path / "r").exists()


def test_numbers_seed_and_flags(tmp_path, capsys):
    """--steps 1e5-style numbers, --set seed=3 (once a 'multiple values' TypeError), and the
    flags that must be explained rather than silently mean something else."""
    from algos import get

    parsed = get("ppo").parse_overrides(["num_timesteps=1e5", "seed=3"])
    assert parsed == {"num_timesteps": 100_000, "seed": 3}
    args = cli.build_parser().parse_args(["train", "--steps", "1e5", "--keep-checkpoints", "2"])
    assert args.steps == 100_000 and args.keep_checkpoints == 2
    base = ["train", "--env", "pendulum", "--steps", "256", "--set", "num_envs=8", "--set", "unroll_length=8",
            "--set", "num_minibatches=2"]
    job = cli._train_job(cli.build_parser().parse_args([*base, "--set", "seed=3"]), None)
    assert job.config.seed == 3 and job.config.num_timesteps == 256
    for extra, message in (
        (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
        (["--seed", "1", "--set", "seed=2"], "disagree"),
        (["--steps", "1e5", "--set", "num_timesteps=5"], "disagree"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main([*base, *extra, "--run-dir", str(tmp_path / "x")])
        assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as e:  # argparse errors are one line too
        cli.main(["train", "--steps", "lots"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "expected an integer" in err and "\n" not in err


def test_help_shows_defaults_and_the_valid_set_keys(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 400000 on CPU" in text and "(default: 3)" in text
    assert "ppo: num_timesteps=1000000, num_envs=64" in text
    assert "sac:" in text and "max_replay_size=none" in text


def test_envs_explains_envs_that_need_arguments(capsys):
    assert cli.main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "mjcf" in out and "--env-arg xml=" in out
    with pytest.raises(SystemExit) as e:  # the CLI can build it, and says how
        cli.main(["inspect", "--env", "mjcf"])
    assert "--env-arg KEY=VALUE" in str(e.value) and "\n" not in str(e.value)


def test_curve_ticks_and_nan_returns(tmp_path):
    from rose_jax import rundir

    assert rundir.format_return(float("nan")) == "—" and rundir.format_return(-3.14159) == "-3.1"
    rows = [{"env_steps": 400_000 * i // 50, "episode_return": float(i) if i > 3 else float("nan")}
            for i in range(1, 51)]
    rundir.plot_curve(rows, str(tmp_path / "c.png"), "t")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots()
    ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
    assert ax.xaxis.get_major_formatter()(400_000, 0) == "400k"  # short labels, no overlap
    plt.close(fig)
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_inspect_png_widths_follow_cost_and_stay_bounded(tmp_path):
    import jax

    import algos
    import envs
    from rose_jax import trace as rtrace
    from rose_jax.trace import render

    algo = algos.get("ppo")
    env = envs.make("pendulum")
    config = algo.make_config(num_envs=8, unroll_length=4, num_minibatches=2)
    state = jax.eval_shape(lambda k: algo.init(config, env, k), jax.random.PRNGKey(0))
    tree = rtrace.trace(algo.iteration(config, env), state, arg_names=("train_state",))
    boxes = render._layout(tree.root, None)
    by_name = {b[0].name: b for b in boxes if hasattr(b[0], "name")}
    update, rollout = by_name["update"], by_name["rollout"]
    ratio_w = update[3] / rollout[3]
    ratio_cost = update[0].cost.flops / rollout[0].cost.flops
    assert ratio_w == pytest.approx(ratio_cost, rel=0.05)  # widths are cost shares, not leaf counts
    out = rtrace.plot_tree(tree, tmp_path / "t.png")
    from PIL import Image

    assert Image.open(out).size[0] <= 2200


def test_workers_need_no_main_guard(tmp_path):
    """A script that starts workers at its top level, without `if __name__ == "__main__":`, runs its
    top level once (spawn's default preparation re-runs it in every worker, which then dies while
    starting)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(
        """
        import os
        import numpy as np
        from rose_jax.mps.plan import WorkerSpec
        from rose_jax.runtime import start_workers

        with open(os.environ["TOP_LOG"], "a") as f:
            f.write("top\\n")
        with start_workers([WorkerSpec("w", env={"JAX_PLATFORMS": "cpu"})]) as pool:
            out = pool.call("w", "rose_jax.runtime.probes:scale", np.arange(3, dtype=np.float32),
                            static={"factor": 2.0})
        print("result", out.tolist())
        """
    ))
    env = {**os.environ, "TOP_LOG": str(tmp_path / "top.log"), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "result [0.0, 2.0, 4.0]" in proc.stdout
    assert (tmp_path / "top.log").read_text() == "top\n"  # the workers did not re-run the script


def test_train_mps_client_without_mps_is_one_clear_line(tmp_path):
    """``--mps-client`` where no MPS daemon can start (this CPU machine: no nvidia-cuda-mps-control
    or no GPU): one line naming the flag and why, nothing trained."""
    from rose_jax.mps import mps_status

    ok, _ = mps_status()
    if ok:
        pytest.skip("MPS is available here: the real path is test_train_mps_client_on_the_gpu")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--env", "cartpole", "--steps", "1000", "--mps-client",
                  "--run-dir", str(tmp_path / "r")])
    assert "--mps-client: MPS unavailable" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_train_mps_client_runs_the_same_command_as_a_client(monkeypatch):
    """Mock of the MPS daemon (this unit test's stand-in; the real daemon runs in
    test_train_mps_client_on_the_gpu): the same command line runs again in a child, whose marked
    environment makes it train instead of starting another daemon."""
    from rose_jax import mps
    from rose_jax.mps.client import CLIENT_MARK

    seen = []
    monkeypatch.setattr(mps, "mps_status", lambda: (True, "MPS available (mock)"))
    monkeypatch.setattr(mps, "run_as_client", lambda argv, log=print: seen.append(argv) or 7)
    monkeypatch.delenv(CLIENT_MARK, raising=False)
    argv = ["train", "--env", "cartpole", "--steps", "1000", "--mps-client"]
    assert cli.main(argv) == 7
    assert seen == [[sys.executable, "-m", "rose_jax.cli", *argv]]


def test_train_mps_client_on_the_gpu(tmp_path):
    """The real path: a short PPO run as the client of a real MPS daemon finishes and writes its
    metrics (GPU machines with MPS only)."""
    from rose_jax.mps import mps_status

    ok, reason = mps_status()
    if not ok:
        pytest.skip(f"needs an MPS daemon on an NVIDIA GPU: {reason}")
    run_dir = tmp_path / "run"
    rc = subprocess.run(
        [sys.executable, "-m", "rose_jax.cli", "train", "--env", "cartpole", "--steps", "8192",
         "--mps-client", "--run-dir", str(run_dir), "--set", "num_envs=16", "--set", "unroll_length=32",
         "--set", "num_minibatches=4", "--no-tensorboard"],
        capture_output=True, text=True, timeout=600,
    )
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert "[mps] daemon up" in rc.stdout
    assert json.loads((run_dir / "metrics.json").read_text())[-1]["env_steps"] >= 8192


def test_train_mps_client_sigterm_stops_trainer_and_daemon_on_the_gpu(tmp_path):
    """The real path of a harness's timeout or a scheduler's SIGTERM: SIGTERM to ``train
    --mps-client`` (the wrapper) ends its trainer child and stops its MPS daemon, leaving neither
    running on the GPU (GPU machines with MPS only)."""
    import signal
    import time

    import psutil

    from rose_jax.mps import mps_status
    from rose_jax.mps.daemon import PID_FILE

    ok, reason = mps_status()
    if not ok:
        pytest.skip(f"needs an MPS daemon on an NVIDIA GPU: {reason}")
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "rose_jax.cli", "train", "--env", "cartpole", "--steps", "100000000",
         "--mps-client", "--run-dir", str(tmp_path / "run"), "--no-tensorboard"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        pipe_dir = control = None
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # the daemon's pipe dir, then the trainer's first line
            if "[mps] daemon up (" in line:
                pipe_dir = Path(line.split("[mps] daemon up (", 1)[1].split(")", 1)[0])
                control = int((pipe_dir / PID_FILE).read_text().split()[0])
            if line.startswith("rose-jax train:") or time.monotonic() > deadline:
                break
        assert pipe_dir is not None and control is not None, "the daemon did not come up"
        trainers = [p.pid for p in psutil.Process(proc.pid).children()]
        assert trainers, "no trainer child under the wrapper"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        for pid in [*trainers, control]:
            alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            assert not alive, f"process {pid} outlived the wrapper's SIGTERM"
        assert not pipe_dir.exists(), "the daemon's directories were left behind"
    finally:
        proc.kill()
