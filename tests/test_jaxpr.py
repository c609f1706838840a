"""rose_jax.jaxpr: dataflow over one level's equations (hand-checked on small programs) and the
cut of a function at a component boundary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import rose_jax
from rose_jax.jaxpr import compat, cut, dataflow


def chain(a, b, c):
    """eqn 0: x = sin(a); eqn 1: y = x * b; eqn 2: z = cos(c); outputs (y, z, a)."""
    x = jnp.sin(a)
    y = x * b
    z = jnp.cos(c)
    return y, z, a


def _jaxpr():
    closed = jax.make_jaxpr(chain)(1.0, 2.0, 3.0)
    return closed, compat.open_jaxpr(closed)


def test_forward_and_backward_follow_whole_equations():
    closed, jx = _jaxpr()
    a, b, c = jx.invars
    x, y, z = jx.eqns[0].outvars[0], jx.eqns[1].outvars[0], jx.eqns[2].outvars[0]
    assert dataflow.forward(jx.eqns, [a]) == {a, x, y}
    assert dataflow.forward(jx.eqns, [a], skip=[1]) == {a, x}  # eqn 1 excluded: y not reached
    assert dataflow.forward(jx.eqns, [a], start=1) == {a}  # sin(a) is before the start
    assert dataflow.backward(jx.eqns, [y]) == {y, x, a, b}
    assert dataflow.backward(jx.eqns, [y], stop=1) == {y}  # eqn 1 (which makes y) not scanned
    assert dataflow.needed_eqns(jx.eqns, [y, z]) == [0, 1, 2]
    assert dataflow.needed_eqns(jx.eqns, [y], start=1) == [1]


def test_live_inputs_and_tainted_outputs():
    closed, _ = _jaxpr()
    assert dataflow.live_inputs(closed, [0]) == [True, True, False]  # y needs a and b
    assert dataflow.live_inputs(closed, [1]) == [False, False, True]
    assert dataflow.live_inputs(closed, [2]) == [True, False, False]  # an input passed through
    assert dataflow.tainted_outputs(closed, [False, True, False]) == [True, False, False]
    assert dataflow.tainted_outputs(closed, [True, False, False]) == [True, False, True]


def test_liveness_of_consecutive_pieces():
    _, jx = _jaxpr()
    e = list(jx.eqns)
    a, b, c = jx.invars
    x, y = e[0].outvars[0], e[1].outvars[0]
    # pieces [sin], [mul], [cos]; only y is needed after them
    wiring = dataflow.liveness([e[:1], e[1:2], e[2:]], [y], droppable=[False, False, True])
    assert wiring[0] == ([a], [x]) and wiring[1] == ([x, b], [y])
    assert wiring[2] is None  # cos(c) is needed by nobody: dropped, c not read
    assert dataflow.read_set(e) == [a, b, c] and dataflow.defined_vars(e) == [x, y, e[2].outvars[0]]


def epoch(state):
    w = state["w"] * 0.9
    with rose_jax.component("evaluate"):
        ev = jnp.sum(jnp.sin(w)) + state["k"]
    return {"k": state["k"] + 1.0, "w": w}, {"eval": ev}


def test_split_component_cuts_out_a_metrics_only_component():
    state = {"k": jnp.float32(1.0), "w": jnp.arange(3.0)}
    closed = jax.make_jaxpr(epoch)(state)
    split = cut.split_component(closed, "evaluate", n_state=2)
    assert split.positions == (2,) and split.n_outputs == 3
    kept = compat.as_fun(split.kept)(*jax.tree.leaves(state))
    (ev,) = compat.as_fun(split.part)(*kept[2:])
    assert float(ev) == pytest.approx(float(epoch(state)[1]["eval"]))
    with pytest.raises(ValueError, match="writes the carried state"):
        cut.split_component(closed, "evaluate", n_state=3)
    with pytest.raises(ValueError, match="no top-level equation"):
        cut.split_component(closed, "missing", n_state=2)
