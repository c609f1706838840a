"""The registry's shared host helpers: train keywords, argparse counts, --env-arg parsing."""

import argparse

import pytest

from algos import registry
from algos.ppo import PPOConfig


def test_train_with_keywords_splits_loop_keywords_from_hyperparameters():
    seen = {}

    def train_with_config(config, env, **loop):
        seen.update(config=config, env=env, loop=loop)
        return "ran"

    out = registry.train_with_keywords(
        PPOConfig, train_with_config, "pendulum", None,
        {"num_envs": 8, "resume": True, "progress_fn": print}, "t",
    )
    assert out == "ran" and seen["env"] == "pendulum"
    assert seen["config"] == PPOConfig(num_envs=8)
    assert seen["loop"] == {"resume": True, "progress_fn": print}
    with pytest.raises(TypeError, match="t: unknown hyperparameter 'progres_fn'"):
        registry.train_with_keywords(PPOConfig, train_with_config, "x", None, {"progres_fn": print}, "t")


def test_count_arg_and_env_args():
    assert registry.count_arg("1e5") == registry.count_arg("100_000") == 100_000
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer, got '1.5'"):
        registry.count_arg("1.5")
    assert registry.literal_or_text("(1, 2)") == (1, 2) and registry.literal_or_text("mjx") == "mjx"
    assert registry.parse_env_args("mjx", ["episode_length=100", "name =x"]) == {
        "backend": "mjx", "episode_length": 100, "name": "x"
    }
    assert registry.parse_env_args(None, ["episode_length=100"]) == {"episode_length": 100}
    with pytest.raises(ValueError, match="--env-arg expects KEY=VALUE, got 'oops'"):
        registry.parse_env_args(None, ["oops"])
