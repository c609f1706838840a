"""PPO in Brax's data layout and schedule (``brax.training.agents.ppo`` 0.14.2) over rose-jax's state.

:func:`algos.ppo.iteration` uses this module when ``PPOConfig.batch_size`` is set. One iteration
is one of Brax's ``training_step`` calls, computed in the same order with the same keys::

    keys         key_sgd, key_unroll, next_key = split(state.key, 3)
    rollout      U = batch_size * num_minibatches // num_envs sequential unrolls of T = unroll_length
                 steps of all N envs (the env state carries over): S = U * N segments of T steps
    normalizer   fold all S * T observations into the running statistics (before the update)
    update       num_updates_per_batch passes; each permutes the S segments and splits them into
                 num_minibatches minibatches of batch_size segments; per minibatch: values of the
                 segment's T observations and of the observation after its last step with the
                 current value network, Brax's GAE per segment, the clipped PPO loss, one Adam step

Shapes: a segment batch (:class:`Segments`) has leading axes ``(S, T)``; the loss works on
``(T, S)`` like Brax's. ``env_steps`` grows by ``batch_size * num_minibatches * unroll_length *
action_repeat`` per iteration (Brax's ``env_step_per_training_step``).

This module also holds the host side of Brax-style runs: :func:`resolve_env` (registry names,
Brax env objects, ``episode_length``, ``action_repeat``), the evaluator with Brax's metric names
(``eval/episode_reward`` ...), and :func:`train_with_evals` (``num_evals`` progress points).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import rose_jax
from algos import driver, networks, normalize
from algos import ppo_core
from algos.ppo_core import LossMetrics, Metrics, Networks, PPOConfig, PPOParams, TrainState, Transition
from envs.core import Env, EnvState

# ----------------------------------------------------------------------------------------------
# Layout


def unrolls_per_iteration(config: PPOConfig) -> int:
    """Brax's ``batch_size * num_minibatches // num_envs``: sequential unrolls per iteration (U)."""
    return config.batch_size * config.num_minibatches // config.num_envs


# A Transition's fields (each with leading axes (S, T)), then next_obs
Segments = NamedTuple(
    "Segments", [*((name, jax.Array) for name in Transition._fields), ("next_obs", jax.Array)]
)
Segments.__doc__ = """Training data in Brax's layout: ``S`` unroll segments of ``T`` steps each.

The fields of :class:`algos.ppo.Transition`, then ``next_obs``. obs ``(S, T, obs)`` and next_obs
``(S, obs)`` (the observation after the segment's last step) are already normalised; raw_action
``(S, T, act)``; log_prob, reward (unscaled), done, truncated ``(S, T)`` float32. Segment
``s = u * N + n`` is unroll ``u`` of env ``n``."""


def compute_gae(
    truncation: jax.Array,
    termination: jax.Array,
    rewards: jax.Array,
    values: jax.Array,
    bootstrap_value: jax.Array,
    lambda_: float,
    discount: float,
) -> tuple[jax.Array, jax.Array]:
    """Brax's ``compute_gae`` (``ppo/losses.py``): ``(vs, advantages)``, both ``(T, B)``.

    ``vs`` are the lambda-returns; the advantages are Brax's one-step form on them,
    ``(r_t + discount * (1 - termination_t) * vs_{t+1} - v_t) * (1 - truncation_t)`` with
    ``vs_T = bootstrap_value`` (not ``vs - v``, which :func:`algos.ppo.compute_gae` returns).
    Inputs: truncation/termination/rewards/values ``(T, B)``, bootstrap_value ``(B,)``.
    """
    truncation_mask = 1 - truncation
    values_t_plus_1 = jnp.concatenate([values[1:], jnp.expand_dims(bootstrap_value, 0)], axis=0)
    deltas = (rewards + discount * (1 - termination) * values_t_plus_1 - values) * truncation_mask

    def backward(acc, xs):
        mask, delta, term = xs
        acc = delta + discount * (1 - term) * mask * lambda_ * acc
        return acc, acc

    _, vs_minus_v = jax.lax.scan(
        backward, jnp.zeros_like(bootstrap_value), (truncation_mask, deltas, termination), reverse=True
    )
    vs = vs_minus_v + values
    vs_t_plus_1 = jnp.concatenate([vs[1:], jnp.expand_dims(bootstrap_value, 0)], axis=0)
    advantages = (rewards + discount * (1 - termination) * vs_t_plus_1 - values) * truncation_mask
    return jax.lax.stop_gradient(vs), jax.lax.stop_gradient(advantages)


def segment_loss(
    nets: Networks, config: PPOConfig, params: PPOParams, seg: Segments, key: jax.Array
) -> tuple[jax.Array, LossMetrics]:
    """Brax's ``compute_ppo_loss`` on a minibatch of segments (leading axes ``(B, T)``).

    GAE runs per segment with ``params.value`` (bootstrapped from ``V(next_obs)``); ``key`` draws
    the entropy estimate's sample, of shape ``(T, B, act)`` as in Brax.
    """

    def time_major(x):
        return jnp.swapaxes(x, 0, 1)

    obs = time_major(seg.obs)
    dist = networks.tanh_gaussian(nets.policy(params.policy, obs))
    baseline = nets.value(params.value, obs)
    bootstrap = nets.value(params.value, seg.next_obs)
    truncation = time_major(seg.truncated)
    termination = time_major(seg.done) * (1 - truncation)
    vs, advantages = compute_gae(
        truncation,
        termination,
        time_major(seg.reward) * config.reward_scaling,
        baseline,
        bootstrap,
        config.gae_lambda,
        config.discounting,
    )
    log_prob = networks.log_prob(dist, time_major(seg.raw_action))
    entropy = networks.entropy(dist, key)
    return ppo_core.loss_from_outputs(
        config, log_prob, time_major(seg.log_prob), advantages, baseline, vs, entropy
    )


# ----------------------------------------------------------------------------------------------
# One iteration (Brax's training_step)


def split_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Brax's training-step keys: ``state.key -> (key_sgd, key_unroll, next_key)``."""
    key_sgd, key_unroll, next_key = jax.random.split(key, 3)
    return key_sgd, key_unroll, next_key


def rollout(
    nets: Networks,
    config: PPOConfig,
    env: Env,
    policy_params: Any,
    normalizer: normalize.NormalizerState,
    env_state: EnvState,
    key: jax.Array,
) -> tuple[EnvState, Transition, jax.Array]:
    """U sequential unrolls of T steps of every env, with Brax's key chain (``generate_unroll``).

    Returns the last env state, a :class:`algos.ppo.Transition` with leaves ``(U, T, N, ...)``
    and the observations after each unroll ``(U, N, obs)`` (raw).
    """
    sim = rose_jax.component("sim")(jax.vmap(env.step))

    def step(carry, _):
        env_state, key = carry
        key, next_key = jax.random.split(key)
        action, raw, logp = ppo_core.policy_step(nets, config, policy_params, normalizer, env_state.obs, key)
        nstate = sim(env_state, action)
        transition = Transition(env_state.obs, raw, logp, nstate.reward, nstate.done, nstate.truncated)
        return (nstate, next_key), transition

    def unroll(carry, _):
        env_state, key = carry
        key, next_key = jax.random.split(key)
        (env_state, _), data = jax.lax.scan(step, (env_state, key), None, length=config.unroll_length)
        return (env_state, next_key), (data, env_state.obs)

    with rose_jax.component("rollout"):
        (env_state, _), (data, next_obs) = jax.lax.scan(
            unroll, (env_state, key), None, length=unrolls_per_iteration(config)
        )
    return env_state, data, next_obs


def to_segments(
    config: PPOConfig,
    normalizer: normalize.NormalizerState,
    data: Transition,
    next_obs: jax.Array,
) -> Segments:
    """``(U, T, N, ...)`` rollout data -> :class:`Segments` ``(U * N, T, ...)`` (Brax's swap and
    reshape), observations normalised with ``normalizer``."""

    def seg(x):
        x = jnp.swapaxes(x, 1, 2)
        return x.reshape((-1,) + x.shape[2:])

    def norm(x):
        return ppo_core.normalized(config, normalizer, x)

    return Segments(
        obs=norm(seg(data.obs)),
        raw_action=seg(data.raw_action),
        log_prob=seg(data.log_prob),
        reward=seg(data.reward),
        done=seg(data.done),
        truncated=seg(data.truncated),
        next_obs=norm(next_obs.reshape((-1,) + next_obs.shape[2:])),
    )


def update(
    nets: Networks,
    config: PPOConfig,
    params: PPOParams,
    opt_state: optax.OptState,
    segments: Segments,
    key: jax.Array,
) -> tuple[PPOParams, optax.OptState, LossMetrics, jax.Array]:
    """``num_epochs`` passes of Brax's ``sgd_step`` over ``segments`` (leading axis S).

    Returns the new params and optimizer state, the loss metrics averaged over every minibatch
    step and the mean gradient norm.
    """
    step = ppo_core.gradient_step(nets, config, segment_loss)
    num_segments = segments.reward.shape[0]

    def minibatch_step(carry, minibatch):
        learner, key = carry
        key, key_loss = jax.random.split(key)
        learner, out = step(learner, minibatch, key_loss)
        return (learner, key), out

    def sgd_step(carry, _):
        learner, key = carry
        key, key_perm, key_grad = jax.random.split(key, 3)
        # one permutation for every leaf: what jax.random.permutation(key_perm, x) gives per leaf
        perm = jax.random.permutation(key_perm, num_segments)
        shuffled = jax.tree.map(
            lambda x: jnp.take(x, perm, axis=0).reshape((config.num_minibatches, -1) + x.shape[1:]), segments
        )
        (learner, _), out = jax.lax.scan(minibatch_step, (learner, key_grad), shuffled)
        return (learner, key), out

    with rose_jax.component("update"):
        (learner, _), (metrics, grad_norm) = jax.lax.scan(
            sgd_step, (ppo_core.Learner(params, opt_state), key), None, length=config.num_epochs
        )
    return ppo_core.update_result(learner, metrics, grad_norm)


def learn(
    nets: Networks,
    config: PPOConfig,
    state: TrainState,
    env_state: EnvState,
    data: Transition,
    next_obs: jax.Array,
) -> tuple[TrainState, Metrics]:
    """Everything of an iteration after :func:`rollout`: normalizer, segments, update, counters."""
    key_sgd, _, key = split_keys(state.key)
    normalizer = ppo_core.update_normalizer(config, state.normalizer, data.obs)
    segments = to_segments(config, normalizer, data, next_obs)
    params, opt_state, loss_metrics, grad_norm = update(
        nets, config, state.params, state.opt_state, segments, key_sgd
    )
    return ppo_core.finish(
        config, state, (params, opt_state), normalizer, env_state, key, data, loss_metrics, grad_norm
    )


def iteration(config: PPOConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    """One Brax training step ``state -> (state, metrics)``: pure and jittable."""
    if not config.brax_layout:
        raise ValueError("ppo_brax.iteration: config.batch_size is None (that is rose-jax's layout)")
    config.validate(env)
    nets = ppo_core.make_networks(config, env)

    def iterate(state):
        ppo_core.check_state(config, env, state)
        _, key_unroll, _ = split_keys(state.key)
        env_state, data, next_obs = rollout(
            nets, config, env, state.params.policy, state.normalizer, state.env_state, key_unroll
        )
        return learn(nets, config, state, env_state, data, next_obs)

    return iterate


def program(config: PPOConfig, env: Env) -> rose_jax.program.Program:
    """The Brax-layout iteration as a :class:`rose_jax.program.Program` (no env-group rollout parts)."""
    from rose_jax.program import Program, attr_lens

    config.validate(env)
    nets = ppo_core.make_networks(config, env)

    def collect(state):
        _, key_unroll, _ = split_keys(state.key)
        env_state, data, next_obs = rollout(
            nets, config, env, state.params.policy, state.normalizer, state.env_state, key_unroll
        )
        return state.replace(env_state=env_state), (data, next_obs, env_state)

    def learn_step(state, data):
        transitions, next_obs, env_state = data
        new_state, metrics = learn(nets, config, state, env_state, transitions, next_obs)
        return new_state.replace(env_state=state.env_state), metrics

    return Program(
        name="ppo",
        num_envs=config.num_envs,
        collect=collect,
        learn=learn_step,
        env=attr_lens("env_state"),
        data_env_axis=(2, 1, 0),  # transitions (U, T, N, ...), next_obs (U, N, obs), env state (N, ...)
        env_name=env.name,
    )


# ----------------------------------------------------------------------------------------------
# Environments: names, Brax env objects, episode_length, action_repeat


def with_action_repeat(env: Env, action_repeat: int) -> Env:
    """``env`` stepping each action ``action_repeat`` times, rewards summed (Brax's wrapper).

    An episode that ends inside the repeat stops there (the remaining physics steps are not
    taken; Brax keeps stepping the finished episode until the repeat is over). The wrapped env's
    ``episode_length`` is ``ceil(episode_length / action_repeat)`` agent steps.
    """
    if action_repeat == 1:
        return env

    def step(state: EnvState, action: jax.Array) -> EnvState:
        def body(carry, _):
            state, total, stopped = carry
            nxt = env.step(state, action)
            nxt = jax.tree.map(lambda a, b: jnp.where(stopped, a, b), state, nxt)
            total = total + jnp.where(stopped, 0.0, nxt.reward)
            return (nxt, total, jnp.logical_or(stopped, nxt.done > 0)), None

        zero = jnp.zeros((), jnp.float32)
        (state, total, _), _ = jax.lax.scan(
            body, (state, zero, jnp.zeros((), bool)), None, length=action_repeat
        )
        return state.replace(reward=total)

    return env._replace(step=step, episode_length=-(-env.episode_length // action_repeat))


def resolve_env(config: PPOConfig, env: Any) -> Env:
    """The :class:`envs.core.Env` that :func:`algos.ppo.train` trains on.

    ``env`` is an ``Env``, a registry name (built with ``config.episode_length`` when set), or a
    Brax env object (``brax.envs.get_environment(...)``, wrapped with ``episode_length``, default
    1000, as Brax's ``ppo.train`` wraps it). ``config.action_repeat > 1`` wraps the result with
    :func:`with_action_repeat`.
    """
    if isinstance(env, str):
        import envs

        kwargs = {} if config.episode_length is None else {"episode_length": config.episode_length}
        env = envs.make(env, **kwargs)
    elif not isinstance(env, Env) and _is_brax_env(env):
        from envs import playground

        env = playground.from_brax_like(env, episode_length=config.episode_length or 1000)
    if not isinstance(env, Env):
        raise ValueError(
            "ppo.train: env must be an envs.core.Env, a registry name or a Brax env, "
            f"got {type(env).__name__}"
        )
    if config.episode_length is not None and env.episode_length != config.episode_length:
        raise ValueError(
            f"ppo.train: env {env.name!r} has episode_length={env.episode_length} but "
            f"episode_length={config.episode_length} was asked for; build the env with it "
            f"(envs.make({env.name!r}, episode_length={config.episode_length})) or pass its name"
        )
    return with_action_repeat(env, config.action_repeat)


def _is_brax_env(obj: Any) -> bool:
    # Looked up on the class: Brax's ``observation_size`` property runs ``reset`` eagerly, op by op
    # (on a CPU 15 s for inverted_pendulum; on the H200 most of the 100 s before the first report).
    cls = type(obj)
    return all(hasattr(cls, a) for a in ("reset", "step", "observation_size", "action_size")) and (
        type(obj).__module__.split(".")[0] in ("brax", "mujoco_playground")
        or any(c.__module__.startswith("brax.envs") for c in type(obj).__mro__)
    )


# ----------------------------------------------------------------------------------------------
# Evaluation with Brax's metric names

@functools.lru_cache(maxsize=32)
def make_evaluator(
    config: PPOConfig, env: Env, num_envs: int, deterministic: bool, steps: int | None = None
) -> Callable[..., dict]:
    """Jitted ``(params, normalizer, key) -> {'eval/episode_reward', ...}`` over fresh episodes.

    ``num_envs`` envs run ``steps`` (default ``env.episode_length``) steps from a reset; each env's
    return sums its first episode's rewards up to then (Brax's ``EvalWrapper``). Fewer ``steps``
    than an episode is the plan search's scaled-down unit (:func:`algos.ppo.search_unit`), never
    what ``train`` reports. Returns device scalars ``eval/episode_reward`` (mean),
    ``eval/episode_reward_std``, ``eval/avg_episode_length``.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"ppo_brax.make_evaluator: steps must be a positive int, got {steps!r}")
    length = env.episode_length if steps is None else steps  # an env's own length as it is
    act = ppo_core.make_inference_fn(config, env)

    def run(params, normalizer, key):
        reset_key, act_key = jax.random.split(key)
        env_state = jax.vmap(env.reset)(jax.random.split(reset_key, num_envs))

        def step(carry, step_key):
            env_state, ret, length, alive = carry
            action = act(params, normalizer, env_state.obs, step_key, deterministic=deterministic)
            env_state = jax.vmap(env.step)(env_state, action)
            ret = ret + alive * env_state.reward
            length = length + alive
            alive = alive * (1.0 - env_state.done)
            return (env_state, ret, length, alive), None

        zeros = jnp.zeros((num_envs,), jnp.float32)
        carry = (env_state, zeros, zeros, jnp.ones((num_envs,), jnp.float32))
        (_, ret, lived, _), _ = jax.lax.scan(step, carry, jax.random.split(act_key, length))
        return {
            "eval/episode_reward": jnp.mean(ret),
            "eval/episode_reward_std": jnp.std(ret),
            "eval/avg_episode_length": jnp.mean(lived) * config.action_repeat,
        }

    return jax.jit(run)


def epoch(
    config: PPOConfig,
    env: Env,
    one: Callable[[TrainState], tuple[TrainState, Metrics]],
    iterations: int,
    eval_steps: int | None = None,
) -> Callable[[TrainState], tuple[Any, dict]]:
    """Pure ``state -> (state, metrics)``: ``iterations`` of the iteration ``one`` (either layout's,
    :func:`algos.ppo.iteration`) in a ``lax.scan``, then (when ``config.num_evals``) an evaluation
    of ``eval_steps`` steps (default: an episode; fewer only in the plan search's unit).
    Metrics: the last iteration's, ``reward`` averaged, ``episodes`` summed, Brax's ``training/*``
    loss means over the epoch and ``eval/*``."""
    evaluate = None
    if config.num_evals:
        evaluate = make_evaluator(
            ppo_core.evaluator_key(config), env, config.num_eval_envs, config.deterministic_eval, eval_steps
        )

    def run_epoch(state):
        state, ms = jax.lax.scan(lambda s, _: one(s), state, None, length=iterations)
        out = {k: v[-1] for k, v in ms._asdict().items()}
        out["reward"], out["episodes"] = jnp.mean(ms.reward), jnp.sum(ms.episodes)
        for ours, theirs in _BRAX_LOSS_NAMES.items():
            out[f"training/{theirs}"] = jnp.mean(getattr(ms, ours))
        if evaluate is not None:
            with rose_jax.component("evaluate"):
                out.update(evaluate(state.params, state.normalizer, ppo_core.eval_key(state)))
            out["eval_episode_return"] = out["eval/episode_reward"]
        return state, out

    return run_epoch


def eval_epoch(config: PPOConfig, env: Env, one: Callable[[TrainState], tuple[TrainState, Metrics]]):
    """What :func:`train_with_evals` runs between two progress reports, as a pure function for the
    optimizer: :func:`epoch` of ``config.iterations_per_eval`` iterations of ``one`` and the
    evaluation (a ``component("evaluate")``). ``env`` is already resolved (:func:`resolve_env`
    is not idempotent: it wraps ``action_repeat`` again), as :func:`train_with_evals` gets it."""
    if config.num_evals is None:
        raise ValueError("ppo_brax.eval_epoch: config.num_evals is None (no evaluation to schedule)")
    return epoch(config, env, one, config.iterations_per_eval)


_BRAX_LOSS_NAMES = {
    "total_loss": "total_loss",
    "policy_loss": "policy_loss",
    "value_loss": "v_loss",
    "entropy_loss": "entropy_loss",
}


# ----------------------------------------------------------------------------------------------
# Host driver with evaluations at progress points


def train_with_evals(
    config: PPOConfig,
    env: Env,
    one: Callable[[TrainState], tuple[TrainState, Metrics]],
    *,
    progress_fn: driver.ProgressFn | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int | None = None,
    resume: bool = False,
    make_step: Callable[[TrainState], Callable[[TrainState], tuple[TrainState, Any]]] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Brax's run shape: an evaluation at step 0 (when ``num_evals > 1``), then
    ``max(num_evals - 1, 1)`` jitted epochs of ``config.iterations_per_eval`` iterations, each
    followed by an evaluation. ``env`` is already resolved (:func:`resolve_env`); ``one`` is the
    iteration of ``config`` and ``env`` (:func:`algos.ppo.iteration`, either layout).

    ``progress_fn(env_steps, metrics)`` gets Brax's names (``eval/episode_reward``,
    ``training/total_loss``, ``training/sps``, ``training/walltime``, ...) next to rose-jax's
    (``env_steps``, ``episode_return``, ``eval_episode_return``, ...), plus ``time/compile_s``
    (seconds to compile the epoch). Checkpoints count epochs. Returns ``(state, metrics per epoch)``.

    ``make_step(state)``, if given, returns the step run per epoch instead of the jitted
    :func:`epoch` (e.g. a ``rose_jax.optimize`` plan of :func:`eval_epoch`, which may run the
    evaluation behind the next epoch's training); it must compute the same ``state -> (state,
    metrics)``. ``time/compile_s`` then includes its search.
    """
    if config.num_evals is None:
        raise ValueError("ppo_brax.train_with_evals: config.num_evals is None")
    config.validate(env)
    driver.check_loop_args(checkpoint_dir, checkpoint_every)
    state = ppo_core.init(config, env, jax.random.PRNGKey(config.seed))
    state, _ = driver.maybe_resume(checkpoint_dir, state, resume)
    iters = config.iterations_per_eval
    epochs = max(config.num_evals - 1, 1)
    donate = (0,) if jax.default_backend() != "cpu" else ()
    t0 = time.perf_counter()
    if make_step is None:
        step_fn = jax.jit(epoch(config, env, one, iters), donate_argnums=donate).lower(state).compile()
    else:
        step_fn = make_step(state)
    compile_s = time.perf_counter() - t0

    clock = {"start": time.perf_counter(), "last": time.perf_counter(), "steps": int(state.env_steps)}
    if (
        config.num_evals > 1
        and config.num_eval_envs
        and int(state.iteration) == 0
        and progress_fn is not None
    ):
        evaluate = make_evaluator(
            ppo_core.program_key(config), env, config.num_eval_envs, config.deterministic_eval
        )
        first = driver.metrics_to_host(evaluate(state.params, state.normalizer, ppo_core.eval_key(state)))
        first["eval_episode_return"] = first["eval/episode_reward"]
        progress_fn(0, {**first, "env_steps": 0, "time/compile_s": compile_s})
        clock["start"] = clock["last"] = time.perf_counter()

    def progress(env_steps: int, metrics: dict) -> None:
        now = time.perf_counter()
        metrics["training/sps"] = (env_steps - clock["steps"]) / max(now - clock["last"], 1e-9)
        metrics["training/walltime"] = now - clock["start"]
        metrics["time/compile_s"] = compile_s
        clock["last"], clock["steps"] = now, env_steps
        if progress_fn is not None:
            progress_fn(env_steps, metrics)

    return driver.run(
        step_fn,
        state,
        num_iterations=epochs,
        iteration_of=lambda s: s.iteration // iters,
        env_steps_of=lambda s: s.env_steps,
        progress_fn=progress,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep_checkpoints,
    )
