"""rose_jax.trace on the real algorithms: PPO and SAC iterations (pendulum; MJX ant for speed).

States come from ``jax.eval_shape`` of ``init``, so nothing is compiled or run.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from rose_jax.trace import dependency, find, independent, trace

ppo = pytest.importorskip("algos.ppo")
sac = pytest.importorskip("algos.sac")
envs = pytest.importorskip("envs")

KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)


def kids(node):
    return [(c.kind, c.name, c.trip_count) for c in node.children]


def _paths(node, prefix):
    return {p for p in node.reads | node.writes if p.startswith(prefix)}


@pytest.fixture(scope="module")
def ppo_tree():
    env = envs.make("pendulum")
    config = ppo.PPOConfig(num_envs=8, unroll_length=6, num_minibatches=4, num_epochs=3)
    state = jax.eval_shape(lambda k: ppo.init(config, env, k), KEY)
    return trace(ppo.iteration(config, env), state, arg_names=["train_state"])


@pytest.fixture(scope="module")
def sac_tree():
    env = envs.make("pendulum")
    config = sac.SACConfig(num_envs=4, batch_size=8, grad_updates_per_step=5, policy_hidden_sizes=(16,),
                           q_hidden_sizes=(16,))
    state = jax.eval_shape(lambda k: sac.init(config, env, k, prefill=False), KEY)
    return trace(sac.iteration(config, env), state, arg_names=["train_state"])


# -------------------------------------------------------------------------------------- PPO


def test_ppo_structure(ppo_tree):
    root = ppo_tree.root
    assert kids(root) == [("component", "rollout", 1), ("component", "normalizer", 1),
                          ("component", "advantage", 1), ("component", "update", 1)]
    assert kids(find(ppo_tree, "rollout")) == [("scan", "step", 6)]
    assert kids(find(ppo_tree, "rollout/scan")) == [("component", "policy", 1), ("component", "sim", 1)]
    assert find(ppo_tree, "rollout/sim").component_path == ("rollout", "sim")
    assert kids(find(ppo_tree, "advantage")) == [("scan", "backward", 6)]
    assert kids(find(ppo_tree, "update")) == [("scan", "epoch_step", 3)]
    assert kids(find(ppo_tree, "epoch_step")) == [("scan", "minibatch_step", 4)]
    assert kids(find(ppo_tree, "minibatch_step")) == [("component", "loss", 1), ("component", "optimizer", 1)]
    assert find(ppo_tree, "update/loss").component_path == ("update", "loss")


def test_ppo_read_write_sets(ppo_tree):
    sim, policy = find(ppo_tree, "rollout/sim"), find(ppo_tree, "rollout/policy")
    loss, optimizer = find(ppo_tree, "update/loss"), find(ppo_tree, "update/optimizer")
    # the env step touches the env state only: not the optimizer state, not the parameters
    assert not _paths(sim, "train_state.opt_state") and not _paths(sim, "train_state.params")
    assert sim.reads and all(p.startswith("train_state.env_state.") for p in sim.reads | sim.writes)
    assert "train_state.env_state.obs" in sim.writes
    assert _paths(policy, "train_state.params.policy") and not _paths(policy, "train_state.params.value")
    assert "train_state.env_state.obs" in policy.reads and not policy.writes
    assert _paths(loss, "train_state.params") and not loss.writes
    assert not _paths(loss, "train_state.opt_state")
    param_paths = {p for p in ppo_tree.input_paths if p.startswith("train_state.params.")}
    opt_paths = {p for p in ppo_tree.input_paths if p.startswith("train_state.opt_state")}
    assert param_paths <= optimizer.writes and opt_paths & optimizer.writes
    assert find(ppo_tree, "normalizer").writes and all(
        p.startswith("train_state.normalizer.") for p in find(ppo_tree, "normalizer").writes)
    assert not find(ppo_tree, "advantage").writes


def test_ppo_dependencies_and_costs(ppo_tree):
    rollout, update = find(ppo_tree, "rollout"), find(ppo_tree, "update")
    assert "dataflow" in dependency(rollout, update, ppo_tree)
    assert not independent(find(ppo_tree, "update/loss"), find(ppo_tree, "update/optimizer"), ppo_tree)
    assert not independent(find(ppo_tree, "rollout/policy"), find(ppo_tree, "rollout/sim"), ppo_tree)
    step = find(ppo_tree, "rollout/scan")
    body = sum(c.cost.flops for c in step.children)
    assert step.cost.flops >= 6 * body > 0
    mb = find(ppo_tree, "minibatch_step")
    assert find(ppo_tree, "epoch_step").cost.flops >= 3 * mb.cost.flops > 0


# -------------------------------------------------------------------------------------- SAC


def test_sac_structure(sac_tree):
    assert [(c.kind, c.name) for c in sac_tree.root.children] == [("component", "collect"),
                                                                   ("component", "train_steps")]
    collect = [c.name for c in find(sac_tree, "collect").children]
    assert collect[:2] == ["policy", "sim"] and "replay_insert" in collect
    assert kids(find(sac_tree, "train_steps")) == [
        ("component", "replay_sample", 1), ("scan", "_grad_step", 5)]
    assert [c.name for c in find(sac_tree, "_grad_step").children] == [
        "alpha_update", "critic_update", "actor_update", "target_update"]
    assert find(sac_tree, "critic_update").component_path == ("train_steps", "critic_update")


def test_sac_read_write_sets(sac_tree):
    critic = find(sac_tree, "critic_update")
    actor = find(sac_tree, "actor_update")
    target = find(sac_tree, "target_update")
    # the critic update writes the critic parameters and its optimizer state, not the actor's
    assert _paths(critic, "train_state.critic_params") and {
        p for p in critic.writes if p.startswith("train_state.critic_params")}
    assert not {p for p in critic.writes if p.startswith("train_state.actor_params")}
    assert {p for p in critic.reads if p.startswith("train_state.actor_params")}  # next action
    critic_state = ("train_state.critic_params", "train_state.critic_opt_state")
    assert all(p.startswith(critic_state) for p in critic.writes)
    assert {p for p in actor.writes if p.startswith("train_state.actor_params")}
    assert not {p for p in actor.writes if p.startswith("train_state.critic")}
    assert target.writes and all(p.startswith("train_state.target_critic_params") for p in target.writes)
    sim = find(sac_tree, "collect/sim")
    assert not {p for p in sim.reads if "opt_state" in p or "params" in p}
    insert = find(sac_tree, "replay_insert")
    assert insert.writes and all(p.startswith("train_state.replay") for p in insert.writes)


def test_sac_dependencies(sac_tree):
    critic, actor = find(sac_tree, "critic_update"), find(sac_tree, "actor_update")
    why = dependency(critic, actor, sac_tree)
    assert why is not None and "loop-carried" in why
    assert "dataflow" in dependency(find(sac_tree, "collect"), find(sac_tree, "train_steps"), sac_tree)


# --------------------------------------------------------------------------- speed (MJX ant)


@pytest.mark.slow
def test_tracing_a_ppo_iteration_on_mjx_ant_is_fast():
    pytest.importorskip("brax")
    pytest.importorskip("mujoco.mjx")
    env = envs.make("ant", backend="mjx")
    config = ppo.PPOConfig(num_envs=128, unroll_length=10, num_minibatches=8, num_epochs=2)
    state = jax.eval_shape(lambda k: ppo.init(config, env, k), KEY)
    iterate = ppo.iteration(config, env)
    start = time.perf_counter()
    tree = trace(iterate, state, arg_names=["train_state"])
    seconds = time.perf_counter() - start
    assert seconds < 10.0, f"tracing took {seconds:.1f} s"
    sim = find(tree, "rollout/sim")
    assert sim.reads and not {p for p in sim.reads if "opt_state" in p}
    # the physics substeps: Brax's ant steps MJX n_frames = 5 times per env step, as a scan inside sim
    substeps = [n for n in sim.children if n.kind == "scan"]
    assert [n.trip_count for n in substeps] == [5], [(n.kind, n.name, n.trip_count) for n in sim.children]
    assert any("pipeline_state.qpos" in p for p in substeps[0].writes)
    assert find(tree, "rollout").children[0].trip_count == config.unroll_length
