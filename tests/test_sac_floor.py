"""benchmarks.experiments.sac_floor: the copy count of an HLO module's loops, on a hand-written
module (its nesting rules) and on a program XLA compiles here (the pattern MJX's line search has:
a fixed-length scan of ``lax.cond`` steps, vmapped, so the old carry is read beside the new)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks.experiments import sac_floor

# A loop (4 trips) whose body calls a wrapper that runs a data-dependent loop, whose body runs a
# 50-trip loop; copies: 1 in the entry, 2 per outer trip, 3 in the wrapper's loop body, 5 per
# inner trip, and one inside a fusion (part of that fusion's kernel: not counted).
HLO = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p)
}

%inner_body (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%a), index=1
  %c1 = f32[8]{0} copy(%x)
  %c2 = f32[8]{0} copy(%x)
  %c3 = f32[8]{0} copy(%x)
  %c4 = f32[8]{0} copy(%x)
  %c5 = f32[8]{0} copy(%x)
  %f = f32[8]{0} fusion(%c1), kind=kLoop, calls=%fused
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %f)
}

%data_body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %y = f32[8]{0} get-tuple-element(%b), index=1
  %d1 = f32[8]{0} copy(%y)
  %d2 = f32[8]{0} copy(%y)
  %d3 = f32[8]{0} copy(%y)
  %w = (s32[], f32[8]{0}) while(%b), condition=%cond, body=%inner_body, TRIPS50
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %d1)
}

%wrapper (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  ROOT %w2 = (s32[], f32[8]{0}) while(%q), condition=%cond, body=%data_body
}

%outer_body (o: (s32[], f32[8])) -> (s32[], f32[8]) {
  %o = (s32[], f32[8]{0}) parameter(0)
  %z = f32[8]{0} get-tuple-element(%o), index=1
  %e1 = f32[8]{0} copy(%z)
  %e2 = f32[8]{0} copy(%z)
  ROOT %cl = (s32[], f32[8]{0}) call(%o), to_apply=%wrapper
}

ENTRY %main (arg: f32[8]) -> f32[8] {
  %arg = f32[8]{0} parameter(0)
  %g = f32[8]{0} copy(%arg)
  %w3 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%outer_body, TRIPS4
  ROOT %out = f32[8]{0} get-tuple-element(%w3), index=1
}
"""
HLO = HLO.replace("TRIPS50", 'backend_config={"known_trip_count":{"n":"50"}}').replace(
    "TRIPS4", 'backend_config={"known_trip_count":{"n":"4"}}')


def test_copies_are_counted_per_loop_body_and_multiplied_through_the_nesting():
    c = sac_floor.loop_copies(HLO)
    by = {lp["body"]: lp for lp in c["loops"]}
    assert c["entry"] == 1
    assert by["outer_body"] == {"body": "outer_body", "copies": 2, "trips": 4, "parent": None}
    assert by["data_body"]["trips"] is None and by["data_body"]["copies"] == 3
    assert by["data_body"]["parent"] == "outer_body"  # through the call to the wrapper
    assert by["inner_body"] == {"body": "inner_body", "copies": 5, "trips": 50, "parent": "data_body"}
    # 1 + 4 x 2 + 4 x k x 3 + 4 x k x 50 x 5, for k trips of the data-dependent loop
    assert [sac_floor.copies_per_call(c, k) for k in (1, 2)] == [1 + 8 + 12 + 1000, 1 + 8 + 24 + 2000]


def test_the_line_search_body_is_counted_by_opcode_without_the_plumbing():
    assert sac_floor.body_instructions(HLO, 50) == {"copy": 5, "fusion": 1}
    assert sac_floor.body_instructions(HLO, 7) == {}  # no loop of 7 known trips
    assert sac_floor.ls_trips(HLO) == 50


def test_a_module_without_an_entry_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no ENTRY"):
        sac_floor.loop_copies("%f (p: f32[]) -> f32[] {\n}\n")


def test_a_vmapped_scan_of_cond_steps_keeps_carry_copies_in_its_body():
    """MJX's line search as a small program: XLA copies carried values the body reads beside the
    new ones it writes; the count is per trip, times the scan's 7 trips."""

    def search(x):
        def step(v):
            a, b, c, i = v
            return (a + b * c, b - a * 0.5, c * 0.9 + a, i + 1)

        def go(v):
            return v[0] < 10.0

        def body(carry, _):
            v, g = carry
            return jax.lax.cond(g, lambda v: (step(v), go(step(v))), lambda v: (v, False), v), None

        return jax.lax.scan(body, ((x, 2 * x, 3 * x, 0), go((x, x, x, 0))), None, length=7)[0][0]

    hlo = jax.jit(jax.vmap(search)).lower(jnp.ones(16)).compile().as_text()
    c = sac_floor.loop_copies(hlo)
    (lp,) = [lp for lp in c["loops"] if lp["trips"] == 7]
    assert lp["copies"] >= 1 and lp["parent"] is None
    assert sac_floor.copies_per_call(c, 1) == c["entry"] + 7 * lp["copies"] + sum(
        x["copies"] * (x["trips"] or 1) for x in c["loops"] if x is not lp)


def test_measured_reads_the_newest_profiled_row_and_the_targets_iteration_time(tmp_path):
    rows = [
        {"workload": "sac-x", "date": "2026-12-07 10:24", "profile": {"available": False}},
        {"workload": "sac-x", "date": "2026-12-07 10:32", "peer_flags_env_steps_per_s": 8000.0,
         "peer_default_env_steps_per_s": 5000.0, "rose_env_steps_per_s": 9600.0,
         "speedup_vs_informed_peer": 1.2,
         "device": "GPU", "profile": {"available": True, "env_steps_per_s": 6400.0, "ms_per_iteration": 20.0,
                                      "kernels_per_iteration": 100, "median_kernel_us": 1.5,
                                      "by_component": {"collect": {"kernels": 60, "kernel_ms": 3.0,
                                                                   "top_ms": {"memcpy32_post": 1.0}}}}},
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"acceptance": rows}))
    m = sac_floor.measured("sac-x", str(path))
    assert m["date"] == "2026-12-07 10:32" and m["env_steps_per_iteration"] == 128
    assert m["peer_ms_per_iteration"] == pytest.approx(16.0)  # 128 steps at the faster peer's 8,000/s
    assert m["target_ms_per_iteration"] == pytest.approx(16.0 / 1.5)
    assert m["components"]["collect"]["memcpy32_post_ms"] == 1.0
    assert sac_floor.measured("other", str(path)) is None


@pytest.mark.slow
def test_the_smoke_run_writes_its_files_with_the_stacked_step_equal(tmp_path):
    """End to end on a tiny MJX hopper iteration (about a minute on 2 cores): the loops with their
    chains, the physics step's copies as written and stacked, the stacked line search bitwise
    equal to the step as written, and the markdown and plot beside the JSON."""
    pytest.importorskip("brax")
    assert sac_floor.main(["--smoke", "--out", str(tmp_path)]) == 0
    (w,) = json.loads((tmp_path / "results.json").read_text())["workloads"]
    assert any(c["loop"].endswith("_fun") and c["trips"] == 50 for c in w["loops"])
    before = w["physics_copies_per_env_step"]["1"]
    after = w["stack_carries"]["physics_copies_per_env_step"]["1"]
    assert after < before and w["stack_carries"]["bitwise_equal"]
    assert w["line_search_body"]["stack_carries"]["copy"] < w["line_search_body"]["as_written"]["copy"]
    assert (tmp_path / "results.md").exists() and (tmp_path / "results.png").exists()
