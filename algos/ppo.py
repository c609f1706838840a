"""Proximal Policy Optimization (Schulman et al. 2017) as pure JAX functions.

Brax's training style (explicit keyword ``train``, ``lax.scan`` loops, flax.struct state, a
tanh-squashed Gaussian policy, running observation normalisation) with PureJaxRL's single-jit
iteration. One iteration, top to bottom (each step a named ``rose_jax.component``)::

    rollout      scan over unroll_length of  policy (normalise obs, sample)  +  sim (vmap env.step)
    normalizer   fold the rollout's observations into the running statistics
    advantage    values of all T+1 observations in one batched pass; GAE once per iteration
    update       scan over num_epochs of (shuffle, scan over num_minibatches of (loss, optimizer))

Shapes: ``T = unroll_length``, ``N = num_envs``, ``B = T * N`` samples per iteration, minibatches
of ``B / num_minibatches``. Everything is float32; nothing syncs with the host inside an
iteration.

Differences from ``brax.training.agents.ppo`` worth knowing (speed, not results quality):
GAE and the value targets are computed once per iteration with the value network as it was
after the rollout (Brax recomputes them in every minibatch); samples are shuffled as single
transitions, not whole unrolls; advantages are the standard GAE ones (``A = vs - v``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import rose_jax
from algos import driver, networks, normalize, ppo_brax, ppo_core, registry
from algos.ppo_core import (  # the pieces both layouts share; re-exported as algos.ppo's
    DATA_FIELDS,
    Learner,
    LossMetrics,
    Metrics,
    Networks,
    PPOConfig,
    PPOParams,
    TrainState,
    Transition,
    check_state,
    eval_key,
    finish,
    global_norm,
    gradient_step,
    init,
    loss_from_outputs,
    make_inference_fn,
    make_networks,
    make_optimizer,
    normalized,
    policy_step,
    program_key,
    update_normalizer,
    update_result,
)
from rose_jax.program import Program, ProgramSpec, RolloutParts, attr_lens
from envs.core import Env, EnvState

# ----------------------------------------------------------------------------------------------
# Training data of rose-jax's layout


class Batch(NamedTuple):
    """Flattened training data of one iteration (leading axis ``B`` or a minibatch of it)."""

    obs: jax.Array  # (B, obs) already normalised
    raw_action: jax.Array  # (B, act)
    log_prob: jax.Array  # (B,) behaviour log-probabilities
    advantage: jax.Array  # (B,)
    target: jax.Array  # (B,) value targets (lambda-returns)


# ----------------------------------------------------------------------------------------------
# The pieces of an iteration in rose-jax's layout (each a named component)


def rollout(
    nets: Networks,
    config: PPOConfig,
    env: Env,
    policy_params: Any,
    normalizer: normalize.NormalizerState,
    env_state: EnvState,
    key: jax.Array,
) -> tuple[EnvState, Transition]:
    """``unroll_length`` steps of every env; returns the last env state and a (T, N, ...) Transition."""
    sim = rose_jax.component("sim")(jax.vmap(env.step))

    def step(env_state: EnvState, step_key: jax.Array) -> tuple[EnvState, Transition]:
        action, raw, logp = policy_step(nets, config, policy_params, normalizer, env_state.obs, step_key)
        next_state = sim(env_state, action)
        transition = Transition(
            env_state.obs, raw, logp, next_state.reward, next_state.done, next_state.truncated
        )
        return next_state, transition

    with rose_jax.component("rollout"):
        return jax.lax.scan(step, env_state, jax.random.split(key, config.unroll_length))


def compute_gae(
    reward: jax.Array,
    value: jax.Array,
    bootstrap_value: jax.Array,
    done: jax.Array,
    truncated: jax.Array,
    discounting: float,
    gae_lambda: float,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over a (T, N) rollout with Brax's episode-end handling.

    Args:
      reward: (T, N) (already scaled); value: (T, N) ``V(obs_t)``; bootstrap_value: (N,)
        ``V(obs_T)`` of the observation after the last step.
      done: (T, N) 1.0 where step t ended an episode (terminal or time limit).
      truncated: (T, N) 1.0 where it ended by the time limit only.

    After a step that ends an episode, ``obs_{t+1}`` is the next episode's first observation.
    On termination the future is worth 0. On truncation (as Brax does) the step itself is
    masked out (advantage 0, target = value) because its true next observation is lost; the
    step before it bootstraps from ``V`` of the last real observation, ``obs_t``.

    Returns:
      ``(target, advantage)``, both (T, N): ``target = advantage + value`` (lambda-returns).
    """
    termination = done * (1.0 - truncated)
    keep = 1.0 - truncated
    next_value = jnp.concatenate([value[1:], bootstrap_value[None]], axis=0)
    delta = (reward + discounting * (1.0 - termination) * next_value - value) * keep
    carry_scale = discounting * gae_lambda * (1.0 - done)

    def backward(acc, xs):
        delta_t, scale_t = xs
        acc = delta_t + scale_t * acc
        return acc, acc

    _, advantage = jax.lax.scan(backward, jnp.zeros_like(bootstrap_value), (delta, carry_scale), reverse=True)
    return advantage + value, advantage


def ppo_loss(
    nets: Networks, config: PPOConfig, params: PPOParams, batch: Batch, key: jax.Array
) -> tuple[jax.Array, LossMetrics]:
    """The PPO loss of ``params`` on a minibatch (``key`` draws the entropy estimate's sample)."""
    dist = networks.tanh_gaussian(nets.policy(params.policy, batch.obs))
    log_prob = networks.log_prob(dist, batch.raw_action)
    value = nets.value(params.value, batch.obs)
    entropy = networks.entropy(dist, key)
    return loss_from_outputs(config, log_prob, batch.log_prob, batch.advantage, value, batch.target, entropy)


def update(
    nets: Networks,
    config: PPOConfig,
    params: PPOParams,
    opt_state: optax.OptState,
    batch: Batch,
    key: jax.Array,
) -> tuple[PPOParams, optax.OptState, LossMetrics, jax.Array]:
    """``num_epochs`` shuffled passes of ``num_minibatches`` Adam steps over ``batch`` (leading axis B).

    Returns the new params and optimizer state, the mean loss metrics and the mean gradient norm.
    """
    step = gradient_step(nets, config, ppo_loss)
    num_samples = config.steps_per_iteration
    minibatch_size = num_samples // config.num_minibatches

    def minibatch_step(learner: Learner, xs: tuple[Batch, jax.Array]):
        return step(learner, *xs)

    def epoch_step(learner: Learner, epoch_key: jax.Array):
        perm_key, loss_key = jax.random.split(epoch_key)
        perm = jax.random.permutation(perm_key, num_samples)
        shuffled = jax.tree.map(
            lambda x: jnp.take(x, perm, axis=0).reshape(
                (config.num_minibatches, minibatch_size) + x.shape[1:]
            ),
            batch,
        )
        return jax.lax.scan(
            minibatch_step, learner, (shuffled, jax.random.split(loss_key, config.num_minibatches))
        )

    with rose_jax.component("update"):
        learner, (metrics, grad_norm) = jax.lax.scan(
            epoch_step, Learner(params, opt_state), jax.random.split(key, config.num_epochs)
        )
    return update_result(learner, metrics, grad_norm)


def split_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO's key schedule: ``state.key -> (rollout_key, update_key, next_key)`` for one iteration.

    The one place it is written: :func:`iteration`, :func:`learn`, :func:`program` and the
    baselines all call it, so a change here reaches all of them.
    """
    rollout_key, update_key, next_key = jax.random.split(key, 3)
    return rollout_key, update_key, next_key


def learn(
    nets: "Networks", config: PPOConfig, state: TrainState, env_state: EnvState, data: Transition
) -> tuple[TrainState, Metrics]:
    """Everything of an iteration after its rollout: normalizer, advantage (GAE), update, counters.

    ``state`` is the TrainState the rollout started from; ``env_state`` and ``data`` are
    :func:`rollout`'s outputs. ``iteration`` is ``rollout`` then ``learn``; other schedules of the
    rollout (e.g. env groups in several processes) reuse this unchanged.
    """
    _, update_key, key = split_keys(state.key)
    normalizer = update_normalizer(config, state.normalizer, data.obs)

    with rose_jax.component("advantage"):
        all_obs = normalized(config, normalizer, jnp.concatenate([data.obs, env_state.obs[None]], axis=0))
        values = nets.value(state.params.value, all_obs)  # (T + 1, N), one batched pass
        target, advantage = compute_gae(
            data.reward * config.reward_scaling,
            values[:-1],
            values[-1],
            data.done,
            data.truncated,
            config.discounting,
            config.gae_lambda,
        )

    def flat(x):
        return x.reshape((config.steps_per_iteration,) + x.shape[2:])

    batch = Batch(
        flat(all_obs[:-1]), flat(data.raw_action), flat(data.log_prob), flat(advantage), flat(target)
    )
    params, opt_state, loss_metrics, grad_norm = update(
        nets, config, state.params, state.opt_state, batch, update_key
    )
    return finish(
        config, state, (params, opt_state), normalizer, env_state, key, data, loss_metrics, grad_norm
    )


def iteration(config: PPOConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    """One PPO iteration ``state -> (state, metrics)``: pure and jittable (jit it once, donate the state).

    With ``config.batch_size`` set it is Brax's training step (:func:`algos.ppo_brax.iteration`).
    """
    if config.brax_layout:
        return ppo_brax.iteration(config, env)
    config.validate(env)
    nets = make_networks(config, env)

    def iterate(state: TrainState) -> tuple[TrainState, Metrics]:
        check_state(config, env, state)
        rollout_key, _, _ = split_keys(state.key)
        env_state, data = rollout(
            nets, config, env, state.params.policy, state.normalizer, state.env_state, rollout_key
        )
        return learn(nets, config, state, env_state, data)

    return iterate


def program(config: PPOConfig, env: Env, *, env_name: str | None = None, env_kwargs: tuple = ()) -> Program:
    """The iteration as a :class:`rose_jax.program.Program` (equal to ``iteration(config, env)``).

    ``collect`` is :func:`rollout`, ``learn`` is :func:`learn`; ``rollout`` parts let the optimizer
    step env groups inside one loop (each group draws the full batch's noise, sliced to its envs).
    ``env_name`` (and ``env_kwargs`` as ``((key, value), ...)``): ``env``'s registry name, so that
    worker processes can rebuild it (``envs.make``, then ``config.action_repeat`` wrapped: pass the
    env :func:`resolve_env` returns); without it the program has no spec.
    """
    if config.brax_layout:
        return ppo_brax.program(config, env)
    config.validate(env)
    nets = make_networks(config, env)
    T, N, A = config.unroll_length, config.num_envs, env.action_size
    sim_fn = rose_jax.component("sim")(jax.vmap(env.step))

    def start(state):
        rollout_key, _, _ = split_keys(state.key)
        return (state.params.policy, state.normalizer), state.env_state, jax.random.split(rollout_key, T)

    def step(consts, env_state, step_key, g, groups):
        policy_params, normalizer = consts
        if groups == 1:
            action, raw, logp = policy_step(nets, config, policy_params, normalizer, env_state.obs, step_key)
        else:
            with rose_jax.component("policy"):
                n = env_state.obs.shape[0]
                dist = networks.tanh_gaussian(
                    nets.policy(policy_params, normalized(config, normalizer, env_state.obs))
                )
                # the full batch's noise, sliced: what networks.sample_raw draws for these envs
                noise = jax.random.normal(step_key, (n * groups, A), dist.loc.dtype)[g * n : (g + 1) * n]
                raw = dist.loc + dist.scale * noise
                action, logp = jnp.tanh(raw), networks.log_prob(dist, raw)
        next_state = sim_fn(env_state, action)
        return next_state, Transition(
            env_state.obs, raw, logp, next_state.reward, next_state.done, next_state.truncated
        )

    def finish(state, env_state, transitions):
        return state.replace(env_state=env_state), (transitions, env_state)

    def collect(state):
        rollout_key, _, _ = split_keys(state.key)
        env_state, transitions = rollout(
            nets, config, env, state.params.policy, state.normalizer, state.env_state, rollout_key
        )
        return finish(state, env_state, transitions)

    def learn_step(state, data):
        # the env state stays the one collect put into ``state`` (in processes mode a resident-env
        # marker), not the one carried in ``data``
        transitions, env_state = data
        new_state, metrics = learn(nets, config, state, env_state, transitions)
        return new_state.replace(env_state=state.env_state), metrics

    # workers rebuild the env train runs on: by name, then action_repeat wrapped as resolve_env does
    env_spec = (
        ("envs:make", env_name, tuple(env_kwargs))
        if config.action_repeat == 1
        else ("algos.ppo:make_env", env_name, tuple(env_kwargs) + (("action_repeat", config.action_repeat),))
    )
    spec = None if env_name is None else ProgramSpec("algos.ppo:program", (("config", config),), env=env_spec)
    return Program(
        name="ppo",
        num_envs=N,
        collect=collect,
        learn=learn_step,
        env=attr_lens("env_state"),
        data_env_axis=(1, 0),  # transitions (T, N, ...), final env state (N, ...)
        rollout=RolloutParts(T, start, step, finish),
        spec=spec,
        env_name=env.name,
    )


def epoch(
    config: PPOConfig, env: Env, iterations: int, num_eval_envs: int = 128, eval_length: int | None = None
) -> Callable[[TrainState], tuple[TrainState, dict]]:
    """Pure ``TrainState -> (TrainState, metrics dict)``: ``iterations`` PPO iterations in a
    ``lax.scan``, then an evaluation of the deterministic policy (Brax's train loop between two
    progress reports), reported as ``eval_episode_return``.

    The evaluation runs ``num_eval_envs`` fresh envs for ``eval_length`` steps (default
    ``env.episode_length``) with a key folded from the state's key and iteration counter, so it
    consumes nothing the training uses: training results do not depend on it. Epoch metrics: the
    last iteration's :class:`Metrics`, with ``reward`` averaged and ``episodes`` summed over the epoch.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"ppo.epoch: iterations must be a positive int, got {iterations!r}")
    one = iteration(config, env)
    length = env.episode_length if eval_length is None else eval_length
    evaluate_fn = make_evaluator(ppo_core.evaluator_key(config), env, int(num_eval_envs), int(length))

    def run_epoch(state: TrainState) -> tuple[TrainState, dict]:
        state, ms = jax.lax.scan(lambda s, _: one(s), state, None, length=iterations)
        out = {k: v[-1] for k, v in ms._asdict().items()}
        out["reward"], out["episodes"] = jnp.mean(ms.reward), jnp.sum(ms.episodes)
        with rose_jax.component("evaluate"):
            out["eval_episode_return"] = evaluate_fn(state.params, state.normalizer, eval_key(state))
        return state, out

    return run_epoch


def jitted_iteration(config: PPOConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    """``jax.jit(iteration(config, env))`` donating the state (except on CPU, which cannot donate).

    Cached: configs that differ only in ``num_timesteps`` or ``seed`` (which the iteration does
    not read) share one compiled program.
    """
    return _jitted_iteration(program_key(config), env)


@functools.lru_cache(maxsize=16)
def _jitted_iteration(config: PPOConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    donate = (0,) if jax.default_backend() != "cpu" else ()  # CPU would only warn that it cannot
    return jax.jit(iteration(config, env), donate_argnums=donate)


# ----------------------------------------------------------------------------------------------
# Acting and evaluation


@functools.lru_cache(maxsize=32)
def make_evaluator(config: PPOConfig, env: Env, num_envs: int, length: int) -> Callable[..., jax.Array]:
    """A jitted ``(params, normalizer, key) -> mean first-episode return`` of the deterministic policy.

    Runs ``num_envs`` fresh environments for ``length`` steps; each env's return counts the
    rewards of its first episode (all of it if the episode ends within ``length`` steps).
    """
    if num_envs <= 0 or length <= 0:
        raise ValueError(f"evaluate: num_envs and length must be positive, got {num_envs}, {length}")
    act = make_inference_fn(config, env)

    def run(params: PPOParams, normalizer: normalize.NormalizerState, key: jax.Array) -> jax.Array:
        env_state = jax.vmap(env.reset)(jax.random.split(key, num_envs))

        def step(carry, _):
            env_state, returns = carry
            active = env_state.episodes == 0
            env_state = jax.vmap(env.step)(env_state, act(params, normalizer, env_state.obs))
            return (env_state, returns + jnp.where(active, env_state.reward, 0.0)), None

        (_, returns), _ = jax.lax.scan(step, (env_state, jnp.zeros((num_envs,), jnp.float32)), length=length)
        return jnp.mean(returns)

    return jax.jit(run)


def evaluate(
    config: PPOConfig,
    env: Env,
    state: TrainState,
    key: jax.Array,
    num_envs: int = 64,
    length: int | None = None,
) -> float:
    """Mean first-episode return of the deterministic policy over ``num_envs`` envs, ``length`` steps
    (default: ``env.episode_length``, so every episode is complete)."""
    length = env.episode_length if length is None else length
    fn = make_evaluator(program_key(config), env, int(num_envs), int(length))
    return float(fn(state.params, state.normalizer, key))


# ----------------------------------------------------------------------------------------------
# The host driver


def train(
    env: Env | str, config: PPOConfig | None = None, **keywords: Any
) -> tuple[TrainState, list[dict[str, float]]]:
    """Train PPO on ``env`` for ``ceil(num_timesteps / (num_envs * unroll_length))`` iterations.

    ``env`` is an :class:`envs.core.Env` or a registry name for ``envs.make``. Hyperparameters
    are ``config`` (a :class:`PPOConfig`, default ``PPOConfig()``) with the other ``keywords`` (its
    field names, Brax-style: ``train(env, num_timesteps=..., num_envs=...)``); an unknown
    keyword is a one-line TypeError listing the valid ones. The loop's keywords are ``progress_fn``,
    ``checkpoint_dir``, ``checkpoint_every``, ``keep_checkpoints`` (default 3) and ``resume``
    (``algos.registry.TRAIN_LOOP_KEYWORDS``). ``progress_fn(env_steps, metrics)``
    is called after every iteration with that iteration's :class:`Metrics` as a dict of floats
    (it may raise ``algos.driver.StopTraining`` to stop after the iteration in flight, with a
    checkpoint). With ``checkpoint_dir``, the state is saved (atomically, named by env steps)
    every ``checkpoint_every`` iterations and at the end, keeping the ``keep_checkpoints`` newest
    and the best (None: all); ``resume=True`` continues from the latest checkpoint there, to
    bitwise the same result as an uninterrupted run.

    Returns:
      ``(final_state, metrics)``: metrics of the iterations run by this call, in order.
    """
    return registry.train_with_keywords(PPOConfig, train_with_config, env, config, keywords, "ppo.train")


def train_with_config(
    config: PPOConfig,
    env: Env | str,
    *,
    progress_fn: driver.ProgressFn | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int | None = driver.DEFAULT_KEEP,
    resume: bool = False,
    make_step: Callable[[TrainState], Callable[[TrainState], tuple[TrainState, Any]]] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """:func:`train` with the hyperparameters as one :class:`PPOConfig`.

    ``make_step(state)``, if given, returns the step the loop runs instead of the jitted
    iteration (e.g. a ``rose_jax.optimize`` plan of :func:`program` searched on that state); it
    must compute the same ``state -> (state, metrics)``. With ``config.num_evals`` set the loop
    runs epochs, so it must return the step of :func:`eval_epoch` (``Algo.unit_program`` says
    which unit to build).
    """
    env = ppo_brax.resolve_env(config, env)  # a name, a Brax env; episode_length, action_repeat
    if config.num_evals is not None:  # make_step then builds the epoch's step (see eval_epoch)
        return ppo_brax.train_with_evals(
            config,
            env,
            iteration(config, env),
            progress_fn=progress_fn,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            resume=resume,
            make_step=make_step,
        )
    config.validate(env)
    driver.check_loop_args(checkpoint_dir, checkpoint_every)
    state = init(config, env, jax.random.PRNGKey(config.seed))
    state, _ = driver.maybe_resume(checkpoint_dir, state, resume)
    step_fn = jitted_iteration(config, env) if make_step is None else make_step(state)
    return driver.run(
        step_fn,
        state,
        num_iterations=config.num_iterations,
        iteration_of=lambda s: s.iteration,
        env_steps_of=lambda s: s.env_steps,
        progress_fn=progress_fn,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep_checkpoints,
    )


def make_env(name: str, *, action_repeat: int = 1, **kwargs: Any) -> Env:
    """``envs.make(name, **kwargs)`` stepping each action ``action_repeat`` times: how a worker
    process rebuilds the env of a :func:`program` whose config repeats actions."""
    import envs

    return ppo_brax.with_action_repeat(envs.make(name, **kwargs), action_repeat)


def resolve_env(config: PPOConfig, env: Env | str | Any) -> Env:
    """The env :func:`train` runs on: a registry name or Brax env built, ``action_repeat`` wrapped
    (:func:`algos.ppo_brax.resolve_env`). Call it once: each call wraps ``action_repeat`` again."""
    return ppo_brax.resolve_env(config, env)


def eval_epoch(config: PPOConfig, env: Env | str) -> Callable[[TrainState], tuple[TrainState, dict]]:
    """With ``config.num_evals`` set: what ``train`` runs between two progress reports (Brax's run
    shape), ``config.iterations_per_eval`` iterations then the evaluation, as a pure function."""
    resolved = ppo_brax.resolve_env(config, env)
    return ppo_brax.eval_epoch(config, resolved, iteration(config, resolved))


# Env steps in the unit the plan search measures (``search_unit``): 4 iterations of Brax's published
# PPO ant config (327,680 env steps each), about 1.5 s on an H100 (0.7-1.0M env-steps/s, 2026-12-07),
# where the published epoch of 17 iterations and an evaluation takes about 6.8 s and a search times
# tens of units. A module constant, not a config field: it shapes only what the search measures,
# never what train computes.
SEARCH_UNIT_ENV_STEPS = 4 * 327_680


def search_unit(config: PPOConfig, env: Env | str):
    """What ``rose-jax train --optimize`` searches on instead of the whole epoch (Brax's run shape,
    ``num_evals`` set: :func:`eval_epoch`), or None (the unit itself): where an epoch has more than
    :data:`SEARCH_UNIT_ENV_STEPS` env steps, the same epoch program with ``k`` of its iterations and
    its evaluation shortened by the same factor (``registry.scaled_eval_steps``), so each part keeps
    the share of the unit it has in the epoch and the plan found on it applies to the epoch by name
    (transforms address loops and components, not scan lengths), as SAC's
    (:func:`algos.sac.search_unit`). Without ``num_evals`` the unit is one iteration: None."""
    if config.num_evals is None:
        return None
    full = config.iterations_per_eval
    # at least 2 iterations: a 1-trip scan is not the epoch's loop (candidates skip it, an unroll
    # is a no-op on it, XLA may fold it away), so a plan found on it would not have been tried there
    k = max(registry.SEARCH_UNIT_MIN_ITERATIONS, SEARCH_UNIT_ENV_STEPS // config.env_steps_per_iteration)
    if k >= full:
        return None
    resolved = ppo_brax.resolve_env(config, env)  # once: it wraps action_repeat at every call
    episode = int(resolved.episode_length)
    eval_steps = registry.scaled_eval_steps(episode, k, full) if config.num_evals else None
    fn = ppo_brax.epoch(config, resolved, iteration(config, resolved), k, eval_steps)
    return registry.SearchUnit(fn, k, full, eval_steps, episode if eval_steps is not None else None)


# train's keywords for help(), IDEs and inspect: (env, config=None, *, progress_fn, ..., **overrides)
train.__signature__ = registry.train_signature(train_with_config)


__all__ = [
    "DATA_FIELDS",
    "Batch",
    "LossMetrics",
    "Metrics",
    "Networks",
    "PPOConfig",
    "PPOParams",
    "TrainState",
    "Transition",
    "check_state",
    "compute_gae",
    "epoch",
    "eval_epoch",
    "evaluate",
    "global_norm",
    "init",
    "iteration",
    "jitted_iteration",
    "make_env",
    "loss_from_outputs",
    "make_evaluator",
    "make_inference_fn",
    "make_networks",
    "make_optimizer",
    "policy_step",
    "ppo_loss",
    "program",
    "program_key",
    "resolve_env",
    "rollout",
    "search_unit",
    "split_keys",
    "train",
    "train_with_config",
    "update",
]
