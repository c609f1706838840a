"""CPU check behind notes.md: hoist_independent on tiny Brax-layout PPO over MJX ant, stepwise (one
hoisted iteration from the reference's state) and as a trajectory, against rtol 1e-4.

    python benchmarks/results/beyond_flags/cpu_mjx_ant_stepwise.py      # ~30 s on 2 cores
"""

import jax

import envs
from algos import ppo, ppo_brax
from rose_jax.compare import compare_trees
from rose_jax.optimize import hoist_independent

cfg = ppo.PPOConfig(
    num_envs=8, unroll_length=5, batch_size=4, num_minibatches=2, num_updates_per_batch=2,
    policy_hidden_sizes=(16,), value_hidden_sizes=(16,), max_grad_norm=None, num_timesteps=10**5,
    episode_length=20,
)
env = ppo_brax.resolve_env(cfg, envs.make("ant", backend="mjx", episode_length=20))
fn = ppo.iteration(cfg, env)
ref_step, new_step = jax.jit(fn), jax.jit(hoist_independent().apply(fn))
a = b = ppo.init(cfg, env, jax.random.PRNGKey(0))
for i in range(4):
    stepwise = compare_trees(new_step(a)[0], ref_step(a)[0], rtol=1e-4)
    a, b = ref_step(a)[0], new_step(b)[0]
    trajectory = compare_trees(b, a, rtol=1e-4)
    print(f"iteration {i + 1}: stepwise {stepwise.equal} (max |d| {stepwise.max_abs:.2g}); "
          f"trajectory {trajectory.equal} (max |d| {trajectory.max_abs:.2g}, {trajectory.worst})")
