"""The learning-equivalence check of a tolerance-kept plan (issue 32): train the original program
and the transformed one on the same seeds, then apply :func:`rose_jax.optimize.learning.compare_returns`.

    from algos import equivalence
    check = equivalence.learning_check(config, env, hoist_independent(), seeds=range(5))
    print(check.reason)        # "learns alike: p=0.61 >= 0.05 and means ... within 5% ..."

Each side is ONE vmapped program over the seeds (``algos.sweep.train_many``; the transform is
applied to the unit step before it is vmapped), so a 5-seed check costs two compiles and two
batched runs, not ten. A run's final return is its last row's ``eval_episode_return`` (its
evaluation), else its ``episode_return`` (training episodes). The search takes it through
``OptimizeOptions.learning_check`` (a callable ``transform -> LearningCheck``):
:func:`checker` builds one for a config and env.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from rose_jax.optimize.learning import MIN_SEEDS, LearningCheck, compare_returns


def final_return(rows: list[dict]) -> float:
    """A run's final return: the last row holding ``eval_episode_return``, else ``episode_return``."""
    for key in ("eval_episode_return", "episode_return"):
        for row in reversed(rows):
            value = row.get(key)
            if value is not None and math.isfinite(float(value)):
                return float(value)
    raise ValueError("final_return: no finite eval_episode_return or episode_return in the run's rows")


def final_returns(
    config: Any, env: Any, seeds: Sequence[int], transform: Any = None, log=None
) -> list[float]:
    """The final returns of ``config`` on ``env`` for each of ``seeds`` (one vmapped program)."""
    from algos import sweep

    result = sweep.train_many(
        config, env, list(seeds), checkpoints=False, transform=transform, log=log or (lambda _: None)
    )
    return [final_return(rows) for rows in result.metrics]


def learning_check(
    config: Any,
    env: Any,
    transform: Any,
    seeds: Sequence[int] = tuple(range(MIN_SEEDS)),
    log: Callable[[str], None] | None = None,
    **rule: Any,
) -> LearningCheck:
    """Train ``config`` on ``env`` as defined and with ``transform`` applied, on the same
    ``seeds`` (at least :data:`~rose_jax.optimize.learning.MIN_SEEDS`), and compare the final
    returns (``rule``: ``alpha``, ``mean_tolerance`` of :func:`compare_returns`)."""
    seeds = list(seeds)
    if len(seeds) < rule.get("min_seeds", MIN_SEEDS):
        raise ValueError(f"learning_check: need at least {MIN_SEEDS} seeds, got {len(seeds)}")
    ref = final_returns(config, env, seeds, None, log)
    cand = final_returns(config, env, seeds, transform, log)
    check = compare_returns(ref, cand, **rule)
    if log is not None:
        log(f"learning check of {getattr(transform, 'name', transform)}: {check.reason}")
    return check


def checker(
    config: Any,
    env: Any,
    seeds: Sequence[int] = tuple(range(MIN_SEEDS)),
    steps: int | None = None,
    **rule: Any,
):
    """``transform -> LearningCheck`` for ``OptimizeOptions.learning_check``; ``steps``: each seed's
    env steps (the config's ``num_timesteps`` replaced; a config that refuses it raises its
    one-line ``ValueError``)."""
    if steps is not None:
        import dataclasses

        config = dataclasses.replace(config, num_timesteps=int(steps))

    def check(transform: Any) -> LearningCheck:
        return learning_check(config, env, transform, seeds, **rule)

    return check
