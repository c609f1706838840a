"""The algorithm registry: one :class:`Algo` record per algorithm, looked up by name.

    algo = algos.get("ppo")
    config = algo.make_config(num_envs=64, unroll_length=32)     # a validated PPOConfig
    state = algo.init(config, env, jax.random.PRNGKey(config.seed))
    step = jax.jit(algo.iteration(config, env))
    algo.train(env, config, progress_fn=print)                    # or algo.train(env, num_envs=64)

Everything that differs between algorithms lives in its record (or in its module), so host code
(the CLI, benchmarks) never branches on the algorithm's name. Typed parsing of ``key=value``
strings (the CLI's ``--set``) follows the config dataclass's field types.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import typing
from types import ModuleType
from typing import Any, Callable, Sequence


# The fewest evaluation steps of a search unit (where an episode has more): the largest unroll factor
# the candidates try (unroll_scans: 2, 4, 8) and at least the 2 trips a hoist needs, so the unit's
# evaluation scan is searched for the same candidates as the whole unit's.
SEARCH_UNIT_MIN_EVAL_STEPS = 8
# The fewest iterations of a search unit: a 1-trip scan is not the unit's loop (candidate generation
# skips loops of fewer than 2 trips, an unroll is a no-op on it, XLA may fold it away), so a plan
# found on it would never have been tried on the whole unit's loop.
SEARCH_UNIT_MIN_ITERATIONS = 2


def scaled_eval_steps(episode: int, iterations: int, of: int) -> int:
    """The evaluation's steps in a search unit of ``iterations`` of the unit's ``of`` iterations:
    ``ceil(episode * iterations / of)``, at least :data:`SEARCH_UNIT_MIN_EVAL_STEPS`, at most the
    episode, so the evaluation keeps about the share of the unit it has in the whole one."""
    return min(episode, max(SEARCH_UNIT_MIN_EVAL_STEPS, -(-episode * iterations // of)))


class SearchUnit(typing.NamedTuple):
    """A shorter unit the plan search measures in place of a long one (``Algo.search_unit``): ``fn``
    is the unit's program with ``iterations`` of its ``of`` iterations (the same loops and
    components, a shorter scan), and its evaluation, where it has one, ``eval_steps`` of its
    ``eval_of`` steps (scaled alike, so each part keeps its share of the unit), so a plan found on
    it applies to the whole unit."""

    fn: Callable[[Any], tuple[Any, Any]]
    iterations: int
    of: int
    eval_steps: int | None = None
    eval_of: int | None = None

    def describe(self) -> str:
        """``'128 of the unit's 2692 iterations'`` (and ``' and 48 of its evaluation's 1000
        steps'``)."""
        said = f"{self.iterations} of the unit's {self.of} iterations"
        if self.eval_steps is not None and self.eval_of is not None and self.eval_steps < self.eval_of:
            said += f" and {self.eval_steps} of its evaluation's {self.eval_of} steps"
        return said


@dataclasses.dataclass(frozen=True)
class Algo:
    """One algorithm: its config class and its pure functions, resolved from its module.

    Attributes:
      name: the registry name (``"ppo"``, ``"sac"``).
      module: the algorithm's module (``algos.ppo``).
      Config: the frozen config dataclass (``PPOConfig``).
      init / iteration / epoch / evaluate: the module's functions of the same names.
      train: ``train(env, config=None, **overrides)`` (Brax-style keywords work too).
      train_with_config: ``train_with_config(config, env, ...)``.
      unit: what one progress report (and one ``checkpoint_every`` count) of ``train`` is:
        ``"iteration"`` (PPO) or ``"epoch"`` (SAC: a scan of iterations, then an evaluation).
    """

    name: str
    module: ModuleType
    Config: type
    init: Callable[..., Any]
    iteration: Callable[..., Any]
    epoch: Callable[..., Any]
    evaluate: Callable[..., Any]
    train: Callable[..., Any]
    train_with_config: Callable[..., Any]
    unit: str

    def program(self, config: Any, env: Any, **kwargs: Any) -> Any:
        """The algorithm's :class:`rose_jax.program.Program` of one iteration (for the optimizer):
        its module's own ``program(config, env)`` adapter. A module without one is a one-line
        ValueError (the optimizer has no adapters of its own)."""
        own = getattr(self.module, "program", None)
        if own is None:
            raise ValueError(
                f"algorithm {self.name!r} ({self.module.__name__}) has no program(config, env): the "
                "optimizer needs its Program adapter (see docs/ARCHITECTURE.md, how to add an algorithm)"
            )
        return own(config, env, **kwargs)

    def unit_program(self, config: Any, env: Any, **kwargs: Any) -> Any:
        """What ``train`` runs once per progress report, for the optimizer: PPO's iteration
        program (with ``num_evals`` set: its epoch of iterations then the evaluation, Brax's run
        shape), SAC's epoch (iterations, then the evaluation that reports ``eval_episode_return``)."""
        if self.unit == "epoch":
            return self.epoch(config, env)
        eval_epoch = getattr(self.module, "eval_epoch", None)
        if eval_epoch is not None and getattr(config, "num_evals", None) is not None:
            return eval_epoch(config, env)  # resolves the env itself
        # resolved once here, so the optimizer searches the iteration train compiles
        return self.program(config, self.train_env(config, env), **kwargs)

    def unit_fn(self, config: Any, env: Any) -> Callable[[Any], tuple[Any, Any]]:
        """The pure ``state -> (state, metrics)`` that ``train`` jits and runs once per progress
        report (the function behind :meth:`unit_program`): SAC's epoch, PPO's iteration (with
        ``num_evals`` set its epoch of iterations then the evaluation), on the env train runs on."""
        if self.unit == "epoch":
            return self.epoch(config, env)
        eval_epoch = getattr(self.module, "eval_epoch", None)
        if eval_epoch is not None and getattr(config, "num_evals", None) is not None:
            return eval_epoch(config, env)
        return self.iteration(config, self.train_env(config, env))

    def search_unit(self, config: Any, env: Any) -> SearchUnit | None:
        """The shorter unit ``train --optimize`` searches on (the module's ``search_unit(config,
        env)``: SAC's epoch, or PPO's epoch of iterations in Brax's run shape, with fewer
        iterations where it is long), or None: the search measures :meth:`unit_program` itself."""
        own = getattr(self.module, "search_unit", None)
        return None if own is None else own(config, env)

    def train_env(self, config: Any, env: Any) -> Any:
        """The env ``train`` runs on: the algorithm's ``resolve_env(config, env)`` where it has one
        (PPO: a registry name or Brax env built, ``episode_length`` and ``action_repeat`` wrapped,
        as Brax's trainer does), else ``env``. Call it once: PPO's wraps ``action_repeat`` again
        at every call."""
        resolve = getattr(self.module, "resolve_env", None)
        return env if resolve is None else resolve(config, env)

    # ------------------------------------------------------------------ progress
    def evaluates(self, config: Any) -> bool:
        """An iteration algorithm run in Brax's shape (``num_evals`` set): its unit is the epoch
        of iterations then the evaluation (``eval_epoch``), not the iteration."""
        return self.unit == "iteration" and getattr(config, "num_evals", None) is not None

    def num_units(self, config: Any) -> int:
        """Units (what ``unit_fn`` runs once per progress report) of a whole ``train`` run of
        ``config``: SAC's epochs, PPO's iterations, or with ``num_evals`` its epochs (Brax's
        ``max(num_evals - 1, 1)``; the step-0 evaluation is not a unit)."""
        if self.unit == "epoch":
            return config.num_epochs
        if self.evaluates(config):
            return max(config.num_evals - 1, 1)
        return config.num_iterations

    def units_done(self, config: Any, state: Any) -> int:
        """Units a train state has done (from its iteration counter)."""
        done = int(state.iteration)
        if self.unit == "epoch":
            return done // self.module.iterations_per_epoch(config)
        if self.evaluates(config):
            return done // config.iterations_per_eval
        return done

    # ------------------------------------------------------------------ config
    def keys(self) -> list[str]:
        """The config's field names, in declaration order (the valid ``--set`` keys)."""
        return [f.name for f in dataclasses.fields(self.Config)]

    def defaults(self) -> dict[str, Any]:
        """``{field: default}`` of the config."""
        return {f.name: f.default for f in dataclasses.fields(self.Config)}

    def make_config(self, config: Any = None, **overrides: Any) -> Any:
        """``Config(**overrides)`` (or ``config`` with ``overrides`` replaced), validated.

        Unknown keys raise a one-line TypeError listing the valid ones; bad values the config's
        one-line ValueError.
        """
        return config_with(self.Config, config, overrides, self.name)

    def parse_overrides(self, items: Sequence[str]) -> dict[str, Any]:
        """``["key=value", ...]`` -> ``{key: typed value}`` by the config's field types.

        Unknown keys and values that do not parse raise a one-line ValueError naming the valid
        keys or the expected type. See :func:`parse_value` for the accepted spellings.
        """
        hints = typing.get_type_hints(self.Config)
        out: dict[str, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ValueError(
                    f"--set expects key=value, got {item!r}; valid keys: {', '.join(self.keys())}"
                )
            if key not in hints:
                hint = _did_you_mean(key, self.keys())
                raise ValueError(
                    f"{self.name}: unknown key {key!r}{hint}; valid keys: {', '.join(self.keys())}"
                )
            try:
                out[key] = parse_value(hints[key], raw)
            except ValueError as e:
                raise ValueError(f"--set {key}={raw}: {e}") from None
        return out


def config_with(cls: type, config: Any, overrides: dict[str, Any], where: str) -> Any:
    """A validated ``cls`` instance: ``cls(**overrides)``, or ``config`` with ``overrides`` replaced.

    Unknown keys raise a one-line TypeError (like an unexpected keyword argument) that names the
    valid keys; invalid values raise the config's own one-line ValueError.
    """
    if config is not None and not isinstance(config, cls):
        raise TypeError(f"{where}: config must be a {cls.__name__}, got {type(config).__name__}")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        hint = _did_you_mean(unknown[0], fields) if len(unknown) == 1 else ""
        raise TypeError(
            f"{where}: unknown hyperparameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) for u in unknown)}{hint}; valid: {', '.join(fields)}"
        )
    if config is None:
        return cls(**overrides)
    return dataclasses.replace(config, **overrides) if overrides else config


TRAIN_LOOP_KEYWORDS = ("progress_fn", "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume")


def train_with_keywords(
    cls: type,
    train_with_config: Callable[..., Any],
    env: Any,
    config: Any,
    keywords: dict[str, Any],
    where: str,
) -> Any:
    """What every algorithm's ``train(env, config=None, **keywords)`` does.

    ``keywords`` named in :data:`TRAIN_LOOP_KEYWORDS` go to ``train_with_config`` (the host
    loop's: progress, checkpoints, resume); the rest are hyperparameters of ``cls`` applied by
    :func:`config_with` (an unknown one is its one-line TypeError). Returns what
    ``train_with_config(config, env, **loop)`` returns.
    """
    loop = {k: v for k, v in keywords.items() if k in TRAIN_LOOP_KEYWORDS}
    overrides = {k: v for k, v in keywords.items() if k not in TRAIN_LOOP_KEYWORDS}
    return train_with_config(config_with(cls, config, overrides, where), env, **loop)


def train_signature(train_with_config: Callable[..., Any]) -> inspect.Signature:
    """The signature of the ``train`` that calls :func:`train_with_keywords` with ``train_with_config``:
    ``(env, config=None, *, <the loop keywords, defaults as train_with_config's>, **overrides)``."""
    params = inspect.signature(train_with_config).parameters
    return inspect.Signature([
        params["env"].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD),
        params["config"].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        *(params[k] for k in TRAIN_LOOP_KEYWORDS),
        inspect.Parameter("overrides", inspect.Parameter.VAR_KEYWORD),
    ])


def _did_you_mean(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_NONE = ("none", "null")


def parse_value(kind: Any, raw: str) -> Any:
    """Parse ``raw`` as a value of the type annotation ``kind``.

    ``bool``: ``true`` or ``false`` only (any case); ``int``: ``100000``, ``100_000``, ``1e5`` (a
    whole number); ``float``: any float literal; ``X | None``: ``none`` or an ``X``; sequences of
    ints: ``64,64``, ``(64, 64)`` or ``[64, 64]``; ``str``: the text (quotes optional).
    Raises a one-line ValueError saying what was expected.
    """
    text = raw.strip()
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if args and type(None) in args:  # Optional
        inner = [a for a in args if a is not type(None)]
        if text.lower() in _NONE:
            return None
        if len(inner) == 1:
            try:
                return parse_value(inner[0], text)
            except ValueError as e:
                raise ValueError(f"{e} or none") from None
        raise ValueError(f"cannot parse a value of type {kind}")
    if kind is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError(f"expected true or false, got {text!r}")
    if kind is int:
        return parse_int(text)
    if kind is float:
        try:
            value = float(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        return value
    if kind is str:
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        return text
    if origin in (tuple, list, Sequence) or origin is getattr(typing, "Sequence", None) or (
        origin is not None and isinstance(origin, type) and issubclass(origin, Sequence)
    ):
        body = text
        if body[:1] in "([" and body[-1:] in ")]":
            body = body[1:-1]
        parts = [p for p in (s.strip() for s in body.split(",")) if p]
        try:
            return tuple(parse_int(p) for p in parts)
        except ValueError:
            raise ValueError(f"expected comma-separated ints such as 64,64, got {text!r}") from None
    raise ValueError(f"cannot parse a value of type {kind}")


# Device counters and seeds: env steps are counted in int32 on the device (x64 is off), and
# ``jax.random.PRNGKey(seed)`` keeps only a seed's low 32 bits (PRNGKey(2**32) == PRNGKey(0)).
MAX_ENV_STEPS = 2**31 - 1
MAX_SEED = 2**32 - 1


def check_ranges(where: str, seed: int, total_env_steps: int, iteration_steps: int, sizes: str) -> None:
    """One-line ValueErrors for a seed outside ``[0, MAX_SEED]`` and for a run whose env-step
    counter would pass ``MAX_ENV_STEPS`` (``total_env_steps``: what the run's last iteration
    counts; ``iteration_steps``: what one iteration counts, from ``sizes``, e.g.
    ``"num_envs * unroll_length"``)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(
            f"{where}.seed must be in [0, 2**32 - 1] (jax.random.PRNGKey keeps 32 bits of it), got {seed!r}"
        )
    if iteration_steps > MAX_ENV_STEPS:
        raise ValueError(
            f"{where}: one iteration would count {iteration_steps:.3g} env steps ({sizes}), more than "
            f"2**31 - 1 = {MAX_ENV_STEPS:,} (env steps are counted in int32 on the device); lower num_envs"
        )
    if total_env_steps > MAX_ENV_STEPS:
        raise ValueError(
            f"{where}.num_timesteps: the run would count {total_env_steps:.3g} env steps, more than "
            f"2**31 - 1 = {MAX_ENV_STEPS:,} (env steps are counted in int32 on the device)"
        )


def parse_int(text: str) -> int:
    """``'100000'``, ``'100_000'``, ``'1e5'`` -> 100000; anything else a one-line ValueError."""
    t = text.strip().replace("_", "")
    try:
        return int(t)
    except ValueError:
        pass
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"expected an integer, got {text!r}")
    return int(value)


def count_arg(text: str) -> int:
    """An argparse ``type``: :func:`parse_int` (``100000``, ``100_000``, ``1e5``), its error an
    ``argparse.ArgumentTypeError`` (argparse prints it as a usage error)."""
    import argparse

    try:
        return parse_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def literal_or_text(raw: str) -> Any:
    """``raw`` as a Python literal (``3``, ``0.5``, ``True``, ``(1, 2)``, ``'x'``), else the text
    itself (``--env-arg backend=mjx`` gives the string ``'mjx'``)."""
    import ast

    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def parse_env_args(backend: str | None, items: Sequence[str]) -> dict[str, Any]:
    """The env factory's keywords of ``--backend`` and ``--env-arg KEY=VALUE`` items (values by
    :func:`literal_or_text`); a malformed item is a one-line ValueError."""
    out: dict[str, Any] = {"backend": backend} if backend else {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--env-arg expects KEY=VALUE, got {item!r}")
        out[key.strip()] = literal_or_text(raw)
    return out


# name -> (module, config class, unit)
_ALGOS = {
    "ppo": ("algos.ppo", "PPOConfig", "iteration"),
    "sac": ("algos.sac", "SACConfig", "epoch"),
}
_RECORDS: dict[str, Algo] = {}


def names() -> list[str]:
    """The registered algorithm names, sorted."""
    return sorted(_ALGOS)


def get(name: str) -> Algo:
    """The :class:`Algo` registered as ``name``; an unknown name is a one-line ValueError."""
    if name not in _ALGOS:
        raise ValueError(f"unknown algo {name!r}; known algos: {', '.join(names())}")
    if name not in _RECORDS:
        module_name, config_name, unit = _ALGOS[name]
        module = importlib.import_module(module_name)
        _RECORDS[name] = Algo(
            name=name,
            module=module,
            Config=getattr(module, config_name),
            init=module.init,
            iteration=module.iteration,
            epoch=module.epoch,
            evaluate=module.evaluate,
            train=module.train,
            train_with_config=module.train_with_config,
            unit=unit,
        )
    return _RECORDS[name]


def register(name: str, module: str, config: str, unit: str = "iteration") -> None:
    """Register an algorithm living in ``module`` (it must provide ``init``, ``iteration``,
    ``epoch``, ``evaluate``, ``train`` and ``train_with_config``) with config class ``config``."""
    if unit not in ("iteration", "epoch"):
        raise ValueError(f"register({name!r}): unit must be 'iteration' or 'epoch', got {unit!r}")
    _ALGOS[name] = (module, config, unit)
    _RECORDS.pop(name, None)


def make_config(name: str, **overrides: Any) -> Any:
    """``get(name).make_config(**overrides)``; unknown fields give a one-line error."""
    return get(name).make_config(**overrides)


__all__ = [
    "TRAIN_LOOP_KEYWORDS",
    "Algo",
    "config_with",
    "count_arg",
    "get",
    "literal_or_text",
    "make_config",
    "names",
    "parse_env_args",
    "parse_int",
    "parse_value",
    "register",
    "train_with_keywords",
]
