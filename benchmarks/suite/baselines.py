"""The baselines rose-jax is measured against, built from the algorithms' public pieces.

* :func:`single_jit_loop` -- (b) PureJaxRL style: ``K`` iterations inside one jitted ``lax.scan``,
  no host round trip between iterations.
* :func:`pipelined_iteration` -- (c) an env-group pipelined iteration written BY HAND (RLinf-style
  coarse overlap of inference and simulation across simulator groups): the env batch is split
  into two groups A and B and the rollout is a staggered schedule::

        prologue:           policy_A(t=0)
        loop body (step t): sim_A(t)      |  policy_B(t)        <- independent: may overlap
                            sim_B(t)      |  policy_A(t + 1)    <- independent: may overlap

  so that group B's inference runs while group A simulates and vice versa. Randomness is drawn
  exactly as the single-batch iteration draws it (the full batch's noise, sliced per group), so
  the results equal (b)'s up to float rounding of the per-group matmuls. Nothing of
  ``rose_jax.optimize`` is used.
* :func:`brax_ppo_train` / :func:`brax_sac_train` -- (a) Brax's own trainers with matched
  hyperparameters (through :mod:`benchmarks.suite.brax_shim`), reporting Brax's ``training/sps``.

Shapes: ``N = num_envs``, ``n = N / 2`` envs per group, ``T = unroll_length``, ``A = action_size``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp

import rose_jax
from algos import networks, normalize

GROUPS = 2


# ------------------------------------------------------------------------------ (b) single jit


def single_jit_loop(iteration: Callable, iterations: int, donate: bool | None = None) -> Callable:
    """A jitted ``state -> (state, metrics_of_last_iteration)`` running ``iterations`` iterations in one scan.

    ``donate`` defaults to True off CPU (the CPU backend cannot donate and would warn).
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations <= 0:
        raise ValueError(f"single_jit_loop: iterations must be a positive int, got {iterations!r}")
    if donate is None:
        donate = jax.default_backend() != "cpu"

    def body(state, _):
        state, metrics = iteration(state)
        return state, metrics

    def loop(state):
        state, metrics = jax.lax.scan(body, state, None, length=iterations)
        return state, jax.tree.map(lambda m: m[-1], metrics)

    return jax.jit(loop, donate_argnums=(0,) if donate else ())


# ------------------------------------------------------------------------------ (c) helpers


def _split(tree: Any, n: int) -> tuple[Any, Any]:
    """Group A (the first ``n`` envs) and group B (the rest) of a pytree batched on axis 0."""
    return jax.tree.map(lambda x: x[:n], tree), jax.tree.map(lambda x: x[n:], tree)


def _concat(a: Any, b: Any, axis: int = 0) -> Any:
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=axis), a, b)


def _check_groups(num_envs: int, groups: int) -> int:
    if groups != GROUPS:
        raise ValueError(f"pipelined baseline: groups must be {GROUPS} (A and B staggered), got {groups}")
    if num_envs % groups:
        raise ValueError(f"pipelined baseline: num_envs={num_envs} is not divisible by groups={groups}")
    return num_envs // groups


class _Sample(NamedTuple):
    action: jax.Array  # (n, A) in [-1, 1]
    raw: jax.Array  # (n, A) pre-tanh
    log_prob: jax.Array  # (n,)


def _group_sample(dist: networks.TanhGaussian, key: jax.Array, num_envs: int, group: int) -> jax.Array:
    """Pre-tanh samples of envs ``group * n ... (group + 1) * n``: the full batch's noise, sliced."""
    n = dist.loc.shape[0]
    noise = jax.random.normal(key, (num_envs, dist.loc.shape[-1]), dist.loc.dtype)[
        group * n : (group + 1) * n
    ]
    return dist.loc + dist.scale * noise


# ------------------------------------------------------------------------------ (c) PPO


def ppo_pipelined_iteration(config, env, groups: int = GROUPS) -> Callable:
    """``algos.ppo.iteration`` with the rollout staggered over two env groups (see module docstring).

    Everything after the rollout (normalizer, GAE, update, metrics) is ``algos.ppo``'s own pieces
    in ``ppo.iteration``'s order; the returned function is pure and jittable.
    """
    from algos import ppo

    config.validate(env)
    N, T = config.num_envs, config.unroll_length
    n = _check_groups(N, groups)
    nets = ppo.make_networks(config, env)
    sim = rose_jax.component("sim")(jax.vmap(env.step))

    def normalized(normalizer, obs):
        return normalize.apply(normalizer, obs) if config.normalize_observations else obs

    def policy(policy_params, normalizer, obs, key, group) -> _Sample:
        with rose_jax.component("policy"):
            dist = networks.tanh_gaussian(nets.policy(policy_params, normalized(normalizer, obs)))
            raw = _group_sample(dist, key, N, group)
            return _Sample(jnp.tanh(raw), raw, networks.log_prob(dist, raw))

    def rollout(policy_params, normalizer, env_state, key):
        keys = jax.random.split(key, T)  # ppo.rollout's per-step keys
        next_keys = jnp.concatenate([keys[1:], keys[:1]], axis=0)  # A's key for step t + 1 (last: unused)
        state_a, state_b = _split(env_state, n)
        first_a = policy(policy_params, normalizer, state_a.obs, keys[0], 0)

        def step(carry, step_keys):
            state_a, state_b, sample_a = carry
            key_t, key_next = step_keys
            # stage 1: group A simulates step t while group B infers its step-t actions
            next_a = sim(state_a, sample_a.action)
            sample_b = policy(policy_params, normalizer, state_b.obs, key_t, 1)
            # stage 2: group B simulates step t while group A infers its step-(t+1) actions
            next_b = sim(state_b, sample_b.action)
            sample_a_next = policy(policy_params, normalizer, next_a.obs, key_next, 0)
            tr_a = ppo.Transition(
                state_a.obs, sample_a.raw, sample_a.log_prob, next_a.reward, next_a.done, next_a.truncated
            )
            tr_b = ppo.Transition(
                state_b.obs, sample_b.raw, sample_b.log_prob, next_b.reward, next_b.done, next_b.truncated
            )
            return (next_a, next_b, sample_a_next), (tr_a, tr_b)

        with rose_jax.component("rollout"):
            (state_a, state_b, _), (tr_a, tr_b) = jax.lax.scan(
                step, (state_a, state_b, first_a), (keys, next_keys)
            )
        return _concat(state_a, state_b), _concat(tr_a, tr_b, axis=1)  # (N, ...), (T, N, ...)

    def iterate(state):
        rollout_key, _, _ = ppo.split_keys(state.key)
        env_state, data = rollout(state.params.policy, state.normalizer, state.env_state, rollout_key)
        return ppo.learn(nets, config, state, env_state, data)  # ppo.iteration's own second half

    return iterate


# ------------------------------------------------------------------------------ (c) SAC


def sac_pipelined_iteration(config, env, groups: int = GROUPS) -> Callable:
    """``algos.sac.iteration`` with each env step staggered over two env groups.

    One SAC env step is ``policy -> sim`` for all envs, followed by gradient steps that change the
    actor, so the stagger lives inside the step: ``policy_A``; ``sim_A | policy_B``; ``sim_B``.
    The normalizer update, replay insert and gradient steps then see the merged batch, as in
    ``algos.sac`` (whose gradient-step loop ``train_steps`` is reused as is); the iteration's
    counters and metrics follow ``sac.iteration`` line for line (the tests compare the two).
    """
    from algos import sac

    built = sac.make(config, env)
    N = config.num_envs
    n = _check_groups(N, groups)

    def policy(actor_params, normalizer, obs, key, group) -> jax.Array:
        with rose_jax.component("policy"):
            dist = sac.policy_distribution(built, actor_params, normalizer, obs)
            return jnp.tanh(_group_sample(dist, key, N, group))

    def collect(state, key):
        with rose_jax.component("collect"):
            obs = state.env_state.obs
            state_a, state_b = _split(state.env_state, n)
            action_a = policy(state.actor_params, state.normalizer, state_a.obs, key, 0)
            # group A simulates while group B infers, then group B simulates
            next_a = sac.sim(built, state_a, action_a)
            action_b = policy(state.actor_params, state.normalizer, state_b.obs, key, 1)
            next_b = sac.sim(built, state_b, action_b)
            env_state = _concat(next_a, next_b)
            action = jnp.concatenate([action_a, action_b], axis=0)
            terminal = env_state.done * (1.0 - env_state.truncated)
            transitions = sac.Transition(
                obs=obs,
                action=action,
                reward=env_state.reward,
                discount=1.0 - terminal,
                next_obs=env_state.obs,
                truncation=env_state.truncated,
            )
            normalizer = sac.update_normalizer(built, state.normalizer, obs)
            buffer_state = sac.replay_insert(built, state.replay, transitions)
            state = state.replace(
                env_state=env_state, normalizer=normalizer, replay=buffer_state, env_steps=state.env_steps + N
            )
        return state, {
            "reward": jnp.mean(env_state.reward),
            "episodes": jnp.sum(env_state.done.astype(jnp.int32)),
        }

    def env_and_train_step(state, _=None):
        key, collect_key, train_key = sac.split_keys(state.key)
        state = state.replace(key=key)
        state, collect_metrics = collect(state, collect_key)
        state, train_metrics = sac.train_steps(built, state, train_key)
        return state, {**collect_metrics, **train_metrics}

    def iterate(state):
        if config.steps_per_iteration == 1:
            state, m = env_and_train_step(state)
        else:
            state, m = jax.lax.scan(env_and_train_step, state, None, length=config.steps_per_iteration)
            m = {**jax.tree.map(jnp.mean, m), "episodes": jnp.sum(m["episodes"]), "alpha": m["alpha"][-1]}
        return sac.finish_iteration(state, m)

    return iterate


def pipelined_iteration(algo: str, config, env, groups: int = GROUPS) -> Callable:
    """The hand-pipelined iteration (c) of ``algo`` (``'ppo'`` or ``'sac'``)."""
    if algo == "ppo":
        return ppo_pipelined_iteration(config, env, groups)
    if algo == "sac":
        return sac_pipelined_iteration(config, env, groups)
    raise ValueError(f"pipelined_iteration: unknown algo {algo!r} (ppo or sac)")


# ------------------------------------------------------------------------------ (a) Brax


class BraxRun(NamedTuple):
    """Per-epoch facts of one Brax training run.

    sps: Brax's ``training/sps`` per epoch (env steps / s of its jitted epoch, compile included
    in the first ones); epoch_end_ns: ``perf_counter_ns`` when each epoch's progress report
    arrived; total_s: the whole ``train`` call; epoch_env_steps: env steps per epoch.
    """

    sps: list[float]
    epoch_end_ns: list[int]
    total_s: float
    epoch_env_steps: int


def _brax_env(workload):
    from brax import envs as brax_envs

    kw = {"backend": workload.backend} if workload.backend else {}
    return brax_envs.get_environment(workload.brax_env, **kw)


def brax_ppo_train(
    workload, config, epochs: int, on_epoch: Callable[[int], None] | None = None, evaluate: bool = False
) -> BraxRun:
    """Brax's ``ppo.train`` with ``config``'s hyperparameters: ``epochs`` epochs of K training steps.

    One Brax training step = one unroll of every env (``batch_size * num_minibatches == num_envs``)
    followed by ``num_epochs`` passes of ``num_minibatches`` minibatches, as one of our iterations.
    No evaluation (``run_evals=False``) unless ``evaluate``: then after every epoch Brax evaluates
    the deterministic policy on ``workload.eval_envs`` envs for an episode, as ``ppo.epoch`` does.
    ``on_epoch(i)`` is called after epoch ``i`` (0-based).
    """
    from benchmarks.suite import brax_shim

    brax_shim.install()
    import flax.linen as nn
    from brax.training.agents.ppo import networks as ppo_networks
    from brax.training.agents.ppo import train as brax_ppo

    c = config
    if c.num_envs % c.num_minibatches:
        raise ValueError(
            f"brax ppo: num_envs={c.num_envs} must be divisible by num_minibatches={c.num_minibatches}"
        )
    per_epoch = c.num_envs * c.unroll_length * workload.iterations_per_block
    return _run_brax(
        lambda progress: brax_ppo.train(
            _brax_env(workload),
            num_timesteps=per_epoch * epochs,
            num_evals=epochs + 1,
            run_evals=evaluate,
            num_eval_envs=workload.eval_envs,
            deterministic_eval=True,
            episode_length=workload.episode_length,
            num_envs=c.num_envs,
            batch_size=c.num_envs // c.num_minibatches,
            num_minibatches=c.num_minibatches,
            unroll_length=c.unroll_length,
            num_updates_per_batch=c.num_epochs,
            learning_rate=c.learning_rate,
            entropy_cost=c.entropy_cost,
            discounting=c.discounting,
            gae_lambda=c.gae_lambda,
            clipping_epsilon=c.clipping_epsilon,
            reward_scaling=c.reward_scaling,
            normalize_observations=c.normalize_observations,
            normalize_advantage=c.normalize_advantage,
            vf_loss_coefficient=c.value_cost,  # both: 0.5 * coefficient * mean((target - v)^2)
            max_grad_norm=c.max_grad_norm,
            network_factory=functools.partial(
                ppo_networks.make_ppo_networks,
                policy_hidden_layer_sizes=tuple(c.policy_hidden_sizes),
                value_hidden_layer_sizes=tuple(c.value_hidden_sizes),
                activation=getattr(nn, c.activation),
            ),
            progress_fn=progress,
            seed=workload.seed,
        ),
        per_epoch,
        epochs,
        on_epoch,
    )


class _NoEvaluator:
    """Stands in for ``brax.training.acting.Evaluator`` while timing ``sac.train``.

    Evaluation is not part of ``training/sps`` (Brax times only its training epoch); Brax's SAC
    has no ``run_evals`` switch, so its evaluator is replaced for the call (no extra compile,
    no 1000-step evaluation episodes between epochs). The training computation is unchanged.
    """

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def run_evaluation(self, policy_params, training_metrics, aggregate_episodes=True):
        del policy_params, aggregate_episodes
        return dict(training_metrics)


def brax_sac_train(
    workload, config, epochs: int, on_epoch: Callable[[int], None] | None = None, evaluate: bool = False
) -> BraxRun:
    """Brax's ``sac.train`` with ``config``'s hyperparameters: ``epochs`` epochs of K steps of all envs.

    Without ``evaluate`` its evaluator is replaced by :class:`_NoEvaluator`; with it Brax evaluates
    the deterministic policy on ``workload.eval_envs`` envs after every epoch, as ``sac.epoch`` does.
    """
    from benchmarks.suite import brax_shim

    brax_shim.install()
    import flax.linen as nn
    from brax.training import acting
    from brax.training.agents.sac import networks as sac_networks
    from brax.training.agents.sac import train as brax_sac

    c = config
    if tuple(c.policy_hidden_sizes) != tuple(c.q_hidden_sizes):
        raise ValueError(
            "brax sac: Brax uses one hidden size for policy and Q; set q_hidden_sizes = policy_hidden_sizes"
        )
    if c.steps_per_iteration != 1:
        raise ValueError(
            f"brax sac: needs steps_per_iteration == 1 (one Brax training step), got {c.steps_per_iteration}"
        )
    per_epoch = c.num_envs * workload.iterations_per_block
    prefill = c.prefill_steps * c.num_envs

    def call(progress):
        patch = contextlib.nullcontext() if evaluate else mock.patch.object(acting, "Evaluator", _NoEvaluator)
        with patch:
            return brax_sac.train(
                _brax_env(workload),
                num_timesteps=per_epoch * epochs + prefill,
                episode_length=workload.episode_length,
                num_envs=c.num_envs,
                num_eval_envs=workload.eval_envs if evaluate else 1,
                deterministic_eval=True,
                learning_rate=c.learning_rate,
                discounting=c.discounting,
                seed=workload.seed,
                batch_size=c.batch_size,
                num_evals=epochs + 1,
                normalize_observations=c.normalize_observations,
                reward_scaling=c.reward_scaling,
                tau=c.tau,
                min_replay_size=c.min_replay_size,
                max_replay_size=c.replay_capacity,
                grad_updates_per_step=c.grad_updates_per_step,
                network_factory=functools.partial(
                    sac_networks.make_sac_networks,
                    hidden_layer_sizes=tuple(c.policy_hidden_sizes),
                    activation=getattr(nn, c.activation),
                ),
                progress_fn=progress,
            )

    return _run_brax(call, per_epoch, epochs, on_epoch)


def _run_brax(call: Callable, per_epoch: int, epochs: int, on_epoch) -> BraxRun:
    sps: list[float] = []
    ends: list[int] = []

    def progress(step, metrics):
        if "training/sps" not in metrics:
            return  # the initial report before training (PPO with run_evals, SAC's first eval)
        ends.append(time.perf_counter_ns())
        sps.append(float(metrics["training/sps"]))
        if on_epoch is not None:
            on_epoch(len(sps) - 1)

    t0 = time.perf_counter()
    call(progress)
    total = time.perf_counter() - t0
    if len(sps) != epochs:
        raise RuntimeError(f"brax train reported {len(sps)} epochs, expected {epochs}")
    return BraxRun(sps, ends, total, per_epoch)
