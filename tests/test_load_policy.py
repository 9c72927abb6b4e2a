"""`load_policy` in ppo_atari.py and vpg_continuous.py: a checkpoint's policy, ready to act, with the
preprocessing it learned with; and the README's lines that show it, run exactly as written."""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import ppo_atari
import vpg_continuous as vpg
from conftest import ROOT, readme_example


def run_readme_example(module: str, capsys) -> tuple[dict, str]:
    code = readme_example(module)
    namespace = {"__name__": "readme"}
    exec(compile(code, f"README.md ({module})", "exec"), namespace)
    return namespace, capsys.readouterr().out


def train(script: str, *args) -> None:
    """A tiny run from the command line, in a fresh process (whose workers fork from one with no threads)."""
    result = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def atari_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("atari")
    train("ppo_atari.py", "--env", "Breakout", "--total-timesteps", 128, "--num-envs", 2, "--num-steps", 64,
          "--num-workers", 1, "--run-dir", root / "runs" / "breakout")
    return root


@pytest.fixture(scope="module")
def cheetah_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cheetah")
    train("vpg_continuous.py", "--env", "HalfCheetah-v5", "--total-timesteps", 512, "--num-workers", 1,
          "--run-dir", root / "runs" / "halfcheetah")
    return root


def test_the_readmes_atari_lines_play_a_whole_game(atari_run, monkeypatch, capsys):
    monkeypatch.chdir(atari_run)
    namespace, out = run_readme_example("ppo_atari", capsys)
    step, game = namespace["step"], namespace["game"]
    assert step.game_over and game.ale.game_over(with_truncation=True)
    assert re.fullmatch(rf"score {step.score:g} in {step.length} frames\n", out)


def test_the_readmes_vpg_lines_play_a_whole_episode(cheetah_run, monkeypatch, capsys):
    monkeypatch.chdir(cheetah_run)
    namespace, out = run_readme_example("vpg_continuous", capsys)
    assert namespace["truncated"] and not namespace["terminated"]  # HalfCheetah only ends at its time limit
    assert out == f"return {namespace['total']:.1f}\n"


def test_an_atari_policy_acts_as_its_checkpoints_network_on_frames_its_game_makes(atari_run):
    path = atari_run / "runs" / "breakout" / "checkpoint.pt"
    policy = ppo_atari.load_policy(path)
    checkpoint = torch.load(path, weights_only=True)
    model = ppo_atari.make_model((4, 84, 84), 4)
    model.load_state_dict(checkpoint["model"])
    game = policy.make_env(seed=5)
    assert game.frame_skip == checkpoint["config"]["frame_skip"] and game.life_loss
    frames = []
    game.reset()
    for _ in range(20):
        frames.append(game.obs.copy())
        game.step(policy.act(game.obs))
    batch = np.stack(frames)
    assert batch.shape == (20, 4, 84, 84) and batch.dtype == np.uint8
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(batch))
    assert np.array_equal(policy.act(batch, deterministic=True), logits.argmax(-1).numpy())
    one = policy.act(batch[3], deterministic=True)
    assert isinstance(one, int) and one == int(logits[3].argmax())
    # Sampled actions follow the policy's probabilities: the commonest is the likeliest.
    torch.manual_seed(0)
    sampled = np.array([policy.act(batch[3]) for _ in range(400)])
    probabilities = torch.softmax(logits[3], -1).numpy()
    assert np.abs(np.bincount(sampled, minlength=4) / 400 - probabilities).max() < 0.08


def test_a_vpg_policy_normalises_with_its_checkpoints_statistics_and_stays_in_bounds(cheetah_run):
    path = cheetah_run / "runs" / "halfcheetah" / "checkpoint.pt"
    policy = vpg.load_policy(path)
    checkpoint = torch.load(path, weights_only=True)
    spaces = vpg.describe_env("HalfCheetah-v5")
    config = vpg.Config(**{k: v for k, v in checkpoint["config"].items() if k in vpg.Config.__dataclass_fields__})
    network = vpg.make_networks(spaces, config)[0]
    network.load_state_dict(checkpoint["policy"])
    normalizer = vpg.ObservationNormalizer(spaces.obs_dim)
    normalizer.load_state_dict(checkpoint["obs_normalizer"])
    observations = np.random.default_rng(0).normal(size=(6, spaces.obs_dim)) * 5
    with torch.no_grad():
        mean, _ = network(torch.from_numpy(normalizer(observations)))
    expected = np.clip(mean.numpy().astype(np.float64), spaces.action_low, spaces.action_high)
    assert np.allclose(policy.act(observations, deterministic=True), expected, atol=1e-6)
    assert np.allclose(policy.act(observations[2], deterministic=True), expected[2], atol=1e-6)
    sampled = policy.act(np.repeat(observations[:1], 500, 0))
    assert np.all(sampled >= spaces.action_low) and np.all(sampled <= spaces.action_high)
    assert not np.allclose(sampled, sampled[0])  # sampled, not the mean


def test_a_path_that_is_not_a_checkpoint_is_a_config_error(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"not a checkpoint")
    for module in (ppo_atari, vpg):
        with pytest.raises(module.ConfigError, match=f"damaged or not a checkpoint of {module.__name__}.py"):
            module.load_policy(tmp_path / "x.pt")
