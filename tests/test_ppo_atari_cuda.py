"""ppo_atari.py on a CUDA GPU: the same update as on the CPU, `--device auto` picking the GPU,
checkpoints that move between the two, the pinned staging of frames, and a NaN there (Ctrl-C on
the GPU is in `test_ppo_atari_cli.py`, beside the CPU's).

Every test here needs a GPU and is skipped, by name, on a machine without one (CI has none); the
GPU runs of the other two scripts are beside their CPU tests, in their own `*_cli.py` files."""

import subprocess
import sys

import pytest
import torch

import ppo_atari
from conftest import ROOT
from test_ppo_atari_learning import train_on_task
from test_ppo_atari_model import ScriptedEnv, a_nan_stops_the_update, small_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = str(ROOT / "ppo_atari.py")
# A tiny Breakout run on the GPU: 2 games in 2 workers, updates of 128 steps.
TINY = ["--env", "Breakout", "--num-envs", 2, "--num-steps", 64, "--num-minibatches", 2, "--update-epochs", 1,
        "--seed", 5]


def run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture
def exact_float32(monkeypatch):
    """CUDA's matrix products in true float32: the tuned trainer lets them use TF32 (10-bit
    mantissas), which would hide a real difference behind rounding."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("kind", [ppo_atari.Trainer, ppo_atari.TunedTrainer])
def test_an_update_on_cuda_is_the_update_on_the_cpu(kind, exact_float32):
    # One rollout, sampled on the CPU, updated on both devices from the same weights. One minibatch
    # of the whole batch makes the update independent of the order each device's generator draws.
    config = ppo_atari.RunConfig(**vars(small_config(num_minibatches=1, update_epochs=3)), precision="fp32")
    torch.manual_seed(0)
    cpu = kind(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cpu"))
    rollout = cpu.collect_rollout()
    cuda = kind(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cuda"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # kind's __init__ may set them
    cuda.model.load_state_dict(cpu.model.state_dict())
    on_cuda = ppo_atari.Rollout(*(tensor.to("cuda") for tensor in rollout))
    theirs, ours = cpu.update_policy(rollout), cuda.update_policy(on_cuda)
    for name in ["loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance"]:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name
    for name, weights in cpu.model.state_dict().items():
        torch.testing.assert_close(cuda.model.state_dict()[name].cpu(), weights, rtol=1e-4, atol=1e-6, msg=name)


def test_frames_reach_the_gpu_through_pinned_memory_in_the_order_they_were_played():
    # The copy from the pinned staging buffer is asynchronous, and the buffer is reused every step:
    # each stored observation must still be the frames of its own step.
    config = ppo_atari.RunConfig(**vars(small_config(num_steps=32)), precision="fp32")
    torch.manual_seed(0)
    trainer = ppo_atari.TunedTrainer(config, ScriptedEnv(), torch.device("cuda"))
    assert trainer.staging.is_pinned() and trainer.obs.is_cuda
    rollout = trainer.collect_rollout()
    stored = rollout.obs.cpu()
    for t in range(config.num_steps):
        assert (stored[t] == t).all(), f"step {t}"
    assert (trainer.next_obs.cpu() == config.num_steps).all()


def test_a_nan_on_cuda_stops_the_update_and_names_it():
    torch.manual_seed(0)
    a_nan_stops_the_update(ppo_atari.TunedTrainer(ppo_atari.RunConfig(**vars(small_config())), ScriptedEnv(),
                                                  torch.device("cuda")))


def test_auto_picks_the_gpu():
    assert ppo_atari.choose_device("auto") == torch.device("cuda", 0)
    assert ppo_atari.choose_device("cpu") == torch.device("cpu")
    assert not ppo_atari.use_bf16("auto", torch.device("cuda", 0))  # float32 (with TF32) on a GPU


def test_a_checkpoint_moves_from_the_gpu_to_the_cpu_and_back(tmp_path):
    first = run(*TINY, "--total-timesteps", 256, "--run-dir", tmp_path / "gpu")
    assert first.returncode == 0, first.stderr
    assert "training on cuda:0 (float32 torso)" in first.stderr  # --device auto
    on_gpu = torch.load(tmp_path / "gpu" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert len(on_gpu["cuda_rng"][0]) > 0

    cpu = run("--resume", tmp_path / "gpu" / "checkpoint.pt", "--total-timesteps", 512, "--device", "cpu",
              "--run-dir", tmp_path / "cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert "training on cpu" in cpu.stderr and "resumed at step 256 (update 2)" in cpu.stderr
    back = run("--resume", tmp_path / "cpu" / "checkpoint.pt", "--total-timesteps", 768, "--device", "cuda",
               "--run-dir", tmp_path / "back")
    assert back.returncode == 0, back.stderr
    assert "training on cuda:0" in back.stderr and "resumed at step 512 (update 4)" in back.stderr
    final = torch.load(tmp_path / "back" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert final["update"] == 6 and all(torch.isfinite(w).all() for w in final["model"].values())
    for device in ["cpu", "cuda"]:
        evaluated = run("--eval", tmp_path / "back" / "checkpoint.pt", "--eval-episodes", 1, "--device", device)
        assert evaluated.returncode == 0 and "1 games, score" in evaluated.stdout, evaluated.stderr


def test_learns_which_action_pays_on_the_gpu(monkeypatch):
    assert train_on_task(+1.0, monkeypatch, device="cuda") >= 0.9  # random play earns 0.25
