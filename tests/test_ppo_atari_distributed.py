"""ppo_atari.py past one device: data-parallel ranks (gloo on CPU), directly and under torchrun. What the
ranks of both PyTorch scripts do alike is tested once, in `test_torch_scripts_distributed.py`."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ppo_atari
from conftest import ROOT
from ppo_atari_helpers import RandomFrames
from processes import children_of, free_port, living, process_tree

SCRIPT = str(ROOT / "ppo_atari.py")


CONFIG = dict(num_envs=2, num_steps=8, num_minibatches=1, update_epochs=2, total_timesteps=32 * 10,
              learning_rate=1e-3, max_grad_norm=0.5)
UPDATES = 3


def run_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # different initialisations: the broadcast must make them equal
    config = ppo_atari.Config(**CONFIG)
    trainer = ppo_atari.DataParallelTrainer(config, RandomFrames(2, seed=rank), torch.device("cpu"),
                                            ppo_atari.Ranks(size=2, rank=rank))
    gradients = record_gradients(trainer)
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rollouts, stats, weights = [], [], []
    for _ in range(UPDATES):
        rollout = trainer.collect_rollout()
        rollouts.append(ppo_atari.Rollout(*(x.clone() for x in rollout)))
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        stats.append(trainer.update_policy(rollout))
    torch.save({"initial": initial, "final": trainer.model.state_dict(), "rollouts": [r._asdict() for r in rollouts],
                "stats": stats, "weights": weights, "gradients": gradients}, out)
    dist.destroy_process_group()
    ppo_atari.exit_process(0, ranks=2)  # as the script ends a rank


def record_gradients(trainer) -> list[torch.Tensor]:
    """The gradient of every optimizer step `trainer` takes from now on, as one flat vector each:
    what Adam is given, after any averaging over the ranks and the clip of its norm."""
    gradients = []

    def keep(optimizer, args, kwargs):
        gradients.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).clone())

    trainer.optimizer.register_step_pre_hook(keep)
    return gradients


def start_ranks(target, folder: Path, *args) -> list:
    port = free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=target, args=(rank, port, str(folder / f"rank{rank}.pt"), *args))
                 for rank in range(2)]
    for process in processes:
        process.start()
    return processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two gloo ranks, each with its own data, through `UPDATES` updates of the real trainer."""
    folder = tmp_path_factory.mktemp("ranks")
    for process in start_ranks(run_rank, folder):
        process.join(timeout=300)
        assert process.exitcode == 0
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def test_ranks_start_equal_and_stay_identical(two_ranks):
    rank0, rank1 = two_ranks
    for name in rank0["initial"]:
        torch.testing.assert_close(rank0["initial"][name], rank1["initial"][name], rtol=0, atol=0)
        torch.testing.assert_close(rank0["final"][name], rank1["final"][name], rtol=0, atol=0)
    assert any(not torch.equal(rank0["initial"][name], rank0["final"][name]) for name in rank0["initial"])
    # Different games on each rank: the rollouts differ.
    assert not torch.equal(rank0["rollouts"][0]["obs"], rank1["rollouts"][0]["obs"])
    # The logged statistics are means over the ranks, the same on both.
    assert rank0["stats"] == rank1["stats"]


def combined(rank0: dict, rank1: dict, update: int) -> ppo_atari.Rollout:
    """The two ranks' rollouts of `update` side by side: one process's rollout of all four games."""
    first, second = rank0["rollouts"][update], rank1["rollouts"][update]
    return ppo_atari.Rollout(**{name: torch.cat([first[name], second[name]], dim=1) for name in first})


def test_ranks_equal_one_process_on_the_combined_batch(two_ranks):
    # What data-parallel training promises: with full-batch minibatches (num_minibatches=1) the
    # ranks' averaged gradient is the gradient of one process on the combined batch, advantages
    # normalised over all of it and the norm clipped after averaging. Equal up to float32 rounding,
    # which another order of the same sums changes: so the gradients are compared relative to
    # their norm, from the same weights. The weights after many Adam steps are not compared: Adam
    # divides each step by the gradient's running scale, so a component near 0 whose rounding
    # flips its sign moves its weight by up to twice the learning rate, on one CPU and not on
    # another (AVX2, AVX-512 and AMX sum in different orders).
    rank0, rank1 = two_ranks
    config = ppo_atari.Config(**{**CONFIG, "num_envs": 4})
    single = ppo_atari.Trainer(config, RandomFrames(4, seed=9), torch.device("cpu"))
    assert single.num_updates == 10
    gradients = record_gradients(single)
    # Each update from the ranks' weights at its start: the first step's gradient must be the one
    # the ranks took (measured: within 1.2e-6 of its norm on AVX2 and AVX-512; 0.47 of it when the
    # ranks skip the averaging and step on their own halves).
    for update in range(UPDATES):
        single.model.load_state_dict(rank0["weights"][update])
        single.update = update
        gradients.clear()
        single.update_policy(combined(rank0, rank1, update))
        ours, theirs = gradients[0], rank0["gradients"][update * CONFIG["update_epochs"]]
        assert torch.linalg.vector_norm(ours - theirs) <= 1e-5 * torch.linalg.vector_norm(ours), update

    # The whole run, from the same initial weights: the losses agree at every update, relative to
    # their scale. The policy loss is a mean of normalised advantages (standard deviation 1) times
    # ratios near 1, so its scale is 1, though its value sits near 0. (Measured: within 7e-6 of
    # the scale; without the averaging, 1.6e-3 and more.)
    single = ppo_atari.Trainer(config, RandomFrames(4, seed=9), torch.device("cpu"))
    single.model.load_state_dict(rank0["initial"])
    for update, stats in enumerate(rank0["stats"]):
        ours = single.update_policy(combined(rank0, rank1, update))
        assert ours["learning_rate"] == stats["learning_rate"]
        for name in ["policy_loss", "value_loss", "entropy"]:
            scale = 1.0 if name == "policy_loss" else abs(stats[name])
            assert abs(ours[name] - stats[name]) <= 1e-4 * scale, (update, name, ours[name], stats[name])


def torchrun(*args, **popen):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), SCRIPT, "--num-envs", "2", "--num-steps", "32",
               "--num-workers", "1", *map(str, args)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, PermissionError):
        return None
    values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    return int(values[b"RANK"]) if b"RANK" in values else None


def wait_for_checkpoint(path: Path, process, seconds=240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.5)


def test_each_rank_plays_its_own_slice_of_the_run_games(breakout_id):
    # Sticky actions draw from each game's seed, so games of other seeds part ways within a few steps.
    options = dict(sticky_actions=0.25, life_loss=True, noop_max=30, frame_skip=4, max_episode_frames=600)

    def play(num_envs: int, first_game: int) -> np.ndarray:
        with ppo_atari.Workers(breakout_id, num_envs, 1, 3, options, first_game=first_game) as workers:
            frames = [workers.reset().copy()]
            frames += [workers.step(np.full(num_envs, step % 4)).obs.copy() for step in range(40)]
        return np.stack(frames, axis=1)

    everyone = play(4, first_game=0)
    np.testing.assert_array_equal(play(2, first_game=2), everyone[2:])  # the second rank's games: 2 and 3 of the run
    assert not np.array_equal(everyone[:2], everyone[2:])


def test_torchrun_trains_on_two_ranks_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # --num-workers 0: the ranks on one machine share its cores, each taking its part for its workers.
    process = torchrun("--total-timesteps", 512, "--checkpoint-every", 2, "--run-dir", run_dir, "--num-workers", 0)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    workers = max(1, min(2, len(os.sched_getaffinity(0)) // 2))
    assert f"2 games in {workers} worker{'s' * (workers > 1)} on each of 2 ranks" in output
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    # 2 ranks x 2 games x 32 steps = 128 agent steps an update.
    assert checkpoint["ranks"] == 2 and checkpoint["update"] == 4 and checkpoint["global_step"] == 512
    assert len(checkpoint["torch_rng"]) == 2 and not torch.equal(*checkpoint["torch_rng"])
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 alone writes
    assert output.count("training on cpu") == 1

    resumed = torchrun("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 768)
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] == 6 and checkpoint["global_step"] == 768

    alone = subprocess.run([sys.executable, SCRIPT, "--resume", str(run_dir / "checkpoint.pt")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "written by a run of 2 ranks" in alone.stderr


def test_a_failed_rank_brings_the_others_down(tmp_path):
    process = torchrun("--total-timesteps", 10_000_000, "--checkpoint-every", 1, "--run-dir", tmp_path)
    try:
        wait_for_checkpoint(tmp_path / "checkpoint.pt", process)
        tree = process_tree(process.pid)
        # torchrun's own children are the ranks (their children are the game workers).
        ranks = {rank_of(pid): pid for pid in children_of(process.pid)}
        os.kill(ranks[1], signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode != 0
    assert "FAILED" in output and "rank      : 1" in output
    time.sleep(1)
    assert living(tree) == []
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] >= 1
