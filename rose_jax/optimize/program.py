"""An RL iteration as pieces the optimizer can regroup: :class:`Program`, and env-group pipelining.

A :class:`Program` describes one iteration ``state -> (state, metrics)`` as

* ``collect(state) -> (state, data)``: the rollout over a batch of ``num_envs`` environments,
  whose per-env computations are independent across envs;
* ``learn(state, data) -> (state, metrics)``: everything that mixes envs (normalizer update,
  advantages, the update, metrics);
* lenses: ``env`` picks the state leaves that are the env batch (leading axis = env);
  ``data_env_axis`` (a pytree prefix of ``data``) says which axis of each data leaf is the env
  axis (``None``: not per env);
* optionally ``rollout``: collect as ``start`` / per-step ``step`` / ``finish`` functions, so that
  the env groups can be interleaved inside one loop;
* optionally ``spec``: how a worker process rebuilds the same program (an import path and
  picklable arguments), for the multi-process mode.

:func:`group_rollout` splits the env batch into ``G`` groups ("sequential": one rollout loop
per group, one after the other; "interleaved": one loop whose body steps every group, so XLA
sees G independent policy/sim chains side by side; "processes": each group's rollout runs in its
own worker process under MPS). The results equal the single-batch program's because per-env
computations are independent and the randomness is drawn exactly as the full batch draws it.

:func:`ppo_program` and :func:`sac_program` adapt ``algos.ppo`` / ``algos.sac`` from their public
pieces (the algorithms know nothing of the optimizer).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

import rose_jax
from rose_jax.optimize import _compat as C
from rose_jax.optimize.base import Tolerance, Transform
from rose_jax.program import Data, Lens, Program, ProgramSpec, RolloutParts, State, attr_lens  # noqa: F401

# ------------------------------------------------------------------------------ env batches


def env_mask(program: Program, state: State) -> Any:
    """A pytree like ``state`` with True at the env-batch leaves."""
    falses = jax.tree.map(lambda _: False, state)
    return program.env.set(falses, jax.tree.map(lambda _: True, program.env.get(falses)))


def data_axes(program: Program, data: Data) -> list:
    """The env axis (int or None) of every leaf of ``data``, in flatten order."""
    prefix = program.data_env_axis
    subtrees = jax.tree_util.tree_structure(prefix, is_leaf=lambda x: x is None).flatten_up_to(data)
    axes_flat = jax.tree.leaves(prefix, is_leaf=lambda x: x is None)
    out = []
    for axis, sub in zip(axes_flat, subtrees, strict=True):
        out.extend([axis] * len(jax.tree.leaves(sub)))
    return out


def _take(x, axis, g, n):
    return jax.lax.slice_in_dim(x, g * n, (g + 1) * n, axis=axis)


def split_envs(program: Program, state: State, groups: int) -> list[State]:
    """``groups`` states, each with its slice of the env batch (the other leaves shared)."""
    n = program.num_envs // groups
    env = program.env.get(state)
    return [
        program.env.set(state, jax.tree.map(lambda x, g=g: _take(x, 0, g, n), env)) for g in range(groups)
    ]


def merge_data(program: Program, parts: list[Data]) -> Data:
    """Concatenate per-group data along each leaf's env axis (non-env leaves: group 0's)."""
    axes = data_axes(program, parts[0])
    flats = [jax.tree.leaves(p) for p in parts]
    merged = [
        flats[0][i] if ax is None else jnp.concatenate([f[i] for f in flats], axis=ax)
        for i, ax in enumerate(axes)
    ]
    return jax.tree.unflatten(jax.tree.structure(parts[0]), merged)


def merge_states(program: Program, parts: list[State]) -> State:
    """Group states back into one: env leaves concatenated, other leaves from group 0."""
    envs = [program.env.get(p) for p in parts]
    return program.env.set(parts[0], jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *envs))


# --------------------------------------------------------------------------- grouped collect


def _scan_group(parts: RolloutParts, consts, carry, xs, g: int, groups: int):
    return jax.lax.scan(lambda c, x: parts.step(consts, c, x, g, groups), carry, xs, length=parts.length)


def collect_group(program: Program, state_g: State, g: int, groups: int) -> tuple[State, Data]:
    """The rollout of env group ``g`` of ``groups`` on a state holding only that group's envs.

    With ``program.rollout`` the group draws the full batch's random numbers for its envs;
    otherwise ``collect`` itself is used (exact only if its randomness is per env).
    """
    if groups == 1 or program.rollout is None:
        return program.collect(state_g)
    parts = program.rollout
    consts, carry, xs = parts.start(state_g)
    carry, ys = _scan_group(parts, consts, carry, xs, g, groups)
    return parts.finish(state_g, carry, ys)


def sequential_collect(program: Program, groups: int) -> Callable:
    """One rollout loop per env group, one after the other, in one program."""

    def collect(state):
        outs = [
            collect_group(program, s, g, groups) for g, s in enumerate(split_envs(program, state, groups))
        ]
        return merge_states(program, [o[0] for o in outs]), merge_data(program, [o[1] for o in outs])

    return collect


def interleaved_collect(program: Program, groups: int) -> Callable:
    """One rollout loop whose body steps all env groups: G independent policy/sim chains per step.

    In a step, group g's policy and group g-1's sim are independent equations in one loop body,
    so XLA may schedule and fuse them side by side (software pipelining across groups). On one
    GPU stream this changes scheduling and fusion, not concurrency.
    """
    parts = program.rollout
    if parts is None:
        raise ValueError(f"program {program.name!r} has no RolloutParts: interleaving needs a per-step body")
    n = program.num_envs // groups

    def collect(state):
        consts, carry, xs = parts.start(state)
        carries = [jax.tree.map(lambda x, g=g: _take(x, 0, g, n), carry) for g in range(groups)]

        def body(cs, x):
            outs = [parts.step(consts, c, x, g, groups) for g, c in enumerate(cs)]
            return [o[0] for o in outs], jax.tree.map(
                lambda *ys: jnp.concatenate(ys, axis=0), *[o[1] for o in outs]
            )

        carries, ys = jax.lax.scan(body, carries, xs, length=parts.length)
        carry = jax.tree.map(lambda *cs: jnp.concatenate(cs, axis=0), *carries)
        return parts.finish(state, carry, ys)

    return collect


# ------------------------------------------------------------------------------- legality


class ProgramTree(NamedTuple):
    """What :func:`group_rollout`'s legality check reads: the program and its collect's LoopTree.

    ``tree`` is ``rose_jax.trace.trace(program.collect, state)`` (paths ``state.<leaf>``);
    ``env_inputs``/``env_outputs`` flag the env-batched input/output leaves in jaxpr order.
    """

    program: Program
    tree: Any
    env_inputs: tuple[bool, ...]
    env_outputs: tuple[bool, ...]

    def walk(self):
        return self.tree.walk()


def trace_program(program: Program, state: State) -> ProgramTree:
    """Trace ``program.collect`` on ``state`` (nothing runs) into a :class:`ProgramTree`."""
    from rose_jax import trace as rtrace  # noqa: PLC0415

    tree = rtrace.trace(program.collect, state, arg_names=["state"])
    env_in = tuple(bool(b) for b in jax.tree.leaves(env_mask(program, state)))
    out_state, data = jax.eval_shape(program.collect, state)
    env_out = tuple(bool(b) for b in jax.tree.leaves(env_mask(program, out_state))) + tuple(
        ax is not None for ax in data_axes(program, data)
    )
    return ProgramTree(program, tree, env_in, env_out)


def env_dependent_outputs(closed_jaxpr: Any, tainted_inputs: tuple[bool, ...]) -> list[bool]:
    """Which outputs depend on the tainted inputs (conservatively: any tainted operand taints all results)."""
    jx, _ = C.open_and_consts(closed_jaxpr)
    tainted = {v for v, t in zip(jx.invars, tainted_inputs, strict=True) if t}
    for eqn in jx.eqns:
        if any(not C.is_literal(a) and a in tainted for a in eqn.invars):
            tainted.update(eqn.outvars)
    return [(not C.is_literal(v)) and v in tainted for v in jx.outvars]


def check_collect(ptree: ProgramTree) -> tuple[bool, str]:
    """Is ``collect`` per-env independent? (structure only; the search also compares results).

    1. Every output that is not env-batched (a state leaf outside the env lens, a data leaf with
       env axis None) must not depend on the env batch: otherwise collect reduces over envs (an
       obs normalizer or a metric updated inside the rollout) and must move that to ``learn``.
    2. The ``sim`` component writes only env-batch leaves.
    """
    tree = ptree.tree
    dep = env_dependent_outputs(tree.jaxpr, ptree.env_inputs)
    paths = list(tree.output_paths) or [f"out[{i}]" for i in range(len(dep))]
    bad = [p for p, d, e in zip(paths, dep, ptree.env_outputs, strict=True) if d and not e]
    if bad:
        shown = ", ".join(bad[:4]) + (f" +{len(bad) - 4} more" if len(bad) > 4 else "")
        return False, (
            f"collect reduces over envs into {shown} (not per-env): move that reduction "
            "(e.g. the obs normalizer or a metric) from collect to learn"
        )
    env_paths = {p for p, e in zip(tree.input_paths, ptree.env_inputs, strict=True) if e}
    for node in tree.walk():
        if node.kind == "component" and node.name == "sim":
            outside = sorted(w for w in node.writes if w not in env_paths)
            if outside:
                return False, f"component sim writes {', '.join(outside[:4])}, which are not env-batch leaves"
    return True, "collect's shared outputs do not depend on the env batch; sim writes only env leaves"


# --------------------------------------------------------------------------- group_rollout

GROUP_MODES = ("sequential", "interleaved", "processes")

# Each group's policy network runs on N/G rows instead of N: the matmul library may pick another
# kernel (blocking, split-K) for another row count and round the last bit differently; RL training
# amplifies last-bit differences over iterations. Everything else is per env and bitwise equal.
GROUP_TOLERANCE = Tolerance(
    rtol=1e-4,
    atol=0.0,
    reason="per-group matmuls over N/G rows may use other GEMM kernels (reduction blocking): "
    "last-bit differences, amplified over training iterations; per-env physics is unchanged",
)


def group_rollout(
    groups: int, mode: str = "sequential", *, quotas: tuple[int, ...] | None = None
) -> Transform:
    """Split the env batch into ``groups`` groups for the rollout (see the module docstring).

    ``apply(program) -> program``. ``quotas`` (processes mode): SM percent per worker.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
        raise ValueError(f"group_rollout: groups must be an int >= 2, got {groups!r}")
    if mode not in GROUP_MODES:
        raise ValueError(f"group_rollout: mode must be one of {GROUP_MODES}, got {mode!r}")

    def legal(ptree):
        if not isinstance(ptree, ProgramTree):
            return (
                False,
                "group_rollout needs a Program (trace it with rose_jax.optimize.program.trace_program)",
            )
        program = ptree.program
        if program.host:
            return False, "the program's collect already runs in worker processes"
        if program.groups > 1:
            return False, f"the program's rollout is already split into {program.groups} groups"
        if program.num_envs % groups:
            return False, f"num_envs={program.num_envs} is not divisible by groups={groups}"
        ok, why = check_collect(ptree)
        if not ok:
            return False, why
        if mode == "interleaved" and program.rollout is None:
            return False, "interleaved mode needs the program's RolloutParts (a per-step body)"
        if mode == "processes":
            if program.spec is None:
                return False, "processes mode needs a ProgramSpec so that workers can rebuild the program"
            from rose_jax.optimize import processes  # noqa: PLC0415

            ok, reason = processes.available()
            if not ok:
                return False, reason
        return True, why

    def apply(program: Program) -> Program:
        if not isinstance(program, Program):
            raise ValueError(
                f"group_rollout applies to a rose_jax.optimize.program.Program, got {type(program).__name__}"
            )
        if program.num_envs % groups:
            raise ValueError(
                f"group_rollout: num_envs={program.num_envs} is not divisible by groups={groups}"
            )
        if mode == "sequential":
            collect = sequential_collect(program, groups)
        elif mode == "interleaved":
            collect = interleaved_collect(program, groups)
        else:
            from rose_jax.optimize import processes  # noqa: PLC0415

            collect = processes.ProcessCollect(program, groups, quotas=quotas)
            return program._replace(collect=collect, host=True, groups=groups, mode=mode)
        return program._replace(collect=collect, groups=groups, mode=mode)

    params = (("groups", groups), ("mode", mode)) + ((("quotas", quotas),) if quotas else ())
    return Transform(
        "group_rollout",
        params,
        GROUP_TOLERANCE,
        "program" if mode != "processes" else "host",
        legal,
        apply,
        summary=f"rollout in {groups} env groups ({mode})",
    )


_FACTORIES: dict[str, Callable[..., Transform]] = {}


def register_transform(name: str, factory: Callable[..., Transform]) -> None:
    """Make ``transform_by_name(name, params)`` call ``factory(**params)`` (for cached plans)."""
    if not name or not callable(factory):
        raise ValueError(f"register_transform: need a name and a callable factory, got {name!r}, {factory!r}")
    _FACTORIES[name] = factory


def known_transforms() -> list[str]:
    _builtin_factories()
    return sorted(_FACTORIES)


def _builtin_factories() -> None:
    from rose_jax.optimize import transforms as T  # noqa: PLC0415

    for name, factory in (
        ("unroll_scans", T.unroll_scans),
        ("hoist_invariants", T.hoist_invariants),
        ("overlap_independent", T.overlap_independent),
        ("group_rollout", group_rollout),
        ("offload_component", _offload_component),
    ):
        _FACTORIES.setdefault(name, factory)


def _offload_component(**kw) -> Transform:
    from rose_jax.optimize import offload  # noqa: PLC0415 - host-level machinery, loaded on use

    return offload.offload_component(**kw)


def transform_by_name(name: str, params: dict) -> Transform:
    """Rebuild a transform from its ``name`` and JSON params (plan cache, worker processes)."""
    _builtin_factories()
    if name not in _FACTORIES:
        raise ValueError(f"unknown transform {name!r}; known: {', '.join(sorted(_FACTORIES))}")
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()}
    return _FACTORIES[name](**params)


# ------------------------------------------------------------------------------ PPO adapter


def ppo_program(
    config: Any, env: Any = None, *, env_name: str | None = None, env_kwargs: tuple = ()
) -> Program:
    """``algos.ppo``'s iteration as a :class:`Program` (equal to ``ppo.iteration(config, env)``).

    ``env`` is an ``envs.Env``, or give ``env_name`` (and ``env_kwargs`` as ``((key, value), ...)``)
    so that worker processes can rebuild it from the registry.
    """
    from algos import normalize, ppo  # noqa: PLC0415
    from algos import networks as algo_networks  # noqa: PLC0415

    if env is None:
        if env_name is None:
            raise ValueError("ppo_program: give env or env_name")
        import envs  # noqa: PLC0415

        env = envs.make(env_name, **dict(env_kwargs))
    config.validate(env)
    nets = ppo.make_networks(config, env)
    T, N, A = config.unroll_length, config.num_envs, env.action_size
    sim_fn = rose_jax.component("sim")(jax.vmap(env.step))

    def normalized(normalizer, obs):
        return normalize.apply(normalizer, obs) if config.normalize_observations else obs

    def start(state):
        rollout_key, _, _ = jax.random.split(state.key, 3)
        return (state.params.policy, state.normalizer), state.env_state, jax.random.split(rollout_key, T)

    def step(consts, env_state, step_key, g, groups):
        policy_params, normalizer = consts
        if groups == 1:
            action, raw, logp = ppo.policy_step(
                nets, config, policy_params, normalizer, env_state.obs, step_key
            )
        else:
            with rose_jax.component("policy"):
                n = env_state.obs.shape[0]
                dist = algo_networks.tanh_gaussian(
                    nets.policy(policy_params, normalized(normalizer, env_state.obs))
                )
                # the full batch's noise, sliced: what networks.sample_raw draws for these envs
                noise = jax.random.normal(step_key, (n * groups, A), dist.loc.dtype)[g * n : (g + 1) * n]
                raw = dist.loc + dist.scale * noise
                action, logp = jnp.tanh(raw), algo_networks.log_prob(dist, raw)
        next_state = sim_fn(env_state, action)
        return next_state, ppo.Transition(
            env_state.obs, raw, logp, next_state.reward, next_state.done, next_state.truncated
        )

    def finish(state, env_state, transitions):
        return state.replace(env_state=env_state), (transitions, env_state)

    def collect(state):
        rollout_key, _, _ = jax.random.split(state.key, 3)
        env_state, transitions = ppo.rollout(
            nets, config, env, state.params.policy, state.normalizer, state.env_state, rollout_key
        )
        return finish(state, env_state, transitions)

    def learn(state, data):
        # ppo.iteration after its rollout: ppo.learn itself. The env state stays the one collect put
        # into ``state`` (in processes mode a resident-env marker), not the one carried in ``data``.
        transitions, env_state = data
        new_state, metrics = ppo.learn(nets, config, state, env_state, transitions)
        return new_state.replace(env_state=state.env_state), metrics

    spec = None
    if env_name is not None:
        spec = ProgramSpec(
            "rose_jax.optimize.program:ppo_program",
            (("config", config), ("env_name", env_name), ("env_kwargs", tuple(env_kwargs))),
        )
    return Program(
        name="ppo",
        num_envs=N,
        collect=collect,
        learn=learn,
        env=attr_lens("env_state"),
        data_env_axis=(1, 0),  # transitions (T, N, ...), final env state (N, ...)
        rollout=RolloutParts(T, start, step, finish),
        spec=spec,
        env_name=env.name,
    )


# ------------------------------------------------------------------------------ SAC adapter


def sac_program(
    config: Any, env: Any = None, *, env_name: str | None = None, env_kwargs: tuple = ()
) -> Program:
    """``algos.sac``'s iteration (``steps_per_iteration == 1``) as a :class:`Program`.

    Built from ``sac._collect`` and ``sac._train_steps`` (the iteration's two halves, private in
    ``algos.sac``), so it equals ``sac.iteration(config, env)``. SAC's collect folds each step's
    observations into the normalizer and inserts them into the replay buffer (shared state, not
    per env): :func:`group_rollout` is rejected for it, a real collect that reduces over envs.
    """
    from algos import sac  # noqa: PLC0415

    if env is None:
        import envs  # noqa: PLC0415

        env = envs.make(env_name, **dict(env_kwargs))
    if config.steps_per_iteration != 1:
        raise ValueError(f"sac_program: needs steps_per_iteration == 1, got {config.steps_per_iteration}")
    built = sac.make(config, env)

    def collect(state):
        _, collect_key, _ = jax.random.split(state.key, 3)
        state, _ = sac._collect(built, state, collect_key, random_actions=False)
        return state, state.env_state

    def learn(state, env_state):
        key, _, train_key = jax.random.split(state.key, 3)
        state, train_metrics = sac._train_steps(built, state.replace(key=key), train_key)
        metrics = {
            "reward": jnp.mean(env_state.reward),
            **train_metrics,
            "episode_return": jnp.mean(state.env_state.last_episode_return),
            "env_steps": state.env_steps,
            "grad_steps": state.grad_steps,
            "buffer_size": state.replay.size,
        }
        return state, metrics

    spec = None
    if env_name is not None:
        spec = ProgramSpec(
            "rose_jax.optimize.program:sac_program",
            (("config", config), ("env_name", env_name), ("env_kwargs", tuple(env_kwargs))),
        )
    return Program(
        name="sac",
        num_envs=config.num_envs,
        collect=collect,
        learn=learn,
        env=attr_lens("env_state"),
        data_env_axis=0,
        spec=spec,
        env_name=env.name,
    )
