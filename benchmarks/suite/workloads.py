"""Benchmark workloads and suites: frozen data, no JAX at import time.

A :class:`Workload` is one row of the results table: an algorithm (PPO or SAC) on one environment
with one policy size and env count, measured as up to six variants (:data:`VARIANTS`):

  ``brax``              (a) Brax's own ``ppo.train`` / ``sac.train`` (Brax envs only), its ``training/sps``
  ``brax_flags``        (a') (a) in a child process with ``XLA_FLAGS`` + :data:`PEER_XLA_FLAGS`
  ``single_jit``        (b) our algorithm, K iterations inside one jitted ``lax.scan`` (PureJaxRL style)
  ``single_jit_flags``  (b') (b) compiled with the XLA option set :data:`PEER_OPTION_SET` (a GPU;
                            on a CPU the options are empty)
  ``hand_pipelined``    (c) (b) with the rollout split into 2 env groups, staggered by hand
                            (:mod:`benchmarks.suite.baselines`): group B's policy next to group A's sim
  ``rose_jax``          (d) ``rose_jax.optimize.optimize`` of the same iteration, run like (b)

Each peer (Brax's trainer, our single-jit loop) runs as shipped AND with the best global XLA flags
we know (the informed peer, issue 30): :data:`INFORMED_PEERS` pairs them, and every row that has a
peer has its flagged partner too (:func:`with_informed_peers`); a ratio is to the faster of the two.

A :class:`Suite` is a named tuple of workloads with a device-time budget. Suites:

  ``tiny``   CPU smoke suite (pure-JAX cartpole/pendulum, Brax's trivial ``fast`` env); < 2 min here
  ``quick``  four H200 rows (PPO ant / humanoid / MJCF swimmer 2048 envs, SAC ant 1024 envs); four
             parts, < 8 min each
  ``epoch``  Brax's train loop (training epochs + evaluation; ``Workload.unit == "epoch"``), PPO ant
             2048 and SAC ant 1024 envs, as an MPS client; one row per part, < 10 min each (its Brax
             runs (a), (a') do not fit beside (b') and are cut by the budget)
  ``full``   every combination {PPO, SAC} x {ant, humanoid, halfcheetah, mjx_swimmer} x {4x32, 4x256}
             x two env counts; run it in parts (``--part i/n``, see :func:`split`)

Hyperparameters are matched between Brax and our algorithms (same env count, unroll, minibatches,
epochs, learning rate, discount, network sizes, activation, reward scaling, normalisation), with
Brax's ``batch_size = num_envs / num_minibatches`` so that one Brax training step collects one
unroll of every env, like one of our PPO iterations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

VARIANTS = ("brax", "brax_flags", "single_jit", "single_jit_flags", "hand_pipelined", "rose_jax")
UNITS = ("iteration", "epoch")
BASELINES = ("brax", "brax_flags", "single_jit", "single_jit_flags", "hand_pipelined")
# peer as shipped -> the same peer with the best global XLA flags we know (the informed peer)
INFORMED_PEERS = {"brax": "brax_flags", "single_jit": "single_jit_flags"}
# Brax's trainer cannot take compiler options: the flag goes into its process's XLA_FLAGS (read at
# process start only, so (a') runs in a child process). Our single-jit loop takes the same option as
# compiler options (rose_jax.optimize.xla_options.SETS[PEER_OPTION_SET]).
PEER_XLA_FLAGS = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
PEER_OPTION_SET = "concurrent_scheduling"
LABELS = {
    "brax": "(a) Brax train",
    "brax_flags": "(a') Brax train + XLA flag",
    "single_jit": "(b) single-jit loop",
    "single_jit_flags": "(b') single-jit loop + XLA options",
    "hand_pipelined": "(c) hand env-group pipeline",
    "rose_jax": "(d) rose-jax optimized",
}
# The order variants run in: (b) first (reference for equality checks and for reuse by (d)), its
# flagged partner (b') (compiled ahead, cheap to run), then (d), so that the headline ratio exists
# even when a time budget cuts the row short. benchmarks.suite.run compiles (b), (b') and (c) of
# every row ahead of time and runs every row's Brax (a), (a') after all rows' (b)-(d), cheapest
# first, so a budget cuts the Brax runs (SAC's last) first.
RUN_ORDER = ("single_jit", "single_jit_flags", "rose_jax", "hand_pipelined", "brax", "brax_flags")
BRAX_VARIANTS = ("brax", "brax_flags")  # run last, as whole Brax train() calls


def with_informed_peers(variants: tuple[str, ...]) -> tuple[str, ...]:
    """``variants`` with each peer's flagged partner (:data:`INFORMED_PEERS`) right after it, once."""
    out: list[str] = []
    for v in variants:
        if v not in out:
            out.append(v)
        partner = INFORMED_PEERS.get(v)
        if partner is not None and partner not in out:
            out.append(partner)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """How :func:`rose_jax.optimize.optimize` is called for variant (d).

    ``candidates``: ``((transform_name, ((param, value), ...)), ...)`` rebuilt with
    ``rose_jax.optimize.transform_by_name``; ``None`` lets the optimizer generate its own from the
    LoopTree (costs one compile per measured candidate). The rest are ``optimize``'s keywords.
    """

    candidates: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] | None = (
        ("group_rollout", (("groups", 2), ("mode", "interleaved"))),
    )
    max_candidates: int = 2
    n_iters: int = 2
    repeats: int = 2
    local: bool = False
    combine: bool = False
    # How a kept (jittable) plan is timed: "scan" = K iterations of its step in one jitted
    # lax.scan, exactly like (b) (one more compile); "host" = K dispatches of the compiled step
    # the optimizer returns (no compile; asynchronous dispatch keeps the GPU queue full whenever an
    # iteration takes longer than its dispatch). An empty plan is always timed with (b)'s loop.
    measure: str = "scan"
    # optimize(check_slower=...): False times candidates first and checks equality only for one
    # that is faster (a search where nothing wins then costs no equality compiles: on a GPU the
    # baseline's and each candidate's recompiles under deterministic XLA ops)
    check_slower: bool = True
    # optimize(equality_iters=...): calls checked for equality (None: n_iters)
    equality_iters: int | None = None

    def __post_init__(self):
        if self.measure not in ("scan", "host"):
            raise ValueError(f"OptimizerSettings.measure must be 'scan' or 'host', got {self.measure!r}")

    def to_json(self) -> dict:
        return {
            "candidates": None if self.candidates is None else [[n, dict(p)] for n, p in self.candidates],
            "max_candidates": self.max_candidates,
            "n_iters": self.n_iters,
            "repeats": self.repeats,
            "local": self.local,
            "combine": self.combine,
            "measure": self.measure,
            "check_slower": self.check_slower,
            "equality_iters": self.equality_iters,
        }


# The full suite lets the optimizer generate candidates from the LoopTree (highest predicted gain
# first) and measures the best two end to end.
GENERATED = OptimizerSettings(
    candidates=None, max_candidates=2, n_iters=2, repeats=2, local=False, combine=True
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One row: ``algo`` on ``env`` with ``num_envs`` envs and a ``policy_hidden_sizes`` MLP.

    Attributes:
      algo: ``"ppo"`` or ``"sac"``.
      env: an ``envs`` registry name, or ``"brax:<name>"`` for a Brax env outside the registry
        (built with ``envs.brax_envs.make_brax``).
      num_envs: environments stepped in parallel (all variants).
      policy_hidden_sizes: policy MLP widths (SAC: also its Q networks', as Brax uses one size).
      backend: Brax physics backend (``"mjx"``, ``"generalized"``, ...) for Brax envs, else None.
      brax_env: the env's name in Brax's registry for variant (a); None: no Brax variant.
      episode_length: time limit in env steps (all variants).
      hyperparameters: algorithm config fields as ``((name, value), ...)`` (hashable).
      iterations_per_block: K, iterations per timed call (PPO: unrolls of every env; SAC: env
        steps of every env, each followed by ``grad_updates_per_step`` gradient steps).
      blocks: timed calls per variant (the median is reported).
      variants: which of :data:`VARIANTS` run.
      groups: env groups of the hand-pipelined baseline (c).
      return_threshold: mean episode return for the time-to-threshold measurement (None: none).
      threshold_max_s: give up on the threshold after this many seconds of training.
      optimizer: settings of variant (d).
      seed: PRNG seed of every variant.
      unit: what one timed call is: ``"iteration"`` (K training iterations) or ``"epoch"`` (Brax's
        train loop between two progress reports: K training iterations, then an evaluation of
        ``eval_envs`` fresh envs for ``episode_length`` steps with the deterministic policy;
        ``algos.ppo.epoch`` / ``algos.sac.epoch``). Epoch rows count training env steps over the
        whole call's wall time, evaluation included, for every variant (Brax's too).
      eval_envs: evaluation envs of an epoch row.
      epochs_per_block: epochs per timed call of an epoch row (a host loop, as Brax's train
        loop; work a plan runs behind the next epoch is waited for at the end of the call, so the
        last epoch's is always exposed: longer runs gain more).
    """

    algo: str
    env: str
    num_envs: int
    policy_hidden_sizes: tuple[int, ...]
    backend: str | None = None
    brax_env: str | None = None
    episode_length: int = 1000
    hyperparameters: tuple[tuple[str, Any], ...] = ()
    iterations_per_block: int = 5
    blocks: int = 3
    variants: tuple[str, ...] = VARIANTS
    groups: int = 2
    return_threshold: float | None = None
    threshold_max_s: float = 60.0
    optimizer: OptimizerSettings = OptimizerSettings()
    seed: int = 0
    unit: str = "iteration"
    eval_envs: int = 128
    epochs_per_block: int = 3

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"Workload.{field} {why}, got {getattr(self, field)!r}")

        if self.algo not in ("ppo", "sac"):
            bad("algo", "must be 'ppo' or 'sac'")
        positive = (
            "num_envs",
            "iterations_per_block",
            "blocks",
            "groups",
            "episode_length",
            "epochs_per_block",
        )
        for f in positive:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(f, "must be a positive int")
        object.__setattr__(self, "policy_hidden_sizes", tuple(self.policy_hidden_sizes))
        object.__setattr__(self, "variants", tuple(self.variants))
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            bad("variants", f"has unknown names {unknown} (known: {', '.join(VARIANTS)})")
        for v in BRAX_VARIANTS:
            if v in self.variants and self.brax_env is None:
                bad("variants", f"includes {v!r} but brax_env is None (Brax runs only Brax envs)")
        if self.groups != 2:
            bad("groups", "must be 2 (the hand-pipelined baseline staggers two env groups)")
        if self.num_envs % self.groups:
            bad("num_envs", f"must be divisible by groups={self.groups}")
        if self.unit not in UNITS:
            bad("unit", f"must be one of {UNITS}")
        if isinstance(self.eval_envs, bool) or not isinstance(self.eval_envs, int) or self.eval_envs <= 0:
            bad("eval_envs", "must be a positive int")
        if self.unit == "epoch" and "hand_pipelined" in self.variants:
            bad("variants", "includes 'hand_pipelined', which is built for iteration rows only")
        if self.unit == "epoch" and self.return_threshold is not None:
            bad("return_threshold", "must be None for an epoch row (time to threshold runs iterations)")

    @property
    def name(self) -> str:
        """Row id, e.g. ``ppo-ant-2048-4x32`` (uniform widths) or ``ppo-cartpole-64-16-16``."""
        sizes = self.policy_hidden_sizes
        if len(set(sizes)) == 1:
            net = f"{len(sizes)}x{sizes[0]}"
        else:
            net = "-".join(map(str, sizes))
        env = self.env.split(":")[-1]
        return f"{self.algo}-{env}-{self.num_envs}-{net}" + ("-epoch" if self.unit == "epoch" else "")

    @property
    def hp(self) -> dict[str, Any]:
        return dict(self.hyperparameters)

    @property
    def unroll_length(self) -> int:
        return int(self.hp.get("unroll_length", 1)) if self.algo == "ppo" else 1

    @property
    def env_steps_per_iteration(self) -> int:
        """Single-env transitions collected by one iteration of our algorithms."""
        if self.algo == "ppo":
            return self.num_envs * self.unroll_length
        return self.num_envs * int(self.hp.get("steps_per_iteration", 1))

    @property
    def env_steps_per_call(self) -> int:
        """Training env steps of one timed call (K iterations; an epoch row: ``epochs_per_block`` epochs)."""
        epochs = self.epochs_per_block if self.unit == "epoch" else 1
        return self.env_steps_per_iteration * self.iterations_per_block * epochs

    @property
    def total_timed_env_steps(self) -> int:
        """Env steps of one variant's warm-up, timed blocks and activity block together (upper bound)."""
        return self.env_steps_per_call * (self.blocks + 3)

    def make_env(self):
        """The environment of our variants (b)-(d) (imports envs, and Brax for Brax envs)."""
        import envs

        kw: dict[str, Any] = {"episode_length": self.episode_length}
        if self.backend is not None:
            kw["backend"] = self.backend
        if self.env.startswith("brax:"):
            from envs import brax_envs

            return brax_envs.make_brax(self.env.split(":", 1)[1], **kw)
        return envs.make(self.env, **kw)

    def config(self, env):
        """The algorithm's config (``PPOConfig`` / ``SACConfig``) for ``env``."""
        import algos

        hp = self.hp
        if self.algo == "ppo":
            hp.setdefault("num_timesteps", max(self.total_timed_env_steps, 1))
            return algos.make_config(
                "ppo",
                num_envs=self.num_envs,
                policy_hidden_sizes=self.policy_hidden_sizes,
                seed=self.seed,
                **hp,
            )
        hp.setdefault("num_timesteps", max(self.total_timed_env_steps, 2))
        hp.setdefault("max_replay_size", self.replay_capacity)
        if self.unit == "epoch":
            hp.setdefault("num_eval_envs", self.eval_envs)  # sac.epoch's evaluation
        hp.setdefault("target_entropy", -0.5 * env.action_size)  # Brax's SAC: -0.5 * action_size
        return algos.make_config(
            "sac",
            num_envs=self.num_envs,
            policy_hidden_sizes=self.policy_hidden_sizes,
            q_hidden_sizes=self.policy_hidden_sizes,
            seed=self.seed,
            **hp,
        )

    @property
    def replay_capacity(self) -> int:
        """SAC replay capacity (ours and Brax's): every transition of a threshold run or a timed run fits."""
        return max(self.total_timed_env_steps, self.num_envs * 64)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["name"] = self.name
        d["hyperparameters"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.hyperparameters}
        d["optimizer"] = self.optimizer.to_json()
        return d


@dataclasses.dataclass(frozen=True)
class Suite:
    """A named set of workloads.

    ``budget_s``: wall-time budget of one run (part) including compilation; a variant that is not
    expected to finish within it is skipped and recorded as such (None: no budget).
    ``measure_threshold``: run the time-to-threshold measurement where a workload defines one.
    """

    name: str
    description: str
    workloads: tuple[Workload, ...]
    budget_s: float | None = None
    measure_threshold: bool = False


# ------------------------------------------------------------------------------ hyperparameters

# Brax's PPO defaults for the locomotion tasks (brax/training/agents/ppo examples), one unroll per
# env per iteration. reward_scaling follows Brax's per-env choices.
PPO_HP = (
    ("unroll_length", 10),
    ("num_minibatches", 16),
    ("num_epochs", 4),
    ("learning_rate", 3e-4),
    ("entropy_cost", 1e-2),
    ("discounting", 0.97),
    ("gae_lambda", 0.95),
    ("clipping_epsilon", 0.3),
    ("normalize_observations", True),
    ("normalize_advantage", True),
    ("max_grad_norm", None),
    ("value_cost", 0.5),
    ("value_hidden_sizes", (256,) * 5),
    ("activation", "swish"),
)
REWARD_SCALING = {"ant": 10.0, "humanoid": 0.1, "halfcheetah": 1.0, "mjx_swimmer": 1.0}

SAC_HP = (
    ("learning_rate", 6e-4),
    ("alpha_learning_rate", 3e-4),
    ("discounting", 0.97),
    ("tau", 0.005),
    ("batch_size", 256),
    ("grad_updates_per_step", 8),
    ("min_replay_size", 0),
    ("normalize_observations", True),
    ("activation", "relu"),
    ("init_alpha", 1.0),
)

# Return thresholds for the optional time-to-threshold measurement (mean last-episode return).
THRESHOLDS = {"ant": 1000.0, "halfcheetah": 1000.0, "humanoid": 1000.0, "mjx_swimmer": 20.0}

MJX_ENVS = ("ant", "humanoid", "halfcheetah")
MJCF_ENV = "mjx_swimmer"  # plain MJX from envs/assets/swimmer.xml (envs/mjcf.py)
POLICY_SIZES = ((32,) * 4, (256,) * 4)
ENV_COUNTS = {"ppo": (2048, 8192), "sac": (256, 1024)}


def _with(base: tuple, **overrides) -> tuple:
    d = dict(base)
    d.update(overrides)
    return tuple(d.items())


def ppo_row(env: str, num_envs: int, policy: tuple[int, ...], **kw) -> Workload:
    """A PPO row on a Brax MJX env (``ant`` ...) or the MJCF env, Brax's matched hyperparameters."""
    return _row("ppo", PPO_HP, env, num_envs, policy, kw)


def sac_row(env: str, num_envs: int, policy: tuple[int, ...], **kw) -> Workload:
    """A SAC row (one env step of every env + ``grad_updates_per_step`` gradient steps per iteration)."""
    kw.setdefault("iterations_per_block", 40)
    return _row("sac", SAC_HP, env, num_envs, policy, kw)


def _row(algo: str, base_hp: tuple, env: str, num_envs: int, policy: tuple[int, ...], kw: dict) -> Workload:
    is_brax = env in MJX_ENVS
    fields = dict(
        algo=algo,
        env=env,
        num_envs=num_envs,
        policy_hidden_sizes=policy,
        backend="mjx" if is_brax else None,
        brax_env=env if is_brax else None,
        hyperparameters=_with(base_hp, reward_scaling=REWARD_SCALING.get(env, 1.0)),
        return_threshold=THRESHOLDS.get(env),
        variants=VARIANTS if is_brax else ("single_jit", "hand_pipelined", "rose_jax"),
    )
    if kw.get("unit") == "epoch":  # no hand pipeline, no time-to-threshold run for epoch rows
        fields.update(
            return_threshold=None,
            variants=tuple(v for v in fields["variants"] if v != "hand_pipelined"),
        )
    fields.update(kw)
    fields["variants"] = with_informed_peers(tuple(fields["variants"]))
    return Workload(**fields)


# ------------------------------------------------------------------------------ suites

_TINY_PPO = (
    ("unroll_length", 8),
    ("num_minibatches", 4),
    ("num_epochs", 2),
    ("learning_rate", 3e-3),
    ("value_hidden_sizes", (16, 16)),
    ("activation", "tanh"),
    ("entropy_cost", 1e-3),
    ("reward_scaling", 0.1),
    ("normalize_observations", True),
    ("max_grad_norm", 1.0),
)
_TINY_SAC = (
    ("learning_rate", 1e-3),
    ("batch_size", 32),
    ("grad_updates_per_step", 2),
    ("min_replay_size", 0),
    ("normalize_observations", False),
    ("activation", "relu"),
    ("reward_scaling", 1.0),
)
_TINY_OPT = OptimizerSettings(n_iters=1, repeats=1)
# The offload candidate (the evaluation behind the next epoch's training), equality over one epoch.
EPOCH_OPT = OptimizerSettings(
    candidates=(("offload_component", (("component", "evaluate"),)),),
    max_candidates=1,
    n_iters=3,
    repeats=1,
    check_slower=False,
    equality_iters=1,
)


def _tiny_row(
    algo: str,
    env: str,
    num_envs: int,
    episode_length: int,
    hyperparameters: tuple,
    iterations_per_block: int,
    **kw,
) -> Workload:
    """A tiny CPU row: (16, 16) policy, 2 timed blocks, variants (b)-(d), the tiny optimizer settings."""
    fields = dict(
        policy_hidden_sizes=(16, 16),
        blocks=2,
        variants=("single_jit", "hand_pipelined", "rose_jax"),
        optimizer=_TINY_OPT,
    )
    fields.update(kw)
    fields["variants"] = with_informed_peers(tuple(fields["variants"]))
    return Workload(
        algo=algo,
        env=env,
        num_envs=num_envs,
        episode_length=episode_length,
        hyperparameters=hyperparameters,
        iterations_per_block=iterations_per_block,
        **fields,
    )


_TINY_SAC_ROW = _tiny_row("sac", "pendulum", 8, 50, _TINY_SAC, 8)
_TINY_BRAX_ROW = _tiny_row(
    "ppo",
    "brax:fast",
    16,
    50,
    _with(_TINY_PPO, num_minibatches=4, num_epochs=1, max_grad_norm=None),
    2,
    backend="generalized",
    brax_env="fast",
    variants=("single_jit", "rose_jax", "brax"),
)


def _tiny_epoch(w: Workload) -> Workload:
    """A tiny row as an epoch row (Brax's train loop): 2 epochs per call, 4 evaluation envs."""
    return dataclasses.replace(
        w,
        unit="epoch",
        eval_envs=4,
        epochs_per_block=2,
        variants=tuple(v for v in w.variants if v != "hand_pipelined"),
        optimizer=dataclasses.replace(EPOCH_OPT, n_iters=2),
    )


TINY = Suite(
    name="tiny",
    description="CPU smoke suite: pure-JAX cartpole (PPO) and pendulum (SAC), Brax's trivial 'fast' env "
    "(Brax's ppo.train vs ours); plumbing, not performance",
    workloads=(
        _tiny_row("ppo", "cartpole", 32, 100, _TINY_PPO, 4, return_threshold=90.0, threshold_max_s=5.0),
        _TINY_SAC_ROW,
        _TINY_BRAX_ROW,
        _tiny_epoch(_TINY_BRAX_ROW),  # (a) with Brax's own evaluations
        _tiny_epoch(_TINY_SAC_ROW),
    ),
    budget_s=None,
    measure_threshold=True,
)

# The quick rows' candidate: per-component compilation (each stage compiled with the fastest of
# the option sets below, measured), the overlap experiment's winner on the H200
# (benchmarks/results/overlap/). "no_command_buffers" is left out: MJX runs about 3x slower without
# command buffers, measuring it only costs compiles. Even one such candidate makes the suite three parts
# (humanoid's search alone took 238 s on 2026-12-04); with the informed peers (a'), (b') four.
# PPO: rollout | learn with "default" or "concurrent" per stage (PPO ant 4096 on the H200: the rollout
# fastest by default, the learn's scans 1.9x faster captured as CONCURRENT command buffers). SAC: the
# split lost (0.96x on ant 1024); the whole iteration as one stage under its fastest option set won
# at 128 envs (1.45x ant with loops captured, 1.44x hopper without), so both sets are measured.
_QUICK_OPT = OptimizerSettings(
    candidates=(("split_compile", (("option_sets", ("default", "concurrent")),)),),
    max_candidates=1,
    measure="host",
    check_slower=False,
)
_QUICK_SAC_OPT = dataclasses.replace(
    _QUICK_OPT,
    candidates=(
        ("split_compile", (("boundaries", ()), ("option_sets", ("concurrent", "concurrent_no_loops")))),
    ),
)
_QUICK = dict(blocks=3, optimizer=_QUICK_OPT)  # every quick row: 3 timed blocks, one candidate
_QUICK_NET = (32,) * 4
_B_D = ("single_jit", "rose_jax")  # (b) and (d) only: no Brax variant, no hand pipeline
QUICK = Suite(
    name="quick",
    description="H200 headline suite: PPO ant (all four variants), SAC ant 1024 envs, PPO MJCF swimmer "
    "and PPO humanoid at 2048 envs, 4x32 policy; few iterations; one optimizer candidate (per-"
    "component compilation, XLA options measured per stage); each peer also with the best global XLA "
    "flag ((a'), (b')); four parts (--part 1/4 .. 4/4), one device call each; (b)/(b')/(c) compiled ahead "
    "in parallel; Brax runs last in each part",
    workloads=(
        ppo_row("ant", 2048, _QUICK_NET, iterations_per_block=4, **_QUICK),
        sac_row(
            "ant",
            1024,
            _QUICK_NET,
            variants=("single_jit", "rose_jax", "brax"),
            blocks=3,
            optimizer=_QUICK_SAC_OPT,
        ),
        ppo_row(MJCF_ENV, 2048, _QUICK_NET, variants=_B_D, iterations_per_block=4, **_QUICK),
        ppo_row("humanoid", 2048, _QUICK_NET, variants=_B_D, iterations_per_block=3, **_QUICK),
    ),
    # in-process seconds; process start, the prelude (wheel install), JAX/Brax imports and file
    # writes fit in the rest of 8 min (the 2026-12-02 21:45 run: 449 s in process, 457 s device call)
    budget_s=465.0,
)


def _full_workloads() -> tuple[Workload, ...]:
    rows = []
    for algo, make in (("ppo", ppo_row), ("sac", sac_row)):
        for env in MJX_ENVS + (MJCF_ENV,):
            for policy in POLICY_SIZES:
                for n in ENV_COUNTS[algo]:
                    rows.append(make(env, n, policy, optimizer=GENERATED))
    return tuple(rows)


FULL = Suite(
    name="full",
    description="every combination: {PPO, SAC} x {ant, humanoid, halfcheetah (MJX), mjx_swimmer (MJCF)} x "
    "{4x32, 4x256} x two env counts; the optimizer generates its candidates",
    workloads=_full_workloads(),
    budget_s=450.0,
)

EPOCH = Suite(
    name="epoch",
    description="Brax's train loop on the H200: PPO ant 2048 envs and SAC ant 1024 envs, 4x32 policy; one "
    "epoch = about 1M (PPO) / 0.5M (SAC) training env steps, then an evaluation of 128 envs x 1000 steps "
    "(deterministic policy); 3 epochs per timed call; (a) Brax's train() with its evaluations, (b) our "
    "jitted epoch, (d) the optimizer with the offload candidate, (a') and (b') with the peer's XLA flag. Run "
    "as an MPS client (--mps-client), one row per part (--part 1/2, --part 2/2), each under 9.5 min: "
    "with (a') and (b') a row's Brax runs (last) no longer fit and are cut by the budget",
    workloads=(
        ppo_row("ant", 2048, (32,) * 4, unit="epoch", iterations_per_block=50, blocks=2, optimizer=EPOCH_OPT),
        sac_row(
            "ant", 1024, (32,) * 4, unit="epoch", iterations_per_block=500, blocks=2, optimizer=EPOCH_OPT
        ),
    ),
    budget_s=560.0,  # one part per device call (10 min each)
)

SUITES = {s.name: s for s in (TINY, QUICK, EPOCH, FULL)}


def get(name: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(SUITES)}")
    return SUITES[name]


# ------------------------------------------------------------------------------ cost model

# Calibrated on H200 quick-suite logs (benchmarks/results/suite/quick/logs/suite_quick.log, jax 0.11.2):
# COMPILE_S is the seconds to compile and warm up (b)'s K-iteration loop of one env (PPO ant 17.5 s,
# SAC ant 17.5 s, PPO mjx_swimmer 14.8 s; humanoid and halfcheetah are guesses from model size).
# VARIANT_COMPILES scales it per variant: (c) 29.8 s on ant = 1.7x; Brax's whole train() (its env
# reset, prefill, epoch compile and the recompile of epoch 2 on JAX >= 0.11; its timed epochs are
# < 1 s) 57.6 s PPO = 3.3x, 95.9 s SAC = 5.5x; (d) is the optimizer's baseline compile and trace
# (1.0x: SAC ant 18.6 s) plus 1.5x per measured candidate (PPO ant, one candidate: 44.3 s).
# A model for planning runs and parts, not a measurement.
# Recalibrated on the 2026-12-04 06:00-06:20 quick run (logs/part-{1,2}-of-2.log, logs/humanoid.log):
# (b) compiled in 23.8-27.5 s on ant and 24.6 s on mjx_swimmer two rows at a time (~1.15x slower than
# alone), humanoid 39.1 s alone.
COMPILE_S = {"ant": 21.0, "humanoid": 38.0, "halfcheetah": 18.0, "mjx_swimmer": 21.0}
CPU_COMPILE_S = 4.0
VARIANT_COMPILES = {
    "brax": 3.3,
    "brax_flags": 3.3,  # the same train() in a child process (+ BRAX_CHILD_START_S)
    "single_jit": 1.0,
    "single_jit_flags": 1.0,  # (b) compiled again with the peer's XLA options
    "hand_pipelined": 1.7,
    "rose_jax": 1.0,  # + CANDIDATE_COMPILES per measured candidate, see compile_s
}
BRAX_SAC_COMPILES = 6.0  # Brax's SAC train() took 125.7 s on ant on 2026-12-04 (6.0 x 21 s)
# (a')'s child process: Python, JAX (CUDA) and Brax start before its train() (a guess, not measured)
BRAX_CHILD_START_S, CPU_BRAX_CHILD_START_S = 10.0, 4.0
CANDIDATE_COMPILES = 1.5
# A split_compile candidate compiles every stage under every option set it measures, each first in
# an isolated child: the 2026-12-04 quick run (3 sets; search PPO ant 133 s, SAC ant 104 s) fits
# about 2 compiles per option set (children and in-process compiles of the stages together).
# Since the stages load their isolated children's executables from the persistent cache (the suite
# runs with one), about one compile per set is expected; left at 2.0 until a GPU run measures it.
SPLIT_COMPILES_PER_SET = 2.0
# A kept multi-stage split (PPO's rollout | learn, kept on every PPO row so far) is compiled again for
# (d)'s timed loop (its stages with the chosen options, state donated): (d) compiled and warmed up
# in 36.8 s (ant), 35.7 s (mjx_swimmer), 61.9 s (humanoid) after the search on 2026-12-04, and the
# search itself took 132 / 95 / 238 s: (search + warm-up) / (b)'s compile = 6.2-8.0 with two option
# sets, which 1 + 2 x 2 + 2 = 7 fits. That warm-up measured every option set again; since the plan
# records the sets it chose (HostStep.measured_params), it compiles each stage once: expected ~1.0,
# left at 2.0 until a GPU run measures it.
SPLIT_PLAN_COMPILES = 2.0
# (d) with check_slower (the default) on a GPU also compiles the baseline and every measured
# candidate under deterministic XLA ops for the equality check: the 2026-12-02 21:45 quick run
# (search PPO ant 87 s, humanoid 141 s, mjx_swimmer 64 s, SAC ant 36 s) fits 1.0 per program.
EQUALITY_COMPILES = 1.0
# A row's setup (env build, initial state's compile) ~ SETUP_S + SETUP_PER_COMPILE * COMPILE_S
# (log: ant 14-20 s, mjx_swimmer 12 s, humanoid 18 s); START_S: JAX/CUDA start of the process.
SETUP_S, SETUP_PER_COMPILE, START_S = 6.0, 0.5, 6.0
# Seconds per device-resident variant for the SM-activity call (>= 0.5 s + sampler windows).
ACTIVITY_S = 0.8
# Rough H200 env-steps/s (log: PPO ant 4.8e5, SAC ant 2.5e5, PPO mjx_swimmer 1.5e5).
RATE = {"ant": 4.8e5, "humanoid": 1.5e5, "halfcheetah": 5e5, "mjx_swimmer": 1.5e5}
# Concurrent compiles of the precompile phase (benchmarks.suite.run --compile-workers): each extra
# worker adds this fraction of a worker's throughput (the GIL serialises tracing; XLA's own
# passes already use some cores), and the slowest row is slowed by PARALLEL_SLOWDOWN.
PARALLEL_EFFICIENCY, PARALLEL_SLOWDOWN = 0.5, 1.15
# variants benchmarks.suite.run compiles ahead of time
PRECOMPILED = ("single_jit", "single_jit_flags", "hand_pipelined")
# Epoch rows (benchmarks/results/optimize_epoch*/logs, H200): the epoch program (training scan + evaluation)
# compiles in ~28 s on ant vs 21 s for the K-iteration loop; an evaluation of 128 envs x 1000
# latency-bound MJX steps takes ~2.0 s (seconds per evaluation step below; CPU: tiny envs).
EPOCH_COMPILES = 1.35  # 28 s / COMPILE_S["ant"]
EVAL_STEP_S = {"ant": 2.0e-3, "humanoid": 3.0e-3, "halfcheetah": 2.0e-3, "mjx_swimmer": 2.5e-3}
CPU_EVAL_STEP_S = 2e-4


def _env(w: Workload) -> str:
    return w.env.split(":")[-1]


def _measured_candidates(w: Workload) -> int:
    o = w.optimizer
    measured = o.max_candidates if o.candidates is None else min(len(o.candidates), o.max_candidates)
    if w.algo == "sac" and o.candidates is not None and all(n == "group_rollout" for n, _ in o.candidates):
        measured = 0  # illegal for SAC's collect: rejected before any compile
    return measured


def _candidate_compiles(w: Workload) -> float:
    """Compiles of ``w``'s measured candidates (in units of its (b) compile)."""
    o, measured = w.optimizer, _measured_candidates(w)
    if o.candidates is None:
        return measured * CANDIDATE_COMPILES
    total = 0.0
    for name, params in o.candidates[:measured]:
        if name == "split_compile":
            from rose_jax.optimize.split_compile import MEASURED_SETS  # noqa: PLC0415 - lazily: JAX

            sets = dict(params).get("option_sets") or MEASURED_SETS
            total += SPLIT_COMPILES_PER_SET * len(sets)
            if dict(params).get("boundaries", None) != ():  # stages: the kept plan's recompile
                total += SPLIT_PLAN_COMPILES
        else:
            total += CANDIDATE_COMPILES
    return total


def setup_s(w: Workload, gpu: bool = True) -> float:
    """Estimated seconds to build ``w``'s env and initial state (compile of the reset included)."""
    if not gpu:
        return 1.0
    return SETUP_S + SETUP_PER_COMPILE * COMPILE_S.get(_env(w), 17.5)


def compile_s(w: Workload, variant: str, gpu: bool = True) -> float:
    """Estimated compile (and, for (d), search; for (a), whole-train overhead) seconds of a variant."""
    base = COMPILE_S.get(_env(w), 17.5) if gpu else CPU_COMPILE_S
    if w.unit == "epoch" and variant not in BRAX_VARIANTS:
        base *= EPOCH_COMPILES
    if variant in BRAX_VARIANTS:
        seconds = base * (BRAX_SAC_COMPILES if w.algo == "sac" else VARIANT_COMPILES[variant])
        if variant == "brax_flags":  # a child process
            seconds += BRAX_CHILD_START_S if gpu else CPU_BRAX_CHILD_START_S
        return seconds
    if variant == "rose_jax":
        o = w.optimizer
        measured = _measured_candidates(w)
        n = (
            VARIANT_COMPILES["rose_jax"]
            + _candidate_compiles(w) * (2.0 if o.local else 1.0)
            + (1.0 if o.measure == "scan" and measured else 0.0)
        )
        # equality under deterministic ops: baseline + each candidate again (an epoch row's offload
        # candidate wins, so its equality is checked whatever check_slower says)
        if gpu and (o.check_slower or (w.unit == "epoch" and measured)):
            n += EQUALITY_COMPILES * (1 + measured)
        return base * n
    return base * VARIANT_COMPILES[variant]


def run_s(w: Workload, variant: str, gpu: bool = True) -> float:
    """Estimated seconds of a variant's timed runs (warm-up, blocks, activity call; (d): its search runs)."""
    seconds = w.total_timed_env_steps / (RATE.get(_env(w), 3e5) if gpu else 2e4)
    if w.algo == "sac":
        seconds *= 1.0 + 0.05 * int(w.hp.get("grad_updates_per_step", 1))
    if w.unit == "epoch":
        # one evaluation per epoch; the search runs whole epochs: the baseline twice, each measured
        # candidate in turns with it, the equality epochs (reference, its reproducibility, candidate)
        epoch_s = seconds / ((w.blocks + 3) * w.epochs_per_block)
        epoch_s += w.episode_length * (EVAL_STEP_S.get(_env(w), 2e-3) if gpu else CPU_EVAL_STEP_S)
        seconds = (w.blocks + 3) * w.epochs_per_block * epoch_s
        if variant == "rose_jax":
            o, measured = w.optimizer, _measured_candidates(w)
            eq = o.equality_iters or o.n_iters
            seconds += epoch_s * (2 * o.repeats * o.n_iters * (1 + measured) + 3 * eq)
        if gpu and variant not in BRAX_VARIANTS:
            seconds += ACTIVITY_S
        return seconds
    if variant == "rose_jax":
        o = w.optimizer
        seconds *= 1.0 + 2.0 * o.repeats * o.n_iters * (1 + _measured_candidates(w)) / max(
            w.iterations_per_block * w.blocks, 1
        )
    if gpu and variant not in BRAX_VARIANTS:
        seconds += ACTIVITY_S
    return seconds


def estimate_s(w: Workload, variant: str | None = None, gpu: bool = True, precompiled: bool = False) -> float:
    """Estimated seconds of one variant of ``w`` (or of the whole row with its setup), run in sequence.

    ``precompiled``: the variant's program was compiled ahead of time (see :data:`PRECOMPILED`):
    only its runs are left.
    """
    if variant is None:
        return sum(estimate_s(w, v, gpu) for v in w.variants) + setup_s(w, gpu)
    if precompiled and variant in PRECOMPILED:
        return run_s(w, variant, gpu)
    return compile_s(w, variant, gpu) + run_s(w, variant, gpu)


def plan_s(rows: tuple[Workload, ...], gpu: bool = True, workers: int = 1) -> dict:
    """Estimated seconds of ``benchmarks.suite.run``'s three phases over ``rows``.

    1. precompile: every row's setup and its :data:`PRECOMPILED` variants' compiles, ``workers``
       rows at a time; 2. per row: (d)'s search and the timed runs of (b), (b'), (d), (c);
    3. the Brax runs (a) and (a'), cheapest row first. Returns ``{"start", "precompile",
    "precompile_serial", "rows": {name: {"precompile", "measure", "brax"}}, "brax_order", "total"}``.
    """
    per_row = {}
    for w in rows:
        pre = setup_s(w, gpu) + sum(compile_s(w, v, gpu) for v in w.variants if v in PRECOMPILED)
        measure = sum(
            estimate_s(w, v, gpu, precompiled=True) for v in w.variants if v not in BRAX_VARIANTS
        )
        brax = brax_s(w, gpu)
        per_row[w.name] = {"precompile": pre, "measure": measure, "brax": brax}
    serial = sum(r["precompile"] for r in per_row.values())
    k = max(1, min(int(workers), len(rows)))
    if k == 1:
        pre = serial
    else:
        slowest = max((r["precompile"] for r in per_row.values()), default=0.0)
        pre = max(slowest * PARALLEL_SLOWDOWN, serial / (1.0 + (k - 1) * PARALLEL_EFFICIENCY))
    start = START_S if gpu else 1.0
    total = start + pre + sum(r["measure"] + r["brax"] for r in per_row.values())
    return {
        "start": start,
        "precompile": pre,
        "precompile_serial": serial,
        "rows": per_row,
        "brax_order": brax_order(rows, gpu),
        "total": total,
    }


def brax_s(w: Workload, gpu: bool = True) -> float:
    """Estimated seconds of ``w``'s Brax runs: (a) in process and (a') in a child process."""
    return sum(estimate_s(w, v, gpu) for v in BRAX_VARIANTS if v in w.variants)


def brax_order(rows: tuple[Workload, ...], gpu: bool = True) -> list[str]:
    """Names of the rows with a Brax variant, in the order their Brax runs go: cheapest first
    (the expensive ones, e.g. SAC's, are then the first a time budget cuts); ties in row order."""
    with_brax = [
        (brax_s(w, gpu), i, w.name)
        for i, w in enumerate(rows)
        if any(v in w.variants for v in BRAX_VARIANTS)
    ]
    return [name for _, _, name in sorted(with_brax)]


def split(workloads: tuple[Workload, ...], part: int, parts: int) -> tuple[Workload, ...]:
    """Part ``part`` (1-based) of ``parts``: rows dealt greedily by estimated cost (largest first).

    Deterministic, so every part of one suite agrees on the split; each row is in exactly one part.
    """
    if not (isinstance(parts, int) and isinstance(part, int) and parts >= 1 and 1 <= part <= parts):
        raise ValueError(f"--part must be i/n with 1 <= i <= n, got {part}/{parts}")
    load = [0.0] * parts
    bins: list[list[int]] = [[] for _ in range(parts)]
    order = sorted(range(len(workloads)), key=lambda i: (-estimate_s(workloads[i]), i))
    for i in order:
        b = min(range(parts), key=lambda k: (load[k], k))
        bins[b].append(i)
        load[b] += estimate_s(workloads[i])
    return tuple(workloads[i] for i in sorted(bins[part - 1]))


def parts_needed(suite: Suite, budget_s: float | None = None, workers: int = 4, gpu: bool = True) -> int:
    """Smallest ``n`` such that every part of ``split(suite.workloads, i, n)`` fits ``budget_s`` as
    ``benchmarks.suite.run`` runs it (:func:`plan_s` with ``workers`` concurrent compiles)."""
    budget = budget_s or suite.budget_s
    if budget is None:
        return 1
    for n in range(1, len(suite.workloads) + 1):
        parts = [split(suite.workloads, i, n) for i in range(1, n + 1)]
        if all(plan_s(p, gpu=gpu, workers=workers)["total"] <= budget for p in parts):
            return n
    return len(suite.workloads)
