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

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

import rose_jax
from algos import driver, normalize, networks
from rose_jax.program import Program, ProgramSpec, RolloutParts, attr_lens
from envs.core import Env, EnvState, mean_finished_return

# ----------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters (defaults learn the pure-JAX classics on a CPU in about a minute).

    Attributes:
      num_timesteps: total environment steps of :func:`train` (rounded up to whole iterations).
      num_envs: environments stepped in parallel (N).
      unroll_length: steps per environment per iteration (T).
      num_minibatches: minibatches per epoch; ``num_envs * unroll_length`` must divide by it.
      num_epochs: passes over the iteration's data (Brax's ``num_updates_per_batch``).
      learning_rate: Adam step size.
      discounting: gamma.
      gae_lambda: GAE lambda.
      clipping_epsilon: PPO ratio clip.
      entropy_cost: weight of the (negative) entropy bonus.
      value_cost: weight of the value loss ``0.5 * mean((target - v)^2)``; 0.5 is Brax's.
      max_grad_norm: clip gradients to this global norm (None: no clipping).
      reward_scaling: rewards are multiplied by this before GAE.
      normalize_observations: keep running mean/std of observations and standardise them.
      normalize_advantage: standardise advantages within each minibatch (Brax's default).
      policy_hidden_sizes / value_hidden_sizes: MLP widths.
      activation: a ``flax.linen`` activation name (``"swish"``, ``"tanh"``, ``"relu"``, ...).
      seed: PRNG seed of :func:`train`.

    Brax's keywords (``brax.training.agents.ppo.train``, same names and meaning):
      batch_size: set -> Brax's data layout and schedule (:mod:`algos.ppo_brax`): one iteration
        collects ``batch_size * num_minibatches // num_envs`` sequential unrolls of
        ``unroll_length`` steps of every env and trains on minibatches of ``batch_size``
        whole unrolls, GAE computed per unroll inside the loss. None: rose-jax's schedule (one
        unroll of every env per iteration, GAE once, transitions shuffled).
      num_updates_per_batch: Brax's name for ``num_epochs`` (when set, it is ``num_epochs``).
      action_repeat: physics steps per agent step (the action is repeated, rewards summed).
      episode_length: the env's time limit in physics steps; used when ``train`` builds the env
        (a registry name or a Brax env object); an ``Env`` must already have it.
      num_evals: evaluations over the run (Brax's: one at step 0 when > 1, then after each of
        ``max(num_evals - 1, 1)`` epochs); None: no evaluation, a progress report per iteration.
      num_eval_envs: envs of each evaluation (one episode each).
      deterministic_eval: evaluate ``tanh(mean)`` instead of sampled actions.
    """

    num_timesteps: int = 1_000_000
    num_envs: int = 64
    unroll_length: int = 32
    num_minibatches: int = 4
    num_epochs: int = 4
    learning_rate: float = 1e-3
    discounting: float = 0.99
    gae_lambda: float = 0.95
    clipping_epsilon: float = 0.2
    entropy_cost: float = 1e-3
    value_cost: float = 0.5
    max_grad_norm: float | None = 1.0
    reward_scaling: float = 0.1
    normalize_observations: bool = True
    normalize_advantage: bool = True
    policy_hidden_sizes: Sequence[int] = (64, 64)
    value_hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    seed: int = 0
    batch_size: int | None = None
    num_updates_per_batch: int | None = None
    action_repeat: int = 1
    episode_length: int | None = None
    num_evals: int | None = None
    num_eval_envs: int = 128
    deterministic_eval: bool = False

    def __post_init__(self):
        def fail(name, value, need):
            raise ValueError(f"PPOConfig.{name} must be {need}, got {value!r}")

        def positive_int(value):
            return isinstance(value, int) and not isinstance(value, bool) and value > 0

        for name in ("batch_size", "num_updates_per_batch", "episode_length"):
            value = getattr(self, name)
            if value is not None and not positive_int(value):
                fail(name, value, "None or a positive int")
        for name in ("action_repeat", "num_eval_envs"):
            if not positive_int(getattr(self, name)):
                fail(name, getattr(self, name), "a positive int")
        if self.num_evals is not None and not (positive_int(self.num_evals) or self.num_evals == 0):
            fail("num_evals", self.num_evals, "None or a non-negative int")
        if not isinstance(self.deterministic_eval, bool):
            fail("deterministic_eval", self.deterministic_eval, "a bool")
        if self.num_updates_per_batch is not None:  # Brax's name for num_epochs
            default_epochs = type(self).__dataclass_fields__["num_epochs"].default
            if self.num_epochs not in (default_epochs, self.num_updates_per_batch):
                raise ValueError(
                    f"PPOConfig: num_epochs={self.num_epochs} and num_updates_per_batch="
                    f"{self.num_updates_per_batch} disagree (the same setting); give one of them"
                )
            object.__setattr__(self, "num_epochs", self.num_updates_per_batch)

        for name in ("num_timesteps", "num_envs", "unroll_length", "num_minibatches", "num_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail(name, value, "a positive int")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            fail("seed", self.seed, "an int")
        for name in ("learning_rate", "clipping_epsilon", "reward_scaling"):
            value = getattr(self, name)
            if not _is_real(value) or not value > 0:
                fail(name, value, "a positive number")
        for name in ("discounting", "gae_lambda"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 <= value <= 1:
                fail(name, value, "a number in [0, 1]")
        for name in ("entropy_cost", "value_cost"):
            value = getattr(self, name)
            if not _is_real(value) or not value >= 0:
                fail(name, value, "a non-negative number")
        if self.max_grad_norm is not None and (
            not _is_real(self.max_grad_norm) or not self.max_grad_norm > 0
        ):
            fail("max_grad_norm", self.max_grad_norm, "None or a positive number")
        for name in ("policy_hidden_sizes", "value_hidden_sizes"):
            value = getattr(self, name)
            try:
                sizes = tuple(value)
            except TypeError:
                fail(name, value, "a sequence of positive ints")
            if any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
                fail(name, value, "a sequence of positive ints")
            object.__setattr__(self, name, sizes)  # tuples keep the config hashable
        if not isinstance(self.activation, str) or not callable(getattr(nn, self.activation, None)):
            fail("activation", self.activation, "a flax.linen activation name such as 'swish' or 'tanh'")
        if self.batch_size is not None:
            if (self.batch_size * self.num_minibatches) % self.num_envs:
                raise ValueError(
                    f"PPOConfig: batch_size * num_minibatches = {self.batch_size} * {self.num_minibatches} "
                    f"must be divisible by num_envs = {self.num_envs} (as in Brax's ppo.train)"
                )
        else:
            batch = self.num_envs * self.unroll_length
            if batch % self.num_minibatches:
                raise ValueError(
                    f"PPOConfig: num_envs * unroll_length = {self.num_envs} * {self.unroll_length} = "
                    f"{batch} is not divisible by num_minibatches = {self.num_minibatches}"
                )

    @property
    def brax_layout(self) -> bool:
        """True when ``batch_size`` is set: Brax's data layout and schedule (:mod:`algos.ppo_brax`)."""
        return self.batch_size is not None

    @property
    def steps_per_iteration(self) -> int:
        """Transitions (agent steps) per iteration: ``num_envs * unroll_length``, or in Brax's
        layout ``batch_size * num_minibatches * unroll_length``."""
        if self.batch_size is not None:
            return self.batch_size * self.num_minibatches * self.unroll_length
        return self.num_envs * self.unroll_length

    @property
    def env_steps_per_iteration(self) -> int:
        """Physics steps per iteration: ``steps_per_iteration * action_repeat`` (Brax's count)."""
        return self.steps_per_iteration * self.action_repeat

    @property
    def iterations_per_eval(self) -> int:
        """Iterations between two evaluations when ``num_evals`` is set (Brax's rounding):
        ``ceil(num_timesteps / (max(num_evals - 1, 1) * env_steps_per_iteration))``."""
        evals = max((self.num_evals or 0) - 1, 1)
        return math.ceil(self.num_timesteps / (evals * self.env_steps_per_iteration))

    @property
    def num_iterations(self) -> int:
        """Iterations of :func:`train`: ``ceil(num_timesteps / env_steps_per_iteration)``, or with
        ``num_evals`` Brax's ``max(num_evals - 1, 1) * iterations_per_eval``."""
        if self.num_evals is not None:
            return max(self.num_evals - 1, 1) * self.iterations_per_eval
        return math.ceil(self.num_timesteps / self.env_steps_per_iteration)

    def validate(self, env: Env) -> None:
        """Raise a one-line ValueError if ``env`` cannot be trained with this config."""
        missing = [f for f in ("observation_size", "action_size", "reset", "step") if not hasattr(env, f)]
        if missing:
            raise ValueError(
                f"PPO: env must be an envs.core.Env, got {type(env).__name__} (missing {missing})"
            )
        for name in ("observation_size", "action_size"):
            value = getattr(env, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"PPO: env {getattr(env, 'name', '?')!r} has {name}={value!r}, expected a positive int"
                )


def program_key(config: PPOConfig) -> PPOConfig:
    """``config`` without the fields compiled programs do not read (a cache key for them)."""
    return dataclasses.replace(config, num_timesteps=1, seed=0)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ----------------------------------------------------------------------------------------------
# State


class PPOParams(NamedTuple):
    """Network parameters: ``policy`` maps obs -> ``2 * action_size`` logits; ``value`` obs -> 1."""

    policy: Any
    value: Any


@struct.dataclass
class TrainState:
    """Everything an iteration reads and writes; a checkpoint is exactly this pytree.

    ``env_state`` leaves have a leading ``num_envs`` axis; ``key`` is a raw ``uint32[2]`` key.
    """

    params: PPOParams
    opt_state: optax.OptState
    normalizer: normalize.NormalizerState
    env_state: EnvState
    key: jax.Array
    env_steps: jax.Array  # () int32, environment steps so far (all envs together)
    iteration: jax.Array  # () int32, iterations done


class Transition(NamedTuple):
    """One rollout step of every env; under the rollout scan each leaf gets a leading T axis.

    Shapes (per step): obs ``(N, obs)`` (raw, the obs the action was chosen from), raw_action
    ``(N, act)`` (pre-tanh sample), log_prob/reward/done/truncated ``(N,)`` float32.
    """

    obs: jax.Array
    raw_action: jax.Array
    log_prob: jax.Array
    reward: jax.Array
    done: jax.Array
    truncated: jax.Array


class Batch(NamedTuple):
    """Flattened training data of one iteration (leading axis ``B`` or a minibatch of it)."""

    obs: jax.Array  # (B, obs) already normalised
    raw_action: jax.Array  # (B, act)
    log_prob: jax.Array  # (B,) behaviour log-probabilities
    advantage: jax.Array  # (B,)
    target: jax.Array  # (B,) value targets (lambda-returns)


class LossMetrics(NamedTuple):
    total_loss: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array


class Metrics(NamedTuple):
    """Scalars of one iteration (losses averaged over all minibatch steps)."""

    env_steps: jax.Array  # int32, after this iteration
    iteration: jax.Array  # int32, after this iteration
    reward: jax.Array  # mean reward per env step in this rollout (unscaled)
    episode_return: jax.Array  # mean last finished episode return over envs that finished one (NaN if none)
    episodes: jax.Array  # episodes finished during this rollout
    total_loss: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    grad_norm: jax.Array


# ----------------------------------------------------------------------------------------------
# Networks


class Networks(NamedTuple):
    """Pure apply functions: ``policy(params, obs) -> logits``, ``value(params, obs) -> (...,)``."""

    policy_init: Callable[[jax.Array, jax.Array], Any]
    policy: Callable[[Any, jax.Array], jax.Array]
    value_init: Callable[[jax.Array, jax.Array], Any]
    value: Callable[[Any, jax.Array], jax.Array]


def make_networks(config: PPOConfig, env: Env) -> Networks:
    """The policy and value MLPs of ``config`` for ``env`` (inputs: normalised obs)."""
    policy = networks.MLP(config.policy_hidden_sizes, 2 * env.action_size, config.activation)
    value = networks.MLP(config.value_hidden_sizes, 1, config.activation)
    return Networks(
        policy_init=policy.init,
        policy=policy.apply,
        value_init=value.init,
        value=lambda params, obs: value.apply(params, obs)[..., 0],
    )


def make_optimizer(config: PPOConfig) -> optax.GradientTransformation:
    """Adam, after global-norm clipping when ``config.max_grad_norm`` is set."""
    adam = optax.adam(config.learning_rate)
    if config.max_grad_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adam)


def init(config: PPOConfig, env: Env, key: jax.Array) -> TrainState:
    """Fresh parameters, optimizer state, normalizer and ``config.num_envs`` reset environments.

    ``key`` is a raw ``uint32[2]`` PRNG key (``jax.random.PRNGKey(seed)``). Jitted (compiled
    once per config and env), so it is cheap to call again.
    """
    config.validate(env)
    if jnp.shape(key) != (2,) or jnp.asarray(key).dtype != jnp.uint32:
        raise ValueError(
            f"PPO init: key must be a raw uint32[2] key from jax.random.PRNGKey, got {jnp.shape(key)}"
        )
    return _jitted_init(program_key(config), env)(key)


@functools.lru_cache(maxsize=32)
def _jitted_init(config: PPOConfig, env: Env) -> Callable[[jax.Array], TrainState]:
    return jax.jit(functools.partial(_init, config, env))


def _init(config: PPOConfig, env: Env, key: jax.Array) -> TrainState:
    nets = make_networks(config, env)
    policy_key, value_key, env_key, key = jax.random.split(key, 4)
    dummy_obs = jnp.zeros((1, env.observation_size), jnp.float32)
    params = PPOParams(
        policy=nets.policy_init(policy_key, dummy_obs), value=nets.value_init(value_key, dummy_obs)
    )
    env_state = jax.vmap(env.reset)(jax.random.split(env_key, config.num_envs))
    return TrainState(
        params=params,
        opt_state=make_optimizer(config).init(params),
        normalizer=normalize.init(env.observation_size),
        env_state=env_state,
        key=key,
        env_steps=jnp.zeros((), jnp.int32),
        iteration=jnp.zeros((), jnp.int32),
    )


# ----------------------------------------------------------------------------------------------
# The pieces of an iteration (each a named component)


def _normalized(config: PPOConfig, normalizer: normalize.NormalizerState, obs: jax.Array) -> jax.Array:
    return normalize.apply(normalizer, obs) if config.normalize_observations else obs


@rose_jax.component("policy")
def policy_step(
    nets: Networks,
    config: PPOConfig,
    policy_params: Any,
    normalizer: normalize.NormalizerState,
    obs: jax.Array,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample actions for a batch of raw observations ``(N, obs)``.

    Returns ``(action (N, act) in [-1, 1], raw_action (N, act) pre-tanh, log_prob (N,))``.
    """
    dist = networks.tanh_gaussian(nets.policy(policy_params, _normalized(config, normalizer, obs)))
    raw = networks.sample_raw(dist, key)
    return jnp.tanh(raw), raw, networks.log_prob(dist, raw)


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


def loss_from_outputs(
    config: PPOConfig,
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantage: jax.Array,
    value: jax.Array,
    target: jax.Array,
    entropy: jax.Array,
) -> tuple[jax.Array, LossMetrics]:
    """The clipped PPO objective from network outputs; all inputs (M,) for a minibatch of M.

    ``policy_loss = -mean(min(r A, clip(r, 1-eps, 1+eps) A))`` with ``r = exp(log_prob - old)``
    (``A`` standardised in the minibatch if ``config.normalize_advantage``);
    ``value_loss = value_cost * 0.5 * mean((target - value)^2)``;
    ``entropy_loss = -entropy_cost * mean(entropy)``; total = their sum.
    """
    if config.normalize_advantage:
        advantage = (advantage - jnp.mean(advantage)) / (jnp.std(advantage) + 1e-8)
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    eps = config.clipping_epsilon
    surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * advantage)
    policy_loss = -jnp.mean(surrogate)
    value_loss = config.value_cost * 0.5 * jnp.mean(jnp.square(target - value))
    mean_entropy = jnp.mean(entropy)
    entropy_loss = -config.entropy_cost * mean_entropy
    total = policy_loss + value_loss + entropy_loss
    return total, LossMetrics(
        total_loss=total,
        policy_loss=policy_loss,
        value_loss=value_loss,
        entropy_loss=entropy_loss,
        entropy=mean_entropy,
        approx_kl=jnp.mean((ratio - 1.0) - log_ratio),
        clip_fraction=jnp.mean((jnp.abs(ratio - 1.0) > eps).astype(jnp.float32)),
    )


def ppo_loss(
    nets: Networks, config: PPOConfig, params: PPOParams, batch: Batch, key: jax.Array
) -> tuple[jax.Array, LossMetrics]:
    """The PPO loss of ``params`` on a minibatch (``key`` draws the entropy estimate's sample)."""
    dist = networks.tanh_gaussian(nets.policy(params.policy, batch.obs))
    log_prob = networks.log_prob(dist, batch.raw_action)
    value = nets.value(params.value, batch.obs)
    entropy = networks.entropy(dist, key)
    return loss_from_outputs(config, log_prob, batch.log_prob, batch.advantage, value, batch.target, entropy)


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


class _Learner(NamedTuple):
    """Carry of the update loops."""

    params: PPOParams
    opt_state: optax.OptState


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
    optimizer = make_optimizer(config)
    loss_and_grad = jax.value_and_grad(functools.partial(ppo_loss, nets, config), has_aux=True)
    num_samples = config.steps_per_iteration
    minibatch_size = num_samples // config.num_minibatches

    def minibatch_step(learner: _Learner, xs: tuple[Batch, jax.Array]):
        minibatch, loss_key = xs
        with rose_jax.component("loss"):
            (_, metrics), grads = loss_and_grad(learner.params, minibatch, loss_key)
        with rose_jax.component("optimizer"):
            updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
            params = optax.apply_updates(learner.params, updates)
        return _Learner(params, opt_state), (metrics, global_norm(grads))

    def epoch_step(learner: _Learner, epoch_key: jax.Array):
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
            epoch_step, _Learner(params, opt_state), jax.random.split(key, config.num_epochs)
        )
    return learner.params, learner.opt_state, jax.tree.map(jnp.mean, metrics), jnp.mean(grad_norm)


def check_state(config: PPOConfig, env: Env, state: TrainState) -> None:
    obs_shape = tuple(state.env_state.obs.shape)
    want = (config.num_envs, env.observation_size)
    if obs_shape != want:
        raise ValueError(
            f"PPO: state.env_state.obs has shape {obs_shape}, expected {want} "
            f"(num_envs={config.num_envs}, env {env.name!r} observation_size={env.observation_size}); "
            f"was the state made by init() with another config or env?"
        )
    nets = make_networks(config, env)
    dummy_key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    dummy_obs = jax.ShapeDtypeStruct((1, env.observation_size), jnp.float32)
    for name, make in (("policy", nets.policy_init), ("value", nets.value_init)):
        want = jax.tree.map(jnp.shape, jax.eval_shape(make, dummy_key, dummy_obs))
        got = jax.tree.map(jnp.shape, getattr(state.params, name))
        if got != want:
            raise ValueError(
                f"PPO: state.params.{name} has shapes {got}, but this config and env {env.name!r} "
                f"(observation_size={env.observation_size}, action_size={env.action_size}) need {want}; "
                f"was the state made by init() with another config or env?"
            )


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
    normalizer = state.normalizer
    if config.normalize_observations:
        with rose_jax.component("normalizer"):
            normalizer = normalize.update(normalizer, data.obs)

    with rose_jax.component("advantage"):
        all_obs = _normalized(config, normalizer, jnp.concatenate([data.obs, env_state.obs[None]], axis=0))
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

    env_steps = state.env_steps + config.env_steps_per_iteration
    episode_return = mean_finished_return(env_state)
    metrics = Metrics(
        env_steps=env_steps,
        iteration=state.iteration + 1,
        reward=jnp.mean(data.reward),
        episode_return=episode_return,
        episodes=jnp.sum(data.done),
        grad_norm=grad_norm,
        **loss_metrics._asdict(),
    )
    new_state = TrainState(
        params=params,
        opt_state=opt_state,
        normalizer=normalizer,
        env_state=env_state,
        key=key,
        env_steps=env_steps,
        iteration=state.iteration + 1,
    )
    return new_state, metrics


def iteration(config: PPOConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    """One PPO iteration ``state -> (state, metrics)``: pure and jittable (jit it once, donate the state).

    With ``config.batch_size`` set it is Brax's training step (:func:`algos.ppo_brax.iteration`).
    """
    if config.brax_layout:
        from algos import ppo_brax

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
    worker processes can rebuild it (``envs.make``); without it the program has no spec.
    """
    if config.brax_layout:
        from algos import ppo_brax

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
                    nets.policy(policy_params, _normalized(config, normalizer, env_state.obs))
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

    spec = None if env_name is None else ProgramSpec(
        "algos.ppo:program", (("config", config),), env=("envs:make", env_name, tuple(env_kwargs))
    )
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


_EVAL_SALT = 0x5E7A1  # eval keys are fold_in(state.key, salt): training never consumes them


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
    evaluate_fn = make_evaluator(program_key(config), env, int(num_eval_envs), int(length))

    def run_epoch(state: TrainState) -> tuple[TrainState, dict]:
        state, ms = jax.lax.scan(lambda s, _: one(s), state, None, length=iterations)
        out = {k: v[-1] for k, v in ms._asdict().items()}
        out["reward"], out["episodes"] = jnp.mean(ms.reward), jnp.sum(ms.episodes)
        with rose_jax.component("evaluate"):
            eval_key = jax.random.fold_in(jax.random.fold_in(state.key, _EVAL_SALT), state.iteration)
            out["eval_episode_return"] = evaluate_fn(state.params, state.normalizer, eval_key)
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


def make_inference_fn(config: PPOConfig, env: Env) -> Callable[..., jax.Array]:
    """``act(params, normalizer, obs, key=None, deterministic=True) -> action (..., act) in [-1, 1]``.

    ``params`` is a :class:`PPOParams` (e.g. ``state.params``); ``obs`` is raw ``(..., obs)``.
    A stochastic action needs ``key``.
    """
    nets = make_networks(config, env)

    def act(
        params: PPOParams,
        normalizer: normalize.NormalizerState,
        obs: jax.Array,
        key: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        dist = networks.tanh_gaussian(nets.policy(params.policy, _normalized(config, normalizer, obs)))
        if deterministic:
            return networks.mode(dist)
        if key is None:
            raise ValueError("act: deterministic=False needs a PRNG key")
        return jnp.tanh(networks.sample_raw(dist, key))

    return act


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
    env: Env | str,
    config: PPOConfig | None = None,
    *,
    progress_fn: driver.ProgressFn | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int | None = driver.DEFAULT_KEEP,
    resume: bool = False,
    **overrides: Any,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Train PPO on ``env`` for ``ceil(num_timesteps / (num_envs * unroll_length))`` iterations.

    ``env`` is an :class:`envs.core.Env` or a registry name for ``envs.make``. Hyperparameters
    are ``config`` (a :class:`PPOConfig`, default ``PPOConfig()``) with ``overrides`` (its field
    names as keywords, Brax-style: ``train(env, num_timesteps=..., num_envs=...)``); an unknown
    keyword is a one-line TypeError listing the valid ones. ``progress_fn(env_steps, metrics)``
    is called after every iteration with that iteration's :class:`Metrics` as a dict of floats
    (it may raise ``algos.driver.StopTraining`` to stop after the iteration in flight, with a
    checkpoint). With ``checkpoint_dir``, the state is saved (atomically, named by env steps)
    every ``checkpoint_every`` iterations and at the end, keeping the ``keep_checkpoints`` newest
    and the best (None: all); ``resume=True`` continues from the latest checkpoint there, to
    bitwise the same result as an uninterrupted run.

    Returns:
      ``(final_state, metrics)``: metrics of the iterations run by this call, in order.
    """
    from algos import registry

    config = registry.config_with(PPOConfig, config, overrides, "ppo.train")
    return train_with_config(
        config,
        env,
        progress_fn=progress_fn,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        resume=resume,
    )


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
    must compute the same ``state -> (state, metrics)``.
    """
    from algos import ppo_brax

    env = ppo_brax.resolve_env(config, env)  # a name, a Brax env; episode_length, action_repeat
    if config.num_evals is not None:
        if make_step is not None:
            raise ValueError("ppo.train_with_config: make_step is not supported with num_evals set")
        return ppo_brax.train_with_evals(
            config,
            env,
            progress_fn=progress_fn,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            resume=resume,
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


__all__ = [
    "Batch",
    "LossMetrics",
    "Metrics",
    "Networks",
    "PPOConfig",
    "PPOParams",
    "TrainState",
    "Transition",
    "compute_gae",
    "epoch",
    "evaluate",
    "init",
    "iteration",
    "jitted_iteration",
    "loss_from_outputs",
    "make_evaluator",
    "make_inference_fn",
    "make_networks",
    "make_optimizer",
    "policy_step",
    "ppo_loss",
    "rollout",
    "train",
    "train_with_config",
    "update",
]
