"""Soft Actor-Critic (Haarnoja et al. 2018, arXiv:1812.05905) as pure functions over explicit state.

The same algorithm as Brax's ``agents/sac`` (twin Q with a min target, a tanh-squashed Gaussian
policy, automatic temperature, Polyak-averaged target critic, truncation-masked critic loss),
laid out so that every piece is a named component for rose-jax's tracer::

    config = SACConfig(num_timesteps=50_000, num_envs=32, grad_updates_per_step=16)
    state = init(config, env, key)            # TrainState, replay buffer prefilled
    step = jax.jit(iteration(config, env), donate_argnums=0)
    state, metrics = step(state)              # one iteration

One iteration is ``steps_per_iteration`` times: component ``collect`` (``policy`` -> ``sim`` ->
``normalizer`` -> ``replay_insert``: one step of all ``num_envs`` environments), then component
``train_steps`` (``replay_sample`` of ``grad_updates_per_step * batch_size`` transitions, then a
``lax.scan`` over ``grad_updates_per_step`` gradient steps, each ``alpha_update``,
``critic_update``, ``actor_update`` (all three read the state as it was before the step, as in
Brax, so they are independent of each other) and ``target_update``).

The host driver :func:`train` (Brax-style keywords) runs ``config.num_epochs`` jitted epochs
(:func:`epoch`: a ``lax.scan`` of iterations, then an evaluation) through ``algos.driver``, with
atomic checkpoints of the whole TrainState and bitwise-exact resume.

Shapes: ``obs`` ``(num_envs, observation_size)``, actions ``(num_envs, action_size)`` in [-1, 1],
rewards in the environment's units (scaled by ``reward_scaling`` inside the critic target only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

import rose_jax
from algos import networks, normalize, registry, replay
from rose_jax.program import Program, ProgramSpec, attr_lens
from envs.core import Env, EnvState, mean_finished_return


# --------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """SAC hyperparameters (Brax's ``sac.train`` keywords, plus rose-jax's loop shape).

    Units: ``num_timesteps``, ``min_replay_size`` and ``max_replay_size`` count single-environment
    transitions; ``learning_rate`` etc. are Adam step sizes; ``tau`` is the Polyak factor per
    gradient step.
    """

    num_timesteps: int = 100_000
    num_envs: int = 128
    learning_rate: float = 3e-4  # actor (and critic unless critic_learning_rate is set)
    critic_learning_rate: float | None = None  # None: learning_rate
    alpha_learning_rate: float = 3e-4  # temperature (Brax: 3e-4)
    discounting: float = 0.99
    tau: float = 0.005
    batch_size: int = 256
    grad_updates_per_step: int = 1  # gradient steps per env step of all envs
    steps_per_iteration: int = 1  # env steps (of all envs) per iteration, scanned
    min_replay_size: int = 0  # random-action transitions collected before training
    max_replay_size: int | None = None  # replay capacity; None: num_timesteps (as Brax)
    reward_scaling: float = 1.0
    normalize_observations: bool = False
    policy_hidden_sizes: tuple[int, ...] = (256, 256)
    q_hidden_sizes: tuple[int, ...] = (256, 256)
    activation: str = "relu"  # a flax.linen activation name
    init_alpha: float = 1.0
    target_entropy: float | None = None  # None: -action_size
    seed: int = 0
    # driver (train()) only
    num_evals: int = 10  # progress reports over the run (= jitted epochs, see num_epochs)
    num_eval_envs: int = 128  # 0: no evaluation episodes at progress reports
    deterministic_eval: bool = True
    prefill_with_policy: bool = False  # True: prefill the replay with the initial policy (Brax's)
    # True (Brax's run shape, the "brax" preset): the initial policy is evaluated at step 0 and
    # max(num_evals - 1, 1) epochs follow; False: num_evals epochs, each ending in a report
    initial_eval: bool = False

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SACConfig.{field} {why}, got {getattr(self, field)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for f in (
            "num_timesteps",
            "num_envs",
            "batch_size",
            "grad_updates_per_step",
            "steps_per_iteration",
            "num_evals",
        ):
            if not is_int(getattr(self, f)) or getattr(self, f) <= 0:
                bad(f, "must be a positive int")
        for f in ("min_replay_size", "num_eval_envs", "seed"):
            if not is_int(getattr(self, f)) or getattr(self, f) < 0:
                bad(f, "must be a non-negative int")
        if self.max_replay_size is not None and (
            not is_int(self.max_replay_size) or self.max_replay_size <= 0
        ):
            bad("max_replay_size", "must be None or a positive int")
        for f in ("learning_rate", "alpha_learning_rate", "init_alpha"):
            if not _is_finite_positive(getattr(self, f)):
                bad(f, "must be a finite number > 0")
        if self.critic_learning_rate is not None and not _is_finite_positive(self.critic_learning_rate):
            bad("critic_learning_rate", "must be None or a finite number > 0")
        if not _is_number(self.discounting) or not 0.0 <= self.discounting <= 1.0:
            bad("discounting", "must be in [0, 1]")
        if not _is_number(self.tau) or not 0.0 < self.tau <= 1.0:
            bad("tau", "must be in (0, 1]")
        if not _is_number(self.reward_scaling) or not math.isfinite(self.reward_scaling):
            bad("reward_scaling", "must be a finite number")
        if self.target_entropy is not None and not (
            _is_number(self.target_entropy) and math.isfinite(self.target_entropy)
        ):
            bad("target_entropy", "must be None or a finite number")
        for f in ("policy_hidden_sizes", "q_hidden_sizes"):
            v = getattr(self, f)
            if not isinstance(v, (tuple, list)) or not all(is_int(s) and s > 0 for s in v):
                bad(f, "must be a tuple of positive ints")
            object.__setattr__(self, f, tuple(v))
        for f in ("normalize_observations", "deterministic_eval", "prefill_with_policy", "initial_eval"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be a bool")
        if not isinstance(self.activation, str) or not callable(getattr(nn, self.activation, None)):
            bad("activation", "must name a flax.linen activation (e.g. 'relu', 'swish', 'tanh')")
        if self.min_replay_size >= self.num_timesteps:
            bad("min_replay_size", f"must be < num_timesteps={self.num_timesteps} (no training would happen)")
        if self.min_replay_size > self.replay_capacity:
            bad("min_replay_size", f"must be <= the replay capacity {self.replay_capacity}")
        if self.replay_capacity < self.num_envs:
            field = "max_replay_size" if self.max_replay_size is not None else "num_timesteps"
            bad(field, f"(the replay capacity) must be >= num_envs={self.num_envs}: one env step of all "
                "envs is inserted at once")
        from algos.registry import check_ranges  # light: no JAX

        iterations = iterations_per_epoch(self) * self.num_epochs
        check_ranges("SACConfig", self.seed,
                     self.prefill_steps * self.num_envs + iterations * self.env_steps_per_iteration,
                     self.env_steps_per_iteration, "num_envs * steps_per_iteration")

    @property
    def replay_capacity(self) -> int:
        """Transitions the replay buffer holds."""
        return self.max_replay_size if self.max_replay_size is not None else self.num_timesteps

    @property
    def num_epochs(self) -> int:
        """Jitted epochs of a ``train`` run: ``num_evals``, or Brax's ``max(num_evals - 1, 1)``
        after a step-0 evaluation when ``initial_eval``."""
        return max(self.num_evals - 1, 1) if self.initial_eval else self.num_evals

    @property
    def prefill_steps(self) -> int:
        """Env steps (of all envs at once) of random actions before training: ceil(min_replay / num_envs)."""
        return -(-self.min_replay_size // self.num_envs)

    @property
    def env_steps_per_iteration(self) -> int:
        """Single-environment transitions collected by one iteration."""
        return self.num_envs * self.steps_per_iteration


# The config fields that may be vmapped as data (``algos.sweep.train_many(..., settings=...)``):
# each enters the iteration only as arithmetic on a scalar (the three Adam step sizes, the
# multipliers of optax.scale; discounting and reward_scaling: the critic target; tau: Polyak
# averaging; target_entropy: the alpha loss), never a shape, a loop count or Python control flow,
# and ``init`` (with its prefill) does not read it. A data value must be a number:
# ``critic_learning_rate=None`` (the critic uses learning_rate) and ``target_entropy=None``
# (-action_size) are resolved when the program is built. Not data: init_alpha (read by init
# only, which a vmapped group shares), the sizes and counts (shapes, scan lengths),
# normalize_observations (a Python branch), activation and the network sizes, seed (the init
# key), and the driver's fields.
DATA_FIELDS = (
    "learning_rate",
    "critic_learning_rate",
    "alpha_learning_rate",
    "discounting",
    "tau",
    "reward_scaling",
    "target_entropy",
)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite_positive(v) -> bool:
    return _is_number(v) and math.isfinite(v) and v > 0


# --------------------------------------------------------------------------------------------
# State


class Transition(NamedTuple):
    """One stored transition (leading batch axes under vmap / in the buffer).

    obs, next_obs: (observation_size,) float32; action: (action_size,) in [-1, 1];
    reward: () env units; discount: () 0.0 at a terminal state, else 1.0;
    truncation: () 1.0 if the episode was cut by the time limit (next_obs is then the next
    episode's first observation, so the critic ignores this transition, as Brax does).
    """

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    discount: jax.Array
    next_obs: jax.Array
    truncation: jax.Array


class Metrics(NamedTuple):
    """Scalars of one iteration: losses and reward are means over it, counters are after it."""

    env_steps: jax.Array  # () int32, single-env transitions so far (prefill included)
    iteration: jax.Array  # () int32, iterations done
    grad_steps: jax.Array  # () int32, gradient steps done
    buffer_size: jax.Array  # () int32, transitions in the replay buffer
    reward: jax.Array  # mean reward per env step collected (unscaled)
    episode_return: jax.Array  # mean last finished episode return over envs that finished one (NaN if none)
    episodes: jax.Array  # () int32, episodes finished during this iteration
    critic_loss: jax.Array
    actor_loss: jax.Array
    alpha_loss: jax.Array
    alpha: jax.Array  # temperature after the iteration's last gradient step


@struct.dataclass
class TrainState:
    """Everything SAC carries from one iteration to the next (one pytree; donate it)."""

    actor_params: Any
    critic_params: Any  # TwinQ params
    target_critic_params: Any
    log_alpha: jax.Array  # () float32, log temperature
    actor_opt_state: Any
    critic_opt_state: Any
    alpha_opt_state: Any
    normalizer: normalize.NormalizerState
    replay: replay.BufferState  # of Transition
    env_state: EnvState  # batched over (num_envs,)
    key: jax.Array  # raw uint32[2] PRNG key
    env_steps: jax.Array  # () int32, single-env transitions collected so far (prefill included)
    grad_steps: jax.Array  # () int32, gradient steps so far
    iteration: jax.Array  # () int32, iterations so far (prefill excluded)


class SAC(NamedTuple):
    """The built algorithm: networks, optimizers and the buffer for one (config, env)."""

    config: SACConfig
    env: Env
    actor: networks.MLP
    critic: networks.TwinQ
    actor_optimizer: optax.GradientTransformation
    critic_optimizer: optax.GradientTransformation
    alpha_optimizer: optax.GradientTransformation
    buffer: replay.Buffer
    target_entropy: float  # a traced scalar when vmapped as data (algos.sweep)


def make(config: SACConfig, env: Env) -> SAC:
    """Resolve ``config`` against ``env`` (sizes, target entropy) into networks and optimizers."""
    if not isinstance(config, SACConfig):
        raise ValueError(f"sac: config must be an SACConfig, got {type(config).__name__}")
    if not isinstance(env, Env):
        raise ValueError(f"sac: env must be an envs.Env, got {type(env).__name__}")
    obs_size, act_size = env.observation_size, env.action_size
    example = Transition(
        obs=jnp.zeros((obs_size,), jnp.float32),
        action=jnp.zeros((act_size,), jnp.float32),
        reward=jnp.zeros((), jnp.float32),
        discount=jnp.zeros((), jnp.float32),
        next_obs=jnp.zeros((obs_size,), jnp.float32),
        truncation=jnp.zeros((), jnp.float32),
    )
    critic_lr = (
        config.critic_learning_rate if config.critic_learning_rate is not None else config.learning_rate
    )
    target_entropy = config.target_entropy if config.target_entropy is not None else -act_size
    if not isinstance(target_entropy, jax.Array):  # a traced value (a vmapped setting) stays one
        target_entropy = float(target_entropy)
    return SAC(
        config=config,
        env=env,
        actor=networks.MLP(config.policy_hidden_sizes, 2 * act_size, config.activation),
        critic=networks.TwinQ(config.q_hidden_sizes, config.activation),
        actor_optimizer=optax.adam(config.learning_rate),
        critic_optimizer=optax.adam(critic_lr),
        alpha_optimizer=optax.adam(config.alpha_learning_rate),
        buffer=replay.uniform(config.replay_capacity, example),
        target_entropy=target_entropy,
    )


def init(config: SACConfig, env: Env, key: jax.Array, *, prefill: bool = True) -> TrainState:
    """A fresh TrainState: initialised networks, reset envs and (``prefill``) a prefilled buffer.

    One jitted program (vmappable over keys).

    Args:
      key: a raw ``jax.random.PRNGKey`` (uint32[2]); typed keys are converted.
      prefill: run :func:`prefill_fn` (``config.prefill_steps`` random-action env steps of all envs).
    """
    make(config, env)  # type checks
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return _jitted_init(_cache_key(config), env, bool(prefill))(key)


def _init_state(sac: SAC, key: jax.Array) -> TrainState:
    config, env = sac.config, sac.env
    actor_key, critic_key, env_key, key = jax.random.split(key, 4)
    obs = jnp.zeros((1, env.observation_size), jnp.float32)
    actor_params = sac.actor.init(actor_key, obs)
    critic_params = sac.critic.init(critic_key, obs, jnp.zeros((1, env.action_size), jnp.float32))
    log_alpha = jnp.log(jnp.asarray(config.init_alpha, jnp.float32))
    env_state = jax.vmap(env.reset)(jax.random.split(env_key, config.num_envs))
    return TrainState(
        actor_params=actor_params,
        critic_params=critic_params,
        target_critic_params=critic_params,
        log_alpha=log_alpha,
        actor_opt_state=sac.actor_optimizer.init(actor_params),
        critic_opt_state=sac.critic_optimizer.init(critic_params),
        alpha_opt_state=sac.alpha_optimizer.init(log_alpha),
        normalizer=normalize.init(env.observation_size),
        replay=sac.buffer.init(),
        env_state=env_state,
        key=key,
        env_steps=jnp.zeros((), jnp.int32),
        grad_steps=jnp.zeros((), jnp.int32),
        iteration=jnp.zeros((), jnp.int32),
    )


# --------------------------------------------------------------------------------------------
# Pure pieces (each one component)


def _preprocess(sac: SAC, normalizer: normalize.NormalizerState, obs: jax.Array) -> jax.Array:
    return normalize.apply(normalizer, obs) if sac.config.normalize_observations else obs


def policy_distribution(sac: SAC, actor_params, normalizer, obs: jax.Array) -> networks.TanhGaussian:
    """The policy's tanh-Gaussian over actions for ``obs`` ``(..., observation_size)``."""
    return networks.tanh_gaussian(sac.actor.apply(actor_params, _preprocess(sac, normalizer, obs)))


def q_values(sac: SAC, critic_params, normalizer, obs: jax.Array, action: jax.Array) -> jax.Array:
    """Twin Q-values ``(..., 2)`` of ``action`` in ``obs``."""
    return sac.critic.apply(critic_params, _preprocess(sac, normalizer, obs), action)


@rose_jax.component("policy")
def act(sac: SAC, actor_params, normalizer, obs: jax.Array, key: jax.Array) -> jax.Array:
    """A sampled action ``(num_envs, action_size)`` in (-1, 1) for ``obs`` ``(num_envs, obs_size)``."""
    dist = policy_distribution(sac, actor_params, normalizer, obs)
    return jnp.tanh(networks.sample_raw(dist, key))


@rose_jax.component("policy")
def random_act(sac: SAC, obs: jax.Array, key: jax.Array) -> jax.Array:
    """Uniform random actions ``(num_envs, action_size)`` in [-1, 1] (replay prefill)."""
    return jax.random.uniform(key, (obs.shape[0], sac.env.action_size), minval=-1.0, maxval=1.0)


@rose_jax.component("sim")
def sim(sac: SAC, env_state: EnvState, action: jax.Array) -> EnvState:
    """One step of every environment: ``jax.vmap(env.step)``."""
    return jax.vmap(sac.env.step)(env_state, action)


@rose_jax.component("normalizer")
def update_normalizer(sac: SAC, normalizer, obs: jax.Array):
    """Fold the observation batch into the running statistics (identity when not normalizing)."""
    return normalize.update(normalizer, obs) if sac.config.normalize_observations else normalizer


@rose_jax.component("replay_insert")
def replay_insert(sac: SAC, buffer_state: replay.BufferState, transitions: Transition) -> replay.BufferState:
    return sac.buffer.insert(buffer_state, transitions)


@rose_jax.component("replay_sample")
def replay_sample(sac: SAC, buffer_state: replay.BufferState, key: jax.Array) -> Transition:
    """``grad_updates_per_step`` minibatches at once: every leaf ``(grad_updates, batch_size, ...)``."""
    c = sac.config
    batch = sac.buffer.sample(buffer_state, key, c.grad_updates_per_step * c.batch_size)
    return jax.tree.map(lambda x: x.reshape((c.grad_updates_per_step, c.batch_size) + x.shape[1:]), batch)


def critic_target(reward, discount, next_q, next_log_prob, alpha, reward_scaling: float, discounting: float):
    """Soft Bellman target ``r * scale + gamma * d * (min_i Q'_i(s', a') - alpha * log pi(a'|s'))``.

    reward, discount, next_log_prob: (B,); next_q: (B, 2) target twin Q of the sampled next action.
    """
    next_v = jnp.min(next_q, axis=-1) - alpha * next_log_prob
    return reward * reward_scaling + discount * discounting * next_v


def critic_loss(
    sac: SAC,
    critic_params,
    target_critic_params,
    actor_params,
    log_alpha,
    normalizer,
    batch: Transition,
    key: jax.Array,
) -> jax.Array:
    """0.5 * mean squared soft TD error of both Q-heads, truncated transitions masked out."""
    c = sac.config
    next_dist = policy_distribution(sac, actor_params, normalizer, batch.next_obs)
    next_raw = networks.sample_raw(next_dist, key)
    next_log_prob = networks.log_prob(next_dist, next_raw)
    next_q = q_values(sac, target_critic_params, normalizer, batch.next_obs, jnp.tanh(next_raw))
    target = critic_target(
        batch.reward,
        batch.discount,
        next_q,
        next_log_prob,
        jnp.exp(log_alpha),
        c.reward_scaling,
        c.discounting,
    )
    target = jax.lax.stop_gradient(target)
    q = q_values(sac, critic_params, normalizer, batch.obs, batch.action)
    error = (q - target[..., None]) * (1.0 - batch.truncation)[..., None]
    return 0.5 * jnp.mean(jnp.square(error))


def actor_loss(sac: SAC, actor_params, critic_params, log_alpha, normalizer, obs, key) -> jax.Array:
    """mean(alpha * log pi(a|s) - min_i Q_i(s, a)), a ~ pi(.|s) reparameterised."""
    dist = policy_distribution(sac, actor_params, normalizer, obs)
    raw = networks.sample_raw(dist, key)
    q = q_values(sac, critic_params, normalizer, obs, jnp.tanh(raw))
    return jnp.mean(jnp.exp(log_alpha) * networks.log_prob(dist, raw) - jnp.min(q, axis=-1))


def alpha_loss(sac: SAC, log_alpha, actor_params, normalizer, obs, key) -> jax.Array:
    """mean(alpha * stop_grad(-log pi(a|s) - target_entropy)) (eq. 18; Brax's form)."""
    dist = policy_distribution(sac, actor_params, normalizer, obs)
    log_prob = networks.log_prob(dist, networks.sample_raw(dist, key))
    return jnp.mean(jnp.exp(log_alpha) * jax.lax.stop_gradient(-log_prob - sac.target_entropy))


def _adam_update(name: str, optimizer: str, loss_fn: Callable[..., jax.Array], doc: str) -> Callable:
    """``update(sac, params, opt_state, *inputs) -> (params, opt_state, loss)``: one step of the
    optimizer ``getattr(sac, optimizer)`` on ``loss_fn(sac, params, *inputs)``, run as the
    component ``name``."""

    def update(sac: SAC, params, opt_state, *inputs):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, sac))(params, *inputs)
        updates, opt_state = getattr(sac, optimizer).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    update.__name__ = update.__qualname__ = name
    update.__doc__ = doc
    return rose_jax.component(name)(update)


critic_update = _adam_update(
    "critic_update",
    "critic_optimizer",
    critic_loss,
    """One Adam step on the twin critic: ``critic_update(sac, critic_params, critic_opt_state,
    target_critic_params, actor_params, log_alpha, normalizer, batch, key) -> (critic_params,
    critic_opt_state, loss)`` (the inputs after the optimizer state are :func:`critic_loss`'s).""",
)
actor_update = _adam_update(
    "actor_update",
    "actor_optimizer",
    actor_loss,
    """One Adam step on the policy: ``actor_update(sac, actor_params, actor_opt_state,
    critic_params, log_alpha, normalizer, obs, key) -> (actor_params, actor_opt_state, loss)``
    (the inputs after the optimizer state are :func:`actor_loss`'s).""",
)
alpha_update = _adam_update(
    "alpha_update",
    "alpha_optimizer",
    alpha_loss,
    """One Adam step on the log temperature: ``alpha_update(sac, log_alpha, alpha_opt_state,
    actor_params, normalizer, obs, key) -> (log_alpha, alpha_opt_state, loss)`` (the inputs
    after the optimizer state are :func:`alpha_loss`'s).""",
)


@rose_jax.component("target_update")
def target_update(target_params, online_params, tau: float):
    """Polyak averaging ``target <- (1 - tau) * target + tau * online``, leaf by leaf."""
    return jax.tree.map(lambda t, o: t * (1.0 - tau) + o * tau, target_params, online_params)


# --------------------------------------------------------------------------------------------
# Loops


def collect(sac: SAC, state: TrainState, key: jax.Array, random_actions: bool) -> tuple[TrainState, dict]:
    """One env step of all envs, stored in the buffer (component ``collect``)."""
    with rose_jax.component("collect"):
        obs = state.env_state.obs
        if random_actions:
            action = random_act(sac, obs, key)
        else:
            action = act(sac, state.actor_params, state.normalizer, obs, key)
        env_state = sim(sac, state.env_state, action)
        terminal = env_state.done * (1.0 - env_state.truncated)
        transitions = Transition(
            obs=obs,
            action=action,
            reward=env_state.reward,
            discount=1.0 - terminal,
            next_obs=env_state.obs,  # after a time limit this is the next episode's: masked in the loss
            truncation=env_state.truncated,
        )
        normalizer = update_normalizer(sac, state.normalizer, obs)
        buffer_state = replay_insert(sac, state.replay, transitions)
        state = state.replace(
            env_state=env_state,
            normalizer=normalizer,
            replay=buffer_state,
            env_steps=state.env_steps + sac.config.num_envs,
        )
    return state, {
        "reward": jnp.mean(env_state.reward),
        "episodes": jnp.sum(env_state.done.astype(jnp.int32)),
    }


class Learner(NamedTuple):
    """The fields the gradient steps change: the carry of the ``train_steps`` scan.

    The replay buffer, env states and normalizer are not carried (they are read-only there), so
    the scan's carry is only what the updates write.
    """

    actor_params: Any
    critic_params: Any
    target_critic_params: Any
    log_alpha: jax.Array
    actor_opt_state: Any
    critic_opt_state: Any
    alpha_opt_state: Any
    grad_steps: jax.Array
    key: jax.Array

    @classmethod
    def of(cls, state: TrainState, key: jax.Array) -> Learner:
        return cls(**{f: getattr(state, f) for f in cls._fields if f != "key"}, key=key)

    def into(self, state: TrainState) -> TrainState:
        return state.replace(**{f: getattr(self, f) for f in self._fields if f != "key"})


def _grad_step(sac: SAC, normalizer, learner: Learner, batch: Transition) -> tuple[Learner, dict]:
    """One gradient step on one minibatch ``(batch_size, ...)``: alpha, critic, actor, then target.

    As in Brax, the alpha, critic and actor updates all read the parameters as they were before
    this step (so they are independent); the target follows the new critic.
    """
    s = learner
    key, alpha_key, critic_key, actor_key = jax.random.split(s.key, 4)
    log_alpha, alpha_opt_state, a_loss = alpha_update(
        sac, s.log_alpha, s.alpha_opt_state, s.actor_params, normalizer, batch.obs, alpha_key
    )
    critic_params, critic_opt_state, c_loss = critic_update(
        sac,
        s.critic_params,
        s.critic_opt_state,
        s.target_critic_params,
        s.actor_params,
        s.log_alpha,
        normalizer,
        batch,
        critic_key,
    )
    actor_params, actor_opt_state, p_loss = actor_update(
        sac, s.actor_params, s.actor_opt_state, s.critic_params, s.log_alpha, normalizer, batch.obs, actor_key
    )
    target_critic_params = target_update(s.target_critic_params, critic_params, sac.config.tau)
    learner = Learner(
        actor_params=actor_params,
        critic_params=critic_params,
        target_critic_params=target_critic_params,
        log_alpha=log_alpha,
        actor_opt_state=actor_opt_state,
        critic_opt_state=critic_opt_state,
        alpha_opt_state=alpha_opt_state,
        grad_steps=s.grad_steps + 1,
        key=key,
    )
    metrics = {"critic_loss": c_loss, "actor_loss": p_loss, "alpha_loss": a_loss, "alpha": jnp.exp(log_alpha)}
    return learner, metrics


def train_steps(sac: SAC, state: TrainState, key: jax.Array) -> tuple[TrainState, dict]:
    """``grad_updates_per_step`` gradient steps as one ``lax.scan`` (component ``train_steps``)."""
    with rose_jax.component("train_steps"):
        sample_key, scan_key = jax.random.split(key)
        batches = replay_sample(sac, state.replay, sample_key)
        step = functools.partial(_grad_step, sac, state.normalizer)
        learner, metrics = jax.lax.scan(step, Learner.of(state, scan_key), batches)
    metrics = {**jax.tree.map(jnp.mean, metrics), "alpha": metrics["alpha"][-1]}
    return learner.into(state), metrics


def split_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """SAC's key schedule of one env step: ``state.key -> (next_key, collect_key, train_key)``.

    The one place it is written: :func:`iteration`, :func:`program` and the baselines call it.
    """
    next_key, collect_key, train_key = jax.random.split(key, 3)
    return next_key, collect_key, train_key


def _env_and_train_step(sac: SAC, state: TrainState, _=None) -> tuple[TrainState, dict]:
    key, collect_key, train_key = split_keys(state.key)
    state = state.replace(key=key)
    state, collect_metrics = collect(sac, state, collect_key, random_actions=False)
    state, train_metrics = train_steps(sac, state, train_key)
    return state, {**collect_metrics, **train_metrics}


def iteration(config: SACConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    """The pure, jittable ``TrainState -> (TrainState, Metrics)`` of one SAC iteration.

    One iteration = ``steps_per_iteration`` x (one env step of all envs + ``grad_updates_per_step``
    gradient steps), scanned when ``steps_per_iteration > 1``. Jit it with ``donate_argnums=0``.
    """
    sac = make(config, env)

    def sac_iteration(state: TrainState) -> tuple[TrainState, Metrics]:
        if config.steps_per_iteration == 1:
            state, m = _env_and_train_step(sac, state)
        else:
            state, m = jax.lax.scan(
                functools.partial(_env_and_train_step, sac), state, None, length=config.steps_per_iteration
            )
            m = {**jax.tree.map(jnp.mean, m), "episodes": jnp.sum(m["episodes"]), "alpha": m["alpha"][-1]}
        return finish_iteration(state, m)

    return sac_iteration


def finish_iteration(state: TrainState, m: dict) -> tuple[TrainState, Metrics]:
    """The end of an iteration: the counter advanced and its :class:`Metrics`.

    ``m``: the iteration's :func:`collect` and :func:`train_steps` metrics (over its env steps).
    """
    state = state.replace(iteration=state.iteration + 1)
    return state, Metrics(
        env_steps=state.env_steps,
        iteration=state.iteration,
        grad_steps=state.grad_steps,
        buffer_size=state.replay.size,
        reward=m["reward"],
        episode_return=mean_finished_return(state.env_state),
        episodes=m["episodes"],
        critic_loss=m["critic_loss"],
        actor_loss=m["actor_loss"],
        alpha_loss=m["alpha_loss"],
        alpha=m["alpha"],
    )


def program(config: SACConfig, env: Env, *, env_name: str | None = None, env_kwargs: tuple = ()) -> Program:
    """The iteration (``steps_per_iteration == 1``) as a :class:`rose_jax.program.Program`.

    ``collect`` is :func:`collect` (its metrics are the data) and ``learn`` :func:`train_steps`
    then :func:`finish_iteration`, so it equals ``iteration(config, env)``. SAC's collect folds
    each step's observations into the normalizer and inserts them into the replay buffer (shared
    state, not per env): the optimizer's env-group rollouts are rejected for it, a real collect
    that reduces over envs. ``env_name`` / ``env_kwargs``: ``env``'s registry name, so that
    worker processes can rebuild it; without it the program has no spec.
    """
    if config.steps_per_iteration != 1:
        raise ValueError(f"sac.program: needs steps_per_iteration == 1, got {config.steps_per_iteration}")
    sac = make(config, env)

    def collect_step(state):
        _, collect_key, _ = split_keys(state.key)
        return collect(sac, state, collect_key, random_actions=False)

    def learn(state, collect_metrics):
        key, _, train_key = split_keys(state.key)
        state, train_metrics = train_steps(sac, state.replace(key=key), train_key)
        return finish_iteration(state, {**collect_metrics, **train_metrics})

    spec = None if env_name is None else ProgramSpec(
        "algos.sac:program", (("config", config),), env=("envs:make", env_name, tuple(env_kwargs))
    )
    return Program(
        name="sac",
        num_envs=config.num_envs,
        collect=collect_step,
        learn=learn,
        env=attr_lens("env_state"),
        data_env_axis=None,  # the collect's metrics: scalars, not per env
        spec=spec,
        env_name=env.name,
    )


def prefill_fn(config: SACConfig, env: Env) -> Callable[[TrainState], TrainState]:
    """Pure ``TrainState -> TrainState``: ``config.prefill_steps`` random-action steps into the buffer."""
    sac = make(config, env)

    def body(state: TrainState, _):
        key, collect_key = jax.random.split(state.key)
        random_actions = not config.prefill_with_policy
        state, _ = collect(sac, state.replace(key=key), collect_key, random_actions=random_actions)
        return state, None

    def prefill(state: TrainState) -> TrainState:
        with rose_jax.component("prefill"):
            state, _ = jax.lax.scan(body, state, None, length=config.prefill_steps)
        return state

    return prefill


# --------------------------------------------------------------------------------------------
# Evaluation


def make_evaluator(
    config: SACConfig,
    env: Env,
    num_envs: int | None = None,
    deterministic: bool | None = None,
    steps: int | None = None,
) -> Callable[[Any, normalize.NormalizerState, jax.Array], jax.Array]:
    """A pure, jittable ``(actor_params, normalizer, key) -> mean episode return`` over fresh episodes.

    ``num_envs`` (default ``config.num_eval_envs``) environments run ``steps`` (default
    ``env.episode_length``) steps from a reset; each one's return is its reward summed up to and
    including its first ``done``. ``deterministic`` (default ``config.deterministic_eval``) acts with
    ``tanh(loc)``, else samples. Fewer ``steps`` than an episode is the plan search's scaled-down
    epoch (:func:`search_unit`), never what ``train`` reports.
    """
    sac = make(config, env)
    n = config.num_eval_envs if num_envs is None else num_envs
    det = config.deterministic_eval if deterministic is None else deterministic
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"sac.make_evaluator: num_envs must be a positive int, got {n!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"sac.make_evaluator: steps must be a positive int, got {steps!r}")
    length = env.episode_length if steps is None else steps  # an env's own length as it is (numpy ints too)

    def evaluate(actor_params, normalizer: normalize.NormalizerState, key: jax.Array) -> jax.Array:
        reset_key, act_key = jax.random.split(key)
        env_state = jax.vmap(env.reset)(jax.random.split(reset_key, n))

        def step(carry, step_key):
            env_state, ret, alive = carry
            dist = policy_distribution(sac, actor_params, normalizer, env_state.obs)
            action = networks.mode(dist) if det else jnp.tanh(networks.sample_raw(dist, step_key))
            env_state = jax.vmap(env.step)(env_state, action)
            ret = ret + alive * env_state.reward
            alive = alive * (1.0 - env_state.done)
            return (env_state, ret, alive), None

        carry = (env_state, jnp.zeros((n,), jnp.float32), jnp.ones((n,), jnp.float32))
        (_, ret, _), _ = jax.lax.scan(step, carry, jax.random.split(act_key, length))
        return jnp.mean(ret)

    return evaluate


def evaluate(
    config: SACConfig,
    env: Env,
    state: TrainState,
    key: jax.Array,
    num_envs: int | None = None,
    deterministic: bool | None = None,
) -> float:
    """Host convenience: :func:`make_evaluator` jitted (cached) and run on ``state``'s policy."""
    fn = _jitted_evaluator(_cache_key(config), env, num_envs, deterministic)
    return float(fn(state.actor_params, state.normalizer, key))


# --------------------------------------------------------------------------------------------
# Driver (host side)

_EVAL_SALT = 0x5E7A1  # eval keys are fold_in(state.key, salt): training never consumes them


def initial_evaluation(config: SACConfig, env: Env, state: TrainState) -> float:
    """The step-0 report of Brax's run shape: the initial policy evaluated with the normalizer as
    it was before the prefill (Brax evaluates before it prefills), with the key the first epoch's
    evaluation would use."""
    evaluate_fn = _jitted_evaluator(_cache_key(config), env, None, None)
    key = jax.random.fold_in(jax.random.fold_in(state.key, _EVAL_SALT), state.iteration)
    return float(evaluate_fn(state.actor_params, normalize.init(env.observation_size), key))


def iterations_per_epoch(config: SACConfig) -> int:
    """Iterations per jitted epoch, so that ``config.num_epochs`` epochs reach ``num_timesteps``
    (rounded up, as Brax's ``num_training_steps_per_epoch``)."""
    remaining = config.num_timesteps - config.prefill_steps * config.num_envs
    total = -(-max(remaining, 1) // config.env_steps_per_iteration)
    return -(-total // config.num_epochs)


def epoch(
    config: SACConfig, env: Env, iterations: int | None = None, eval_steps: int | None = None
) -> Callable[[TrainState], tuple[TrainState, dict]]:
    """Pure ``TrainState -> (TrainState, metrics dict)``: a ``lax.scan`` of ``iterations`` (default
    :func:`iterations_per_epoch`) iterations, then (``num_eval_envs > 0``) an evaluation of
    ``eval_steps`` steps (default: an episode, ``env.episode_length``), as ``eval_episode_return``.

    Epoch metrics: the :class:`Metrics` fields, with reward and losses averaged over the epoch,
    ``episodes`` summed, counters, alpha and episode_return as at its end.
    """
    one = iteration(config, env)
    iters = iterations_per_epoch(config) if iterations is None else iterations
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"sac.epoch: iterations must be a positive int, got {iterations!r}")
    evaluate_fn = make_evaluator(config, env, steps=eval_steps) if config.num_eval_envs > 0 else None
    averaged = ("reward", "critic_loss", "actor_loss", "alpha_loss")

    def run_epoch(state: TrainState) -> tuple[TrainState, dict]:
        state, ms = jax.lax.scan(lambda s, _: one(s), state, None, length=iters)
        out = {k: (jnp.mean(v) if k in averaged else v[-1]) for k, v in ms._asdict().items()}
        out["episodes"] = jnp.sum(ms.episodes)
        if evaluate_fn is not None:
            with rose_jax.component("evaluate"):
                eval_key = jax.random.fold_in(jax.random.fold_in(state.key, _EVAL_SALT), state.iteration)
                out["eval_episode_return"] = evaluate_fn(state.actor_params, state.normalizer, eval_key)
        return state, out

    return run_epoch


# Gradient steps in the unit the plan search measures (``search_unit``): about 1.6 s of Brax's
# published hopper high-update learner on an H200 (~200 us per step), so a search's compiles, profile,
# option trial and timed candidates fit a device call where the published epoch (2,692 iterations of
# 64 steps, ~36 s) would take tens of minutes. A module constant, not a config field: it shapes only
# what the search measures, never what train computes.
SEARCH_UNIT_GRAD_STEPS = 8192
# The fewest evaluation steps of a search unit (registry.scaled_eval_steps: PPO's unit shares it)
SEARCH_UNIT_MIN_EVAL_STEPS = registry.SEARCH_UNIT_MIN_EVAL_STEPS


def search_unit(config: SACConfig, env: Env):
    """What ``rose-jax train --optimize`` searches on instead of the whole epoch, or None (the epoch
    itself): where an epoch has more than :data:`SEARCH_UNIT_GRAD_STEPS` gradient steps, the same
    epoch program scaled down, its iteration scan and its evaluation's steps shortened by the same
    factor (``epoch(config, env, iterations=k, eval_steps=ceil(episode_length * k / full))``, at
    least :data:`SEARCH_UNIT_MIN_EVAL_STEPS`), so
    the plan found on it applies to the epoch by name (transforms address loops and components, not
    scan lengths). Same state pytree, same cache key inputs apart from the lengths.

    Why the evaluation too: with a whole evaluation beside 128 of hopper's 2,692 iterations, the
    evaluation was about 80 % of the searched unit (H100, 2026-12-06 19:18: 128 x 1000 MJX steps
    against 128 iterations) where it is 10-15 % of an epoch, so the search ranked and timed the
    evaluation's candidates as if they were most of the run. Scaled alike, each part keeps the
    share it has in the epoch."""
    from algos.registry import SearchUnit

    per_iteration = config.grad_updates_per_step * config.steps_per_iteration
    full = iterations_per_epoch(config)
    k = max(registry.SEARCH_UNIT_MIN_ITERATIONS, SEARCH_UNIT_GRAD_STEPS // per_iteration)
    if k >= full:
        return None
    eval_steps, episode = None, int(env.episode_length)
    if config.num_eval_envs > 0:
        eval_steps = registry.scaled_eval_steps(episode, k, full)
    return SearchUnit(epoch(config, env, iterations=k, eval_steps=eval_steps), k, full, eval_steps,
                      episode if eval_steps is not None else None)


def _cache_key(config: SACConfig) -> SACConfig:
    return dataclasses.replace(config, seed=0)  # the seed only enters through the init key


@functools.lru_cache(maxsize=16)
def _jitted_init(config: SACConfig, env: Env, prefill: bool) -> Callable[[jax.Array], TrainState]:
    sac = make(config, env)
    fill = prefill_fn(config, env) if prefill and config.prefill_steps > 0 else (lambda state: state)
    return jax.jit(lambda key: fill(_init_state(sac, key)))


@functools.lru_cache(maxsize=16)
def _jitted_epoch(config: SACConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, dict]]:
    return jax.jit(epoch(config, env), donate_argnums=0)


@functools.lru_cache(maxsize=16)
def _jitted_evaluator(config: SACConfig, env: Env, num_envs, deterministic):
    return jax.jit(make_evaluator(config, env, num_envs, deterministic))


@functools.lru_cache(maxsize=16)
def _jitted_iteration(config: SACConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    return jax.jit(iteration(config, env), donate_argnums=0)


def jitted_iteration(config: SACConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, Metrics]]:
    """``jax.jit(iteration(config, env), donate_argnums=0)``, cached per (config without seed, env)."""
    return _jitted_iteration(_cache_key(config), env)


def jitted_epoch(config: SACConfig, env: Env) -> Callable[[TrainState], tuple[TrainState, dict]]:
    """``jax.jit(epoch(config, env), donate_argnums=0)``, cached per (config without seed, env)."""
    return _jitted_epoch(_cache_key(config), env)


def train(
    env: Env | str, config: SACConfig | None = None, **keywords: Any
) -> tuple[TrainState, list[dict[str, float]]]:
    """Train SAC on ``env`` (an Env or a registered name).

    Hyperparameters are ``config`` (a :class:`SACConfig`, default ``SACConfig()``) with
    the other ``keywords`` (its field names, Brax-style:
    ``train(env, num_timesteps=...)``);
    an unknown keyword is a one-line TypeError listing the valid ones. The loop's keywords are
    ``progress_fn``, ``checkpoint_dir``, ``checkpoint_every``, ``keep_checkpoints`` (default 3) and
    ``resume`` (``algos.registry.TRAIN_LOOP_KEYWORDS``).
    The run is ``config.num_epochs`` epochs, each one jitted :func:`epoch` (``lax.scan`` over
    :func:`iterations_per_epoch` iterations, no host sync inside, state donated), so the total is
    at least ``num_timesteps`` env steps; with ``initial_eval`` (Brax's run shape) the initial
    policy's evaluation is reported at step 0 first. ``progress_fn(env_steps, metrics)`` is called after each
    epoch with its metrics as floats (it may raise ``algos.driver.StopTraining`` to stop after
    the epoch in flight, with a checkpoint). With ``checkpoint_dir``, the whole TrainState
    (replay buffer and env states included) is saved every ``checkpoint_every`` epochs and after
    the last one, named by env steps, keeping the ``keep_checkpoints`` newest and the best (None:
    all); ``resume=True`` continues from the latest checkpoint there, to bitwise the same final
    state as an uninterrupted run.

    Returns:
      ``(final TrainState, [metrics dict per epoch run by this call])``.
    """
    return registry.train_with_keywords(SACConfig, train_with_config, env, config, keywords, "sac.train")


def train_with_config(
    config: SACConfig,
    env: Env | str,
    *,
    progress_fn: Callable[[int, dict], None] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int | None = 3,  # algos.driver.DEFAULT_KEEP
    resume: bool = False,
    make_step: Callable[[TrainState], Callable[[TrainState], tuple[TrainState, Any]]] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """:func:`train` with the hyperparameters as one :class:`SACConfig`.

    ``make_step(state)``, if given, returns the step the loop runs instead of the jitted
    :func:`epoch` (e.g. a ``rose_jax.optimize`` plan of it searched on that state); it must
    compute the same ``state -> (state, metrics)``.
    """
    from algos import driver  # host layer (imports orbax lazily through algos.checkpoint)

    if isinstance(env, str):
        import envs

        env = envs.make(env)
    make(config, env)  # type checks
    driver.check_loop_args(checkpoint_dir, checkpoint_every)
    if resume and checkpoint_dir is None:
        raise ValueError("sac.train: resume=True needs a checkpoint_dir")
    key = jax.random.PRNGKey(config.seed)
    state, step = None, None
    if resume and checkpoint_dir is not None:
        from algos import checkpoint

        if checkpoint.latest_step(checkpoint_dir) is not None:  # restore into an unfilled state
            like = _jitted_init(_cache_key(config), env, False)(key)
            state, step = driver.maybe_resume(checkpoint_dir, like, resume)
    if state is None:
        state = _jitted_init(_cache_key(config), env, True)(key)
    iters = iterations_per_epoch(config)
    step_fn = jitted_epoch(config, env) if make_step is None else make_step(state)
    fresh = int(state.iteration) == 0  # a resumed run made its step-0 report before
    if config.initial_eval and config.num_evals > 1 and config.num_eval_envs and progress_fn and fresh:
        progress_fn(0, {"eval_episode_return": initial_evaluation(config, env, state), "env_steps": 0})
    return driver.run(
        step_fn,
        state,
        num_iterations=config.num_epochs,
        iteration_of=lambda s: s.iteration // iters,
        env_steps_of=lambda s: s.env_steps,
        progress_fn=progress_fn,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep_checkpoints,
    )


# train's keywords for help(), IDEs and inspect: (env, config=None, *, progress_fn, ..., **overrides)
train.__signature__ = registry.train_signature(train_with_config)


__all__ = [
    "DATA_FIELDS",
    "Learner",
    "Metrics",
    "SAC",
    "SACConfig",
    "TrainState",
    "Transition",
    "act",
    "actor_loss",
    "actor_update",
    "alpha_loss",
    "alpha_update",
    "critic_loss",
    "critic_target",
    "critic_update",
    "epoch",
    "evaluate",
    "init",
    "initial_evaluation",
    "iteration",
    "iterations_per_epoch",
    "search_unit",
    "jitted_epoch",
    "jitted_iteration",
    "make",
    "make_evaluator",
    "policy_distribution",
    "prefill_fn",
    "q_values",
    "random_act",
    "replay_insert",
    "replay_sample",
    "sim",
    "target_update",
    "train",
    "train_with_config",
    "update_normalizer",
]
