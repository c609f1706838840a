"""The slack-aware SM-quota search on two branches, then a concurrent validation of its choice.

Branch A is matmul-heavy, branch B memory-bound (a reduction + axpy over 1 GiB). MPS reads the SM
quota when a process creates its CUDA context, so every quota needs its own worker process; the
workers of one round start together (one parallel start per round) and each runs every branch
asked at its quota. Round 1: quotas 20/35/50/65/80, both branches on each worker, plus a second
worker at 50 for the even-split validation. Each point is timed ALONE: the driver sends one
timing call at a time and every other worker is idle (an idle MPS client holds memory, no SMs).
:func:`rose_jax.mps.search_quotas` picks the quotas; round 2 refines by +-5 around them (new
workers only for quotas not yet running; skipped if the budget would not leave room for the
validation). Validation, always run: A and B concurrently, each in its own worker, at 50/50 and at
the chosen quotas (interleaved repeats after one warm-up pair, median join time). Every pool of
the search stays open until the validation is done, so the validation reuses the workers already
at the right quotas (a new one starts only where none is).
Part of ``python -m benchmarks.experiments.mps`` (phase ``search``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from rose_jax.mps import join_time, search_quotas

from benchmarks.experiments.mps.harness import (
    P,
    Budget,
    Sizes,
    Timing,
    log,
    median,
    specs,
    timed_pool,
)

SEARCH_MEM_FRACTION = 0.07  # per search worker: ~10 GB cap on an H200; a branch needs < 3 GB


def _branch_static(sizes: Sizes, b: int) -> dict:
    if b == 0:
        return dict(kind="matmul", size=sizes.a_n, iters=sizes.a_iters, dtype=sizes.dtype)
    return dict(kind="memory", size=sizes.b_size, iters=sizes.b_iters)


@dataclasses.dataclass(eq=False)
class _Live:
    """One running search worker: its pool, name, SM quota and the branches it has built."""

    pool: object
    name: str
    quota: int
    prepared: set = dataclasses.field(default_factory=set)


class _Fleet:
    """The search's running workers across its pools (one pool per round of parallel starts).

    Every pool stays open (in ``stack``) until the search is done, so a later step reuses a
    worker already at the quota it needs instead of starting a process.
    """

    def __init__(self, daemon, sizes: Sizes, tm: Timing, stack: contextlib.ExitStack):
        self.daemon, self.sizes, self.tm, self.stack = daemon, sizes, tm, stack
        self.workers: list[_Live] = []

    def at(self, quota: int, exclude=()) -> _Live | None:
        for w in self.workers:
            if w.quota == quota and w not in exclude:
                return w
        return None

    def start(self, quotas, label: str) -> list[_Live]:
        """Start one worker per entry of quotas (repeats allowed), all at once; returns them."""
        used = {w.name for w in self.workers}
        named = []
        for q in quotas:
            name, k = f"q{q}", 1
            while name in used:
                k += 1
                name = f"q{q}n{k}"
            used.add(name)
            named.append((name, q))
        pool = self.stack.enter_context(
            timed_pool(self.tm, label, specs(self.sizes, named, SEARCH_MEM_FRACTION), self.daemon)
        )
        new = [_Live(pool, n, q) for n, q in named]
        self.workers += new
        return new

    def prepare(self, pairs) -> float:
        """Build + compile + run once each (worker, branch) not yet built, workers in parallel
        (a worker builds its branches one after the other); returns seconds."""
        t0 = time.monotonic()
        by_pool: dict = {}
        todo = []
        for w, b in dict.fromkeys(pairs):
            if b in w.prepared:
                continue
            h = w.pool.submit(w.name, P + "prepare_branch", static=_branch_static(self.sizes, b), jit=False)
            by_pool.setdefault(id(w.pool), (w.pool, []))[1].append(h)
            todo.append((w, b))
        for pool, hs in by_pool.values():
            pool.wait(hs, timeout=600)
        for w, b in todo:
            w.prepared.add(b)
        return time.monotonic() - t0

    def time_alone(self, w: _Live, b: int) -> float:
        """Median seconds of branch b on worker w; nothing else runs on the GPU meanwhile."""
        st = dict(_branch_static(self.sizes, b), reps=self.sizes.branch_reps)
        return float(w.pool.call(w.name, P + "time_branch", static=st, jit=False, timeout=300))

    def concurrent(self, wa: _Live, wb: _Live) -> dict:
        """Branch A on wa and branch B on wb started together; the join waits for both."""
        stA = dict(_branch_static(self.sizes, 0), reps=1, warmup=False)
        stB = dict(_branch_static(self.sizes, 1), reps=1, warmup=False)
        t0 = time.perf_counter()
        ha = wa.pool.submit(wa.name, P + "time_branch", static=stA, jit=False)
        hb = wb.pool.submit(wb.name, P + "time_branch", static=stB, jit=False)
        if wa.pool is wb.pool:
            ta, tb = wa.pool.wait([ha, hb], timeout=300)
        else:
            (ta,) = wa.pool.wait([ha], timeout=300)
            (tb,) = wb.pool.wait([hb], timeout=300)
        return {"join_s": time.perf_counter() - t0, "a_s": float(ta), "b_s": float(tb)}


def phase_search(daemon, sizes: Sizes, tm: Timing, budget: Budget) -> dict:
    """Round 1 (+ refinement if the budget allows), the chosen quotas and the concurrent validation."""
    log(
        f"search: branch A = {sizes.a_iters} x {sizes.dtype} [{sizes.a_n}]^2 matmuls, "
        f"branch B = {sizes.b_iters} x (mean + axpy) over float32 [{sizes.b_size}] "
        f"({sizes.b_size * 4 / 2**30:.2f} GiB)"
    )
    rounds: list[dict] = []
    cache: dict[tuple[int, int], float] = {}
    even_q = 100 // 2 // sizes.step * sizes.step
    with contextlib.ExitStack() as stack:
        fleet = _Fleet(daemon, sizes, tm, stack)

        def measure(points):
            todo = [p for p in dict.fromkeys(points) if p not in cache]
            if todo:
                n = len(rounds) + 1
                t0 = time.monotonic()
                need = sorted({q for _, q in todo if fleet.at(q) is None})
                if n == 1:  # a second worker at the even quota, for the concurrent 50/50 run
                    need = sorted(need + [even_q])
                log(
                    f"search: round {n}: {len(todo)} points at quotas {sorted({q for _, q in todo})}; "
                    f"starting {len(need)} worker(s) at {need}"
                )
                new = fleet.start(need, f"search round {n}") if need else []
                t_start = time.monotonic() - t0
                assigned = [(fleet.at(q), b) for b, q in todo]
                extra = []
                if n == 1:
                    second = fleet.at(even_q, exclude={fleet.at(even_q)})
                    extra = [(second, 1)] if second is not None else []
                t_prep = fleet.prepare(assigned + extra)
                t1 = time.monotonic()
                for (b, q), (w, _) in zip(todo, assigned, strict=True):  # one at a time
                    cache[(b, q)] = fleet.time_alone(w, b)
                    log(f"search:   branch {'AB'[b]} at {q:3d}%: {cache[(b, q)] * 1e3:8.2f} ms")
                t_timed = time.monotonic() - t1
                rounds.append(
                    {
                        "round": n,
                        "points": len(todo),
                        "new_workers": len(new),
                        "start_s": t_start,
                        "prepare_s": t_prep,
                        "timed_s": t_timed,
                        "seconds": time.monotonic() - t0,
                    }
                )
                log(
                    f"search: round {n} took {rounds[-1]['seconds']:.1f} s: start {t_start:.1f} s, "
                    f"prepare {t_prep:.1f} s, timed {t_timed:.1f} s"
                )
            return [cache[p] for p in points]

        kw = dict(coarse=sizes.coarse, refine_step=sizes.refine_step, step=sizes.step)
        result = search_quotas(measure, 2, refine_rounds=0, **kw)
        log(
            f"search: coarse choice {result.quotas[0]}/{result.quotas[1]} (predicted join "
            f"{result.predicted_join_s * 1e3:.2f} ms) vs even "
            f"(predicted {result.predicted_even_join_s * 1e3:.2f} ms)"
        )
        r1 = rounds[0]
        est_val = 2.0 + (sizes.join_reps + 1) * 2 * 1.5 * result.predicted_even_join_s + tm.close_estimate()
        est_ref = tm.start_estimate() + r1["prepare_s"] + r1["timed_s"] * 4 / r1["points"] + 1.0
        left = budget.left()
        if tm.decide("search refinement", est_ref + est_val <= left, est_ref + est_val, left):
            result = search_quotas(measure, 2, refine_rounds=1, **kw)
        qa, qb = result.quotas
        log(
            f"search: chosen {qa}/{qb} (predicted join {result.predicted_join_s * 1e3:.2f} ms) vs even "
            f"{even_q}/{even_q} (predicted {result.predicted_even_join_s * 1e3:.2f} ms)"
        )

        # ---- validation: workers at the chosen quotas (reuse where running)
        models = result.models()
        ea = fleet.at(even_q)
        eb = fleet.at(even_q, exclude={ea})
        wa = fleet.at(qa)
        wb = fleet.at(qb, exclude={wa})
        note = ""
        vq = (qa, qb)
        if wa is None or wb is None:
            alt = _best_running_pair(fleet, models)
            if alt is not None and (
                alt[0] <= result.predicted_join_s * 1.02 or tm.start_estimate() + est_val > budget.left()
            ):
                _, wa, wb = alt
                vq = (wa.quota, wb.quota)
                note = (
                    f"no worker at {qa}/{qb}; validated the best running pair {vq[0]}/{vq[1]} "
                    f"(predicted {alt[0] * 1e3:.2f} ms)"
                )
            else:
                missing = ([qa] if wa is None else []) + ([qb] if wb is None else [])
                fleet.start(missing, "search validation")
                wa = wa or fleet.at(qa, exclude={wb})
                wb = wb or fleet.at(qb, exclude={wa})
                note = f"started worker(s) at {missing} for the validation"
            log(f"search: {note}")
        if eb is None:  # only if round 1 could not start its second even worker
            fleet.start([even_q], "search validation (even)")
            eb = fleet.at(even_q, exclude={ea})
        t_prep = fleet.prepare([(ea, 0), (eb, 1), (wa, 0), (wb, 1)])
        log(
            f"search: validating concurrently: A on {ea.name} + B on {eb.name} (even) vs "
            f"A on {wa.name} + B on {wb.name} (chosen), 1 warm-up + {sizes.join_reps} interleaved "
            f"repeats (prepare {t_prep:.1f} s)"
        )
        t_val = time.monotonic()
        joins = {"even": [], "chosen": []}
        order = [("even", ea, eb), ("chosen", wa, wb)]
        for rep in range(sizes.join_reps + 1):
            for key, x, y in order if rep % 2 == 0 else order[::-1]:
                j = fleet.concurrent(x, y)
                if rep > 0:  # rep 0 warms both pairs up together
                    joins[key].append(j)
        t_val = time.monotonic() - t_val
        workers = [{"name": w.name, "quota": w.quota, "branches": sorted(w.prepared)} for w in fleet.workers]
    even = median([j["join_s"] for j in joins["even"]])
    chosen = median([j["join_s"] for j in joins["chosen"]])
    gain = 1 - chosen / even
    log(
        f"search: measured join {chosen * 1e3:.2f} ms at {vq[0]}/{vq[1]} vs {even * 1e3:.2f} ms at "
        f"{even_q}/{even_q}: {gain * 100:.1f}% shorter (target >= 15%); validation took {t_val:.1f} s"
    )
    return {
        "result": result.to_dict(),
        "predicted_gain": result.predicted_gain,
        "validated_quotas": list(vq),
        "validated_predicted_join_s": join_time(models, vq),
        "validation_note": note,
        "rounds": rounds,
        "workers": workers,
        "isolation": (
            "each point timed alone: one timing call at a time, every other worker idle; "
            "workers built their branches concurrently before timing"
        ),
        "measured_join_s": {"even": even, "chosen": chosen},
        "measured_gain": gain,
        "joins": joins,
        "validation_s": t_val,
    }


def _best_running_pair(fleet: _Fleet, models):
    """(modelled join, worker for A, worker for B) over running workers with quotas summing
    to <= 100, or None."""
    best = None
    for x in fleet.workers:
        for y in fleet.workers:
            if x is y or x.quota + y.quota > 100:
                continue
            t = join_time(models, (x.quota, y.quota))
            if best is None or t < best[0]:
                best = (t, x, y)
    return best



def markdown(s: dict) -> list[str]:
    """The phase's section of the results Markdown."""
    r = s["result"]
    vq = tuple(s["validated_quotas"])
    out = [
        "## Slack-aware quota search (A matmul-heavy, B memory-bound)",
        "",
        "| split | predicted join | measured join (concurrent) |",
        "|---|---|---|",
        f"| even {tuple(r['even_quotas'])} | {r['predicted_even_join_s'] * 1e3:.2f} ms | "
        f"{s['measured_join_s']['even'] * 1e3:.2f} ms |",
        f"| chosen {vq} | {s['validated_predicted_join_s'] * 1e3:.2f} ms | "
        f"{s['measured_join_s']['chosen'] * 1e3:.2f} ms |",
        "",
        f"measured gain {s['measured_gain'] * 100:.1f}% (target >= 15%); predicted "
        f"{s['predicted_gain'] * 100:.1f}%. {s['validation_note']}",
        "",
        f"Isolation: {s['isolation']}.",
        "",
        "| round | points | new workers | start | prepare | timed | total |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {x['round']} | {x['points']} | {x['new_workers']} | {x['start_s']:.1f} s | "
        f"{x['prepare_s']:.1f} s | {x['timed_s']:.1f} s | {x['seconds']:.1f} s |"
        for x in s["rounds"]
    ]
    out += ["", "tried points (ms, each branch alone):", "", "| round | branch | quota | time |"]
    out += ["|---|---|---|---|"]
    out += [
        f"| {p['round']} | {'AB'[p['branch']]} | {p['quota']} | {p['seconds'] * 1e3:.2f} |"
        for p in r["points"]
    ]
    return out + [""]


def summary(s: dict) -> list[tuple[str, str]]:
    """(what, value) lines of the printed summary."""
    return [(
        f"join at {tuple(s['validated_quotas'])} vs {tuple(s['result']['even_quotas'])}",
        f"{s['measured_join_s']['chosen'] * 1e3:.2f} vs {s['measured_join_s']['even'] * 1e3:.2f} ms "
        f"({s['measured_gain'] * 100:.1f}% shorter)",
    )]
