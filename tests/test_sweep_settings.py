"""algos.sweep.train_many(settings=...): per-run values of data fields vmapped as data (CPU).

One group per algorithm (a module fixture, one compile each) holds: run 0 with base values of
every ``DATA_FIELDS`` entry, one run per field with only that field changed (same seed), and two
or three "mixed" runs (several fields and the seed differing). The mixed runs are compared with
solo runs of their configs within test_sweep.py's tolerance (rtol 1e-5 / atol 1e-6: batched vs
unbatched summation order, and scalars folded in float64 as constants vs float32 data); the
one-field runs show that every field changes the result. A second group with other values must
reuse the compiled program (no trace, an lru_cache hit).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

import envs
from algos import checkpoint, driver, ppo, sac, sweep
from test_sweep import _assert_close_rows, _assert_close_trees

CARTPOLE = envs.make("cartpole")  # one object each: the jitted programs are cached per env
PENDULUM = envs.make("pendulum", episode_length=20)

PPO_CONFIG = ppo.PPOConfig(num_timesteps=16 * 3, num_envs=4, unroll_length=4, num_minibatches=2,
                           num_epochs=1, policy_hidden_sizes=(8,), value_hidden_sizes=(8,))
SAC_CONFIG = sac.SACConfig(num_timesteps=16 + 8 * 6, num_envs=8, grad_updates_per_step=1, batch_size=16,
                           min_replay_size=16, policy_hidden_sizes=(8,), q_hidden_sizes=(8,), num_evals=2,
                           num_eval_envs=0)  # 2 epochs of 3 iterations

# (base value, changed value) of every data field; the changed value must change a tiny run
PPO_VALUES = {
    "learning_rate": (1e-3, 3e-2),
    "discounting": (0.99, 0.5),
    "gae_lambda": (0.95, 0.3),
    "clipping_epsilon": (0.2, 1e-6),  # ratios move off 1 from the 2nd minibatch on: clipped
    "entropy_cost": (1e-3, 0.5),
    "value_cost": (0.5, 2.0),
    "reward_scaling": (0.1, 2.0),
    "max_grad_norm": (1.0, 1e-3),
}
PPO_MIXED = [  # (seed, values): the brief's group of lr / entropy cost / discount
    (0, {"learning_rate": 3e-3, "entropy_cost": 0.0, "discounting": 0.9}),
    (1, {"learning_rate": 1e-2, "entropy_cost": 0.05, "discounting": 0.97}),
    (0, {"learning_rate": 5e-4, "entropy_cost": 0.01, "discounting": 0.8}),
]
SAC_VALUES = {
    "learning_rate": (3e-4, 3e-2),
    "critic_learning_rate": (3e-4, 3e-2),
    "alpha_learning_rate": (3e-4, 3e-2),
    "discounting": (0.99, 0.5),
    "tau": (0.005, 0.5),
    "reward_scaling": (1.0, 5.0),
    "target_entropy": (-1.0, 5.0),
}
SAC_MIXED = [(0, {"learning_rate": 1e-3, "tau": 0.01}), (1, {"learning_rate": 3e-3, "tau": 0.1})]

ALGOS = {  # name -> (module, env, config, data field values, mixed runs)
    "ppo": (ppo, CARTPOLE, PPO_CONFIG, PPO_VALUES, PPO_MIXED),
    "sac": (sac, PENDULUM, SAC_CONFIG, SAC_VALUES, SAC_MIXED),
}


def _group(algo: str):
    """(seeds, settings) of an algorithm's group: base, one run per field, the mixed runs."""
    _, _, _, values, mixed = ALGOS[algo]
    base = {f: v[0] for f, v in values.items()}
    seeds = [0] + [0] * len(values) + [s for s, _ in mixed]
    settings = [base] + [{**base, f: v[1]} for f, v in values.items()] + [{**base, **m} for _, m in mixed]
    return seeds, settings


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    out = {}
    for algo, (_, env, config, _, _) in ALGOS.items():
        seeds, settings = _group(algo)
        root = tmp_path_factory.mktemp(f"group-{algo}")
        dirs = [os.path.join(root, f"run-{i}") for i in range(len(seeds))]
        out[algo] = sweep.train_many(config, env, seeds, settings=settings, run_dirs=dirs)
    return out


def test_data_fields_are_declared_by_each_algorithm():
    assert sweep.data_fields(PPO_CONFIG) == ppo.DATA_FIELDS == tuple(PPO_VALUES)
    assert sweep.data_fields(SAC_CONFIG) == sac.DATA_FIELDS == tuple(SAC_VALUES)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_a_group_equals_solo_runs_of_its_configs(groups, algo):
    module, env, config, values, mixed = ALGOS[algo]
    result = groups[algo]
    first = 1 + len(values)
    for i in range(first, first + len(mixed)):
        seed, settings = result.seeds[i], result.settings[i]
        solo_config = dataclasses.replace(config, seed=seed, **settings)
        solo_state, solo_rows = module.train_with_config(solo_config, env)
        what = f"{algo} run {i} {settings}"
        _assert_close_trees(result.seed_state(i), solo_state, f"{what} state")
        _assert_close_rows(result.metrics[i], solo_rows, f"{what} metrics")
        # its run directory is a solo run's of that config: run.json's config, record, checkpoint
        d = result.run_dirs[i]
        stored = json.loads(Path(d, "run.json").read_text())["config"]
        assert stored == json.loads(json.dumps(dataclasses.asdict(solo_config))), what
        _assert_close_rows(sweep.read_metrics(d), solo_rows, f"{what} record")
        assert sweep.read_summary(d)["status"] == "finished"
        restored, _ = checkpoint.restore(os.path.join(d, "checkpoints"), solo_state)
        _assert_close_trees(restored, solo_state, f"{what} checkpoint")


@pytest.mark.slow
def test_a_stopped_group_resumes_and_its_checkpoints_resume_solo_runs(groups, tmp_path):
    """Stopped after the first iteration: the group resumes to the uninterrupted group's result,
    and a run's checkpoint resumes a solo run of its config to the uninterrupted solo result (the
    programs were compiled by the tests above)."""
    import shutil

    seeds, settings = _group("ppo")
    dirs = [str(tmp_path / f"run-{i}") for i in range(len(seeds))]

    def stop_at_16(env_steps, rows):
        if env_steps == 16:
            raise driver.StopTraining

    stopped = sweep.train_many(PPO_CONFIG, CARTPOLE, seeds, settings=settings, run_dirs=dirs,
                               progress_fn=stop_at_16)
    assert stopped.stopped
    i = len(seeds) - 1  # a mixed run
    solo_config = dataclasses.replace(PPO_CONFIG, seed=seeds[i], **settings[i])
    solo_dir = str(tmp_path / "solo")
    shutil.copytree(os.path.join(dirs[i], "checkpoints"), solo_dir)
    resumed_solo, _ = ppo.train_with_config(solo_config, CARTPOLE, checkpoint_dir=solo_dir, resume=True)
    solo, _ = ppo.train_with_config(solo_config, CARTPOLE)
    _assert_close_trees(resumed_solo, solo, "solo resumed from a group run's checkpoint")
    resumed = sweep.train_many(PPO_CONFIG, CARTPOLE, seeds, settings=settings, run_dirs=dirs, resume=True)
    _assert_close_trees(resumed.state, groups["ppo"].state, "group resumed")
    assert [r["env_steps"] for r in sweep.read_metrics(dirs[i])] == [16, 32, 48]


def _params(algo, state):
    if algo == "ppo":
        return state.params
    return (state.actor_params, state.critic_params, state.target_critic_params, state.log_alpha)


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_every_data_field_changes_the_result(groups, algo):
    """Run 1 + j differs from run 0 only in field j (same seed): its parameters must differ. A
    field the program ignored (or read from the config instead of the data) would give run 0's
    parameters bitwise (identical rows of one vmapped program)."""
    values = ALGOS[algo][3]
    result = groups[algo]
    base = jax.tree.leaves(_params(algo, result.seed_state(0)))
    for j, field in enumerate(values, start=1):
        changed = jax.tree.leaves(_params(algo, result.seed_state(j)))
        assert any(not np.array_equal(a, b) for a, b in zip(base, changed, strict=True)), field


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_init_reads_no_data_field(algo):
    """The group shares one init (of the config with the fields' defaults): the init program
    must be the same for any value of every data field (the same lowered StableHLO, constants
    included), while a field that init reads changes it (the check can fail)."""
    module, env, config, values, _ = ALGOS[algo]
    key = jax.random.PRNGKey(0)

    def program(cfg):
        return jax.jit(lambda k: module.init(cfg, env, k)).lower(key).as_text()

    want = program(config)
    for field, (_, changed) in values.items():
        assert program(dataclasses.replace(config, **{field: changed})) == want, field
    read = {"num_envs": 8} if algo == "ppo" else {"init_alpha": 0.5}  # init reads these
    assert program(dataclasses.replace(config, **read)) != want


def test_other_values_reuse_the_compiled_program(groups, monkeypatch):
    """Two groups of the same fields with different values: one compile (no trace of the step,
    a hit of the compile cache)."""
    traces = []
    original = sweep.settings_config

    def counting(config, values):
        traces.append(sorted(values))
        return original(config, values)

    monkeypatch.setattr(sweep, "settings_config", counting)
    seeds, settings = _group("ppo")
    other = [{f: (v * 0.5 if f != "discounting" else v * 0.9) for f, v in s.items()} for s in settings]
    before = sweep._compiled_cached.cache_info()
    result = sweep.train_many(PPO_CONFIG, CARTPOLE, seeds, settings=other)
    after = sweep._compiled_cached.cache_info()
    assert traces == [] and after.misses == before.misses and after.hits == before.hits + 1
    # the values did reach the program: the runs differ from the first group's
    p_first = jax.tree.leaves(groups["ppo"].seed_state(0).params)[0]
    assert not np.array_equal(jax.tree.leaves(result.seed_state(0).params)[0], p_first)
    # and the counter counts: a new trace of the settings step goes through it
    state = jax.eval_shape(lambda k: ppo.init(PPO_CONFIG, CARTPOLE, k), jax.random.PRNGKey(0))
    jax.eval_shape(sweep.settings_step(PPO_CONFIG, CARTPOLE), state, {"learning_rate": np.float32(1e-3)})
    assert traces == [["learning_rate"]]


def test_a_field_that_is_not_data_is_refused_in_one_line():
    for field, value in (("num_envs", 8), ("seed", 3), ("normalize_advantage", False)):
        with pytest.raises(ValueError) as e:
            sweep.train_many(PPO_CONFIG, CARTPOLE, (0, 1), settings=[{field: value}, {field: value}])
        msg = str(e.value)
        assert "\n" not in msg and repr(field) in msg and ", ".join(ppo.DATA_FIELDS) in msg, msg
    with pytest.raises(ValueError, match="init_alpha") as e:
        sweep.train_many(SAC_CONFIG, PENDULUM, (0, 1), settings=[{"init_alpha": 0.5}, {"init_alpha": 2.0}])
    assert ", ".join(sac.DATA_FIELDS) in str(e.value)
    step = sweep.settings_step(PPO_CONFIG, CARTPOLE)  # the step refuses it too (when traced)
    state = jax.eval_shape(lambda k: ppo.init(PPO_CONFIG, CARTPOLE, k), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="'num_envs'"):
        jax.eval_shape(step, state, {"num_envs": np.float32(8)})


def test_bad_settings_give_one_line_errors_before_anything_runs(tmp_path):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    cases = [
        ([{"discounting": 0.9}, {"discounting": 1.5}],
         "PPOConfig.discounting must be a number in [0, 1], got 1.5"),  # the config's own message
        ([{"learning_rate": -1.0}, {"learning_rate": 1e-3}], "PPOConfig.learning_rate must be a positive"),
        ([{"max_grad_norm": None}, {"max_grad_norm": 1.0}], "must be a number"),  # None: a switch
        ([{"learning_rate": 1e-3}, {"entropy_cost": 0.1}], "same keys"),
        ([{"learning_rate": 1e-3}], "2 dicts"),
        ([{"learning_rate": 1e-3}, {"learning_rate": 1e-3}], "pairs must be distinct"),
        ({"learning_rate": 1e-3}, "sequence of dicts"),
    ]
    for settings, match in cases:
        with pytest.raises(ValueError) as e:
            sweep.train_many(PPO_CONFIG, CARTPOLE, (0, 0), settings=settings, run_dirs=dirs)
        assert match in str(e.value) and "\n" not in str(e.value), (settings, str(e.value))
    assert not any(os.path.exists(d) for d in dirs)
    with pytest.raises(ValueError, match="distinct"):  # without settings seeds stay distinct
        sweep.train_many(PPO_CONFIG, CARTPOLE, (0, 0))
    with pytest.raises(ValueError, match="SACConfig.tau must be in"):
        sweep.train_many(SAC_CONFIG, PENDULUM, (0, 1), settings=[{"tau": 0.0}, {"tau": 0.1}])
