"""ppo_atari.py on a CUDA GPU: the same update as on the CPU, `--device auto` picking the GPU,
checkpoints that move between the two, frames that reach the GPU from pinned memory, actions chosen
by a CUDA graph, how often the host waits for the GPU in a rollout and in an update, and a NaN there
(Ctrl-C on the GPU is in `test_ppo_atari_cli.py`, beside the CPU's).

Every test here needs a GPU and is skipped, by name, on a machine without one (CI has none); the
GPU runs of the other two scripts are beside their CPU tests, in their own `*_cli.py` files."""

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import ppo_atari
from conftest import ROOT
from test_ppo_atari_learning import train_on_task
from test_ppo_atari_model import ScriptedEnv, a_nan_stops_the_update, small_config
from test_ppo_atari_workers import OPTIONS, InProcessGames

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


def host_syncs(call):
    """What `call()` returns, and the messages of the waits of the host for the GPU that it made."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [str(w.message) for w in caught if "synchronizing" in str(w.message)]


@pytest.mark.parametrize("kind", [ppo_atari.Trainer, ppo_atari.RunTrainer])
def test_an_update_on_cuda_is_the_update_on_the_cpu(kind, exact_float32):
    # One rollout, played on the host, updated on both devices from the same weights. One minibatch
    # of the whole batch makes the update independent of the order each device's generator draws.
    # Five steps: `RunTrainer` takes three as they are, captures the fourth and replays the last two.
    config = ppo_atari.RunConfig(**vars(small_config(num_minibatches=1, update_epochs=5)), precision="fp32")
    torch.manual_seed(0)
    cpu = kind(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cpu"))
    rollout = ppo_atari.Rollout(*(tensor.clone() for tensor in cpu.collect_rollout()))
    cuda = kind(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cuda"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # kind's __init__ may set them
    cuda.model.load_state_dict(cpu.model.state_dict())
    theirs, ours = cpu.update_policy(rollout), cuda.update_policy(rollout)
    assert (getattr(cuda, "update_graph", None) is not None) == (kind is ppo_atari.RunTrainer)
    for name in ["loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance"]:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name
    for name, weights in cpu.model.state_dict().items():
        torch.testing.assert_close(cuda.model.state_dict()[name].cpu(), weights, rtol=1e-4, atol=1e-6, msg=name)


def test_frames_reach_the_gpu_from_pinned_memory_in_the_order_they_were_played(exact_float32):
    # The copy of each step's frames is asynchronous: each stored observation, and each value the
    # network gave it, must still be those of its own step. In true float32: with TF32, a batch of 8
    # and the batch of 256 below differed by up to 1e-4 on an H200, as much as a step's values may.
    config = ppo_atari.RunConfig(**vars(small_config(num_steps=32)), precision="fp32")
    torch.manual_seed(0)
    trainer = ppo_atari.RunTrainer(config, ScriptedEnv(), torch.device("cuda"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # its __init__ sets them
    rollout = trainer.collect_rollout()
    assert all(tensor.is_pinned() and not tensor.is_cuda for tensor in rollout)
    assert rollout.obs.is_contiguous()  # channels first, as the games give them: the GPU transposes them
    for t in range(config.num_steps):
        assert (rollout.obs[t] == t).all(), f"step {t}"
    assert (trainer.next_obs == config.num_steps).all()
    with torch.inference_mode():
        values = trainer.model(rollout.obs.flatten(0, 1).cuda())[1].view(config.num_steps, -1).cpu()
    torch.testing.assert_close(rollout.values, values)


def test_actions_chosen_by_a_cuda_graph_follow_the_frames_and_the_weights():
    config = ppo_atari.RunConfig(**vars(small_config(num_envs=4)), precision="fp32")
    torch.manual_seed(0)
    trainer = ppo_atari.RunTrainer(config, ScriptedEnv(num_envs=4), torch.device("cuda"))
    assert trainer.cuda_graph  # on by default on CUDA
    frames = [torch.randint(0, 256, (4, 4, 84, 84), dtype=torch.uint8, device="cuda") for _ in range(2)]

    def check(obs):
        with torch.inference_mode():
            actions, log_probs, values = (output.clone() for output in trainer.sample_actions(obs))
            logits, expected_values = trainer.model(obs)
        torch.testing.assert_close(values, expected_values)
        torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1))
        return values

    first = [check(obs) for obs in frames]
    assert not torch.equal(first[0], first[1])  # the graph reads each call's frames, not the first ones
    assert trainer.graph is not None
    with torch.no_grad():
        for parameter in trainer.model.value.parameters():
            parameter.add_(1.0)
    assert not torch.equal(check(frames[0]), first[0])  # and the weights as they are now
    # The actions are drawn afresh at each replay, from the policy's probabilities.
    with torch.inference_mode():
        probs = torch.softmax(trainer.model(frames[0])[0], -1)
        counts = torch.zeros_like(probs)
        for _ in range(2000):
            actions = trainer.sample_actions(frames[0])[0]
            counts[torch.arange(4, device="cuda"), actions] += 1
    torch.testing.assert_close(counts / 2000, probs, atol=0.05, rtol=0)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_rollout_on_cuda_waits_for_the_gpu_once_a_step_and_holds_the_frames_each_action_was_chosen_from(
        breakout_id, cuda_graph):
    # Replaying the stored actions in games of this process must meet the stored frames, step by
    # step. The host waits for the GPU once a step, for the actions to come back, and twice a
    # rollout, for the values after it (and those of truncated games): counted in the second
    # rollout, once any graph is captured. An update waits once, at its end.
    num_envs, seed = 4, 3
    config = ppo_atari.RunConfig(env=breakout_id, num_envs=num_envs, num_steps=64, num_minibatches=2,
                                 total_timesteps=512, precision="fp32")
    torch.manual_seed(0)
    played = []
    with ppo_atari.Workers(breakout_id, num_envs, 2, seed, OPTIONS) as workers:
        trainer = ppo_atari.RunTrainer(config, workers, torch.device("cuda"))
        trainer.cuda_graph = trainer.cuda_graph_update = cuda_graph
        for _ in range(2):
            rollout, syncs = host_syncs(trainer.collect_rollout)
            played.append(ppo_atari.Rollout(*(tensor.clone() for tensor in rollout)))
            _, update_syncs = host_syncs(lambda: trainer.update_policy(rollout))
            assert len(update_syncs) == 1, update_syncs
    assert config.num_steps <= len(syncs) <= config.num_steps + 4, syncs[:3]
    assert (trainer.graph is not None) == (trainer.update_graph is not None) == cuda_graph
    reference = InProcessGames(breakout_id, num_envs, seed)
    frames = reference.reset()
    for rollout in played:
        for t in range(config.num_steps):
            np.testing.assert_array_equal(rollout.obs[t].numpy(), frames, err_msg=f"step {t}")
            rows = reference.step(rollout.actions[t].numpy())
            np.testing.assert_array_equal(rollout.rewards[t].numpy(), [step.reward for step, _, _ in rows])
            np.testing.assert_array_equal(rollout.terminated[t].numpy(), [step.terminated for step, _, _ in rows])
            frames = np.stack([obs for _, _, obs in rows])


def test_a_nan_on_cuda_stops_the_update_and_names_it():
    torch.manual_seed(0)
    a_nan_stops_the_update(ppo_atari.RunTrainer(ppo_atari.RunConfig(**vars(small_config())), ScriptedEnv(),
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
        assert evaluated.returncode == 0 and "1 game, score" in evaluated.stdout, evaluated.stderr


def test_trains_with_a_bfloat16_torso_on_the_gpu(tmp_path):
    # Both graphs captured with the torso under autocast: four updates of two minibatch steps.
    result = run(*TINY, "--total-timesteps", 512, "--precision", "bf16", "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "training on cuda:0 (bfloat16 torso)" in result.stderr
    final = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert final["update"] == 4 and all(torch.isfinite(w).all() for w in final["model"].values())


def test_learns_which_action_pays_on_the_gpu(monkeypatch):
    assert train_on_task(+1.0, monkeypatch, device="cuda") >= 0.9  # random play earns 0.25
