"""The pieces of PPO that both of its data layouts share (:mod:`algos.ppo`, :mod:`algos.ppo_brax`).

Configuration (:class:`PPOConfig`), the state pytrees, the networks and optimizer, ``init``, the
policy step, the clipped PPO loss, one minibatch gradient step, the end of an iteration (new
state and metrics), the evaluation key and the inference function. This module imports neither
layout: :mod:`algos.ppo` (rose-jax's layout and the host driver) imports it and
:mod:`algos.ppo_brax`; :mod:`algos.ppo_brax` (Brax's layout) imports it. Each layout keeps its own
key schedule (``split_keys``). :mod:`algos.ppo` re-exports the public names, so ``ppo.PPOConfig``,
``ppo.init``, ``ppo.global_norm`` ... are these.
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
from algos import networks, normalize
from envs.core import Env, EnvState, mean_finished_return

# ----------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters (defaults learn the pure-JAX classics on a CPU in about a minute).

    Attributes:
      num_timesteps: total environment steps of :func:`algos.ppo.train` (rounded up to whole iterations).
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
      seed: PRNG seed of :func:`algos.ppo.train`.

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

        from algos.registry import check_ranges  # light: no JAX

        sizes = ("batch_size * num_minibatches * unroll_length" if self.batch_size is not None
                 else "num_envs * unroll_length") + (" * action_repeat" if self.action_repeat > 1 else "")
        check_ranges("PPOConfig", self.seed, self.num_iterations * self.env_steps_per_iteration,
                     self.env_steps_per_iteration, sizes)

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
        """Iterations of :func:`algos.ppo.train`: ``ceil(num_timesteps / env_steps_per_iteration)``, or with
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


# The config fields that may be vmapped as data (``algos.sweep.train_many(..., settings=...)``):
# each enters the iteration only as arithmetic on a scalar (learning_rate: Adam's step size, the
# multiplier of optax.scale; discounting / gae_lambda: GAE (both layouts); clipping_epsilon,
# entropy_cost, value_cost: the loss; reward_scaling: the rewards before GAE; max_grad_norm: the
# threshold of optax.clip_by_global_norm, a ``select`` on the gradient norm), never a shape, a
# loop count or Python control flow, and ``init`` does not read it (Adam's and the clip's
# states do not depend on their scalars). A data value must be a number: ``max_grad_norm=None``
# (no clipping) changes the program and is a config, not data. Not data: the sizes and counts
# (shapes, scan lengths), normalize_observations / normalize_advantage (Python branches),
# activation and the network sizes, seed (the init key), and the driver's fields.
DATA_FIELDS = (
    "learning_rate",
    "discounting",
    "gae_lambda",
    "clipping_epsilon",
    "entropy_cost",
    "value_cost",
    "reward_scaling",
    "max_grad_norm",
)


def program_key(config: PPOConfig) -> PPOConfig:
    """``config`` without the fields compiled programs do not read (a cache key for them)."""
    return dataclasses.replace(config, num_timesteps=1, seed=0)


def evaluator_key(config: PPOConfig) -> PPOConfig:
    """:func:`program_key` for the evaluator, which reads no data field: :data:`DATA_FIELDS` at
    their class defaults, so that a config whose data fields are traced values (a vmapped settings
    group, ``algos.sweep.settings_config``) still gives a concrete, hashable key."""
    import copy

    out = copy.copy(config)  # without __post_init__: the traced values are replaced before it runs
    for name in DATA_FIELDS:
        object.__setattr__(out, name, type(config).__dataclass_fields__[name].default)
    return program_key(out)


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


class LossMetrics(NamedTuple):
    """The loss of one minibatch step and its parts (see :func:`loss_from_outputs`)."""

    total_loss: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array


# Metrics of one iteration: the counters and rollout statistics, the loss metrics averaged over
# all minibatch steps (the fields of LossMetrics, in order), and the mean gradient norm.
Metrics = NamedTuple(
    "Metrics",
    [
        ("env_steps", jax.Array),  # int32, after this iteration
        ("iteration", jax.Array),  # int32, after this iteration
        ("reward", jax.Array),  # mean reward per env step in this rollout (unscaled)
        ("episode_return", jax.Array),  # mean last finished episode return (NaN if none finished)
        ("episodes", jax.Array),  # episodes finished during this rollout
        *((name, jax.Array) for name in LossMetrics._fields),
        ("grad_norm", jax.Array),
    ],
)
Metrics.__doc__ = """Scalars of one iteration (losses averaged over all minibatch steps).

Fields: ``env_steps``, ``iteration`` (after this iteration), ``reward`` (mean reward per env step
of the rollout, unscaled), ``episode_return`` (mean last finished episode return over envs that
finished one, NaN if none), ``episodes`` (finished during the rollout), the fields of
:class:`LossMetrics`, ``grad_norm``."""


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
# The pieces of an iteration that both layouts use (each a named component)


def normalized(config: PPOConfig, normalizer: normalize.NormalizerState, obs: jax.Array) -> jax.Array:
    """``obs`` standardised with the running statistics, or as it is without normalisation."""
    return normalize.apply(normalizer, obs) if config.normalize_observations else obs


def update_normalizer(
    config: PPOConfig, normalizer: normalize.NormalizerState, obs: jax.Array
) -> normalize.NormalizerState:
    """Fold a rollout's raw observations into the running statistics (component ``normalizer``);
    unchanged without normalisation."""
    if not config.normalize_observations:
        return normalizer
    with rose_jax.component("normalizer"):
        return normalize.update(normalizer, obs)


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
    dist = networks.tanh_gaussian(nets.policy(policy_params, normalized(config, normalizer, obs)))
    raw = networks.sample_raw(dist, key)
    return jnp.tanh(raw), raw, networks.log_prob(dist, raw)


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



def global_norm(tree: Any) -> jax.Array:
    """The global L2 norm of all leaves of ``tree`` (of the gradients, in the metrics)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


class Learner(NamedTuple):
    """Carry of the update loops."""

    params: PPOParams
    opt_state: optax.OptState


def gradient_step(
    nets: Networks, config: PPOConfig, loss_fn: Callable[..., tuple[jax.Array, LossMetrics]]
) -> Callable[[Learner, Any, jax.Array], tuple[Learner, tuple[LossMetrics, jax.Array]]]:
    """``step(learner, minibatch, key) -> (learner, (loss metrics, gradient norm))``: one minibatch
    step of an update loop, ``loss_fn(nets, config, params, minibatch, key)`` and its gradient
    (component ``loss``), then one step of :func:`make_optimizer` (component ``optimizer``)."""
    optimizer = make_optimizer(config)
    loss_and_grad = jax.value_and_grad(functools.partial(loss_fn, nets, config), has_aux=True)

    def step(learner: Learner, minibatch: Any, key: jax.Array):
        with rose_jax.component("loss"):
            (_, metrics), grads = loss_and_grad(learner.params, minibatch, key)
        with rose_jax.component("optimizer"):
            updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
            params = optax.apply_updates(learner.params, updates)
        return Learner(params, opt_state), (metrics, global_norm(grads))

    return step


def update_result(
    learner: Learner, metrics: LossMetrics, grad_norm: jax.Array
) -> tuple[PPOParams, optax.OptState, LossMetrics, jax.Array]:
    """An update loop's result from its final carry and its per-step outputs: the new params and
    optimizer state, the loss metrics averaged over every minibatch step, the mean gradient norm."""
    return learner.params, learner.opt_state, jax.tree.map(jnp.mean, metrics), jnp.mean(grad_norm)


def finish(
    config: PPOConfig,
    state: TrainState,
    learner: tuple[PPOParams, optax.OptState],
    normalizer: normalize.NormalizerState,
    env_state: EnvState,
    key: jax.Array,
    data: Transition,
    loss_metrics: LossMetrics,
    grad_norm: jax.Array,
) -> tuple[TrainState, Metrics]:
    """The end of an iteration that started from ``state``: the next :class:`TrainState` (new
    params and optimizer state ``learner``, ``normalizer``, ``env_state``, ``key``, counters
    advanced) and the iteration's :class:`Metrics` (``data``: its rollout, any leading axes)."""
    params, opt_state = learner
    env_steps = state.env_steps + config.env_steps_per_iteration
    metrics = Metrics(
        env_steps=env_steps,
        iteration=state.iteration + 1,
        reward=jnp.mean(data.reward),
        episode_return=mean_finished_return(env_state),
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


def check_state(config: PPOConfig, env: Env, state: TrainState) -> None:
    """Raise a one-line ValueError if ``state`` was not made by :func:`init` with ``config`` and ``env``."""
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


# ----------------------------------------------------------------------------------------------
# Acting and evaluation

EVAL_SALT = 0x5E7A1  # eval keys are fold_in(state.key, salt): training never consumes them


def eval_key(state: TrainState) -> jax.Array:
    """The evaluation key of ``state`` (folded from its key and iteration; training never uses it)."""
    return jax.random.fold_in(jax.random.fold_in(state.key, EVAL_SALT), state.iteration)


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
        dist = networks.tanh_gaussian(nets.policy(params.policy, normalized(config, normalizer, obs)))
        if deterministic:
            return networks.mode(dist)
        if key is None:
            raise ValueError("act: deterministic=False needs a PRNG key")
        return jnp.tanh(networks.sample_raw(dist, key))

    return act
