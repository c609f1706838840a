"""Env batches of a :class:`rose_jax.program.Program`: split a state into env groups, merge back,
one group's rollout, and the Program traced with its env masks (:func:`trace_program`, what
transforms with ``needs_program_tree`` are judged on).

A group ``g`` of ``G`` holds envs ``g * N/G .. (g+1) * N/G - 1`` of the program's ``num_envs``
(``N``); the other state leaves are shared by all groups. With ``program.rollout`` a group
draws exactly the random numbers the full batch draws for its envs, so the grouped results
equal the full batch's (the basis of :mod:`rose_jax.optimize.group_rollout` and of the
worker processes of :mod:`rose_jax.optimize.processes`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rose_jax import trace as rtrace
from rose_jax.program import Data, Program, RolloutParts, State


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


def take_group(x: Any, axis: int, g: int, n: int) -> Any:
    """Slice ``g`` of size ``n`` of ``x`` along ``axis``."""
    return jax.lax.slice_in_dim(x, g * n, (g + 1) * n, axis=axis)


def split_envs(program: Program, state: State, groups: int) -> list[State]:
    """``groups`` states, each with its slice of the env batch (the other leaves shared)."""
    n = program.num_envs // groups
    env = program.env.get(state)
    return [
        program.env.set(state, jax.tree.map(lambda x, g=g: take_group(x, 0, g, n), env))
        for g in range(groups)
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


def scan_group(parts: RolloutParts, consts, carry, xs, g: int, groups: int):
    """The rollout loop of env group ``g`` of ``groups`` (``parts.step`` with static ``g``)."""
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
    carry, ys = scan_group(parts, consts, carry, xs, g, groups)
    return parts.finish(state_g, carry, ys)


# ------------------------------------------------------------------------ the traced program


class ProgramTree(NamedTuple):
    """What the legality of a transform with ``needs_program_tree`` reads (e.g.
    :func:`rose_jax.optimize.group_rollout.group_rollout`): the program and its collect's LoopTree.

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

    tree = rtrace.trace(program.collect, state, arg_names=["state"])
    env_in = tuple(bool(b) for b in jax.tree.leaves(env_mask(program, state)))
    out_state, data = jax.eval_shape(program.collect, state)
    env_out = tuple(bool(b) for b in jax.tree.leaves(env_mask(program, out_state))) + tuple(
        ax is not None for ax in data_axes(program, data)
    )
    return ProgramTree(program, tree, env_in, env_out)
