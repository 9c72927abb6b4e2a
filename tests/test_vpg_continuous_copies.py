"""The pieces vpg_continuous.py holds its own copy of behave as ppo_atari.py's do (STYLE.md: self-contained on purpose)."""

import dataclasses

import numpy as np
import pytest
import torch

import ppo_atari
import vpg_continuous as vpg


@pytest.mark.parametrize("seed", range(3))
def test_gae_is_the_same(seed):
    rng = np.random.default_rng(seed)
    shape = (30, 4)
    floats = [torch.tensor(rng.normal(size=shape), dtype=torch.float32) for _ in range(3)]
    ends = [torch.tensor(rng.random(shape) < 0.1) for _ in range(2)]
    for gamma, gae_lambda in [(0.99, 0.95), (0.99, 0.97), (0.9, 1.0)]:
        ours = vpg.compute_gae(*floats, *ends, gamma, gae_lambda)
        theirs = ppo_atari.compute_gae(*floats, *ends, gamma, gae_lambda)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_schedules_statistics_and_formats_are_the_same():
    for update in [0, 1, 50, 99]:
        assert vpg.linear_schedule(1e-3, update, 100) == ppo_atari.linear_schedule(1e-3, update, 100)
    targets, predictions = torch.randn(100), torch.randn(100)
    assert vpg.explained_variance(predictions, targets) == ppo_atari.explained_variance(predictions, targets)
    for text in ["12", "1e6", "1_000_000", "2.0e3"]:
        assert vpg.parse_int(text) == ppo_atari.parse_int(text)
    for seconds in [0.0, 59.9, 3600.0, 86_399.0, float("inf")]:
        assert vpg.format_duration(seconds) == ppo_atari.format_duration(seconds)


def test_the_command_line_is_derived_the_same_way():
    @dataclasses.dataclass
    class Example:
        steps: int = 3
        """How many   steps,
        over two lines."""
        name: str = "x"
        undocumented: float = 1.0

    assert vpg.field_docs(Example) == ppo_atari.field_docs(Example) == {"steps": "How many steps, over two lines."}
    shared = {f.name for f in dataclasses.fields(vpg.Config)} & {f.name for f in dataclasses.fields(ppo_atari.Config)}
    assert {"env", "total_timesteps", "num_envs", "num_steps", "seed", "device", "run_dir", "checkpoint_every",
            "resume", "eval", "eval_episodes", "capture_video"} <= shared
    assert vpg.RUN_OPTIONS - {"eval_deterministic"} == ppo_atari.RUN_OPTIONS - {"precision"}
