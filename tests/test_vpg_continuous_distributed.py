"""vpg_continuous.py past one device: data-parallel ranks (gloo on CPU), directly and under torchrun.
What the ranks of both PyTorch scripts do alike is tested once, in `test_torch_scripts_distributed.py`."""

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import vpg_continuous as vpg
from conftest import ROOT
from processes import free_port
from vpg_continuous_helpers import DriftingTask, statistics_with_the_prior

SCRIPT = str(ROOT / "vpg_continuous.py")


# Full-batch value fitting (num_minibatches=1), so that the update of each rank on its half is the
# update of one process on the whole, whatever order each rank shuffles its batch in.
# With the reward scaler's prior, so that the pooled statistics show it counted once for all ranks.
CONFIG = dict(num_envs=2, num_steps=8, num_minibatches=1, value_epochs=2, total_timesteps=32 * 10,
              reward_prior_and_clip=True)
UPDATES = 3
STEPS = 1 + CONFIG["value_epochs"] * CONFIG["num_minibatches"]  # optimizer steps in an update: the policy's first


def statistics(trainer: vpg.Trainer) -> dict:
    return {"obs": trainer.obs_normalizer.state_dict(), "rewards": trainer.reward_scaler.stats.state_dict()}


def run_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # different initialisations: the broadcast must make them equal
    envs = DriftingTask(2, seed=rank)
    trainer = vpg.DataParallelTrainer(vpg.Config(**CONFIG), envs, torch.device("cpu"), vpg.Ranks(size=2, rank=rank))
    gradients = record_gradients(trainer)
    initial = weights(trainer)
    rollouts, stats, starts = [], [], []
    for _ in range(UPDATES):
        rollout = trainer.collect_rollout()
        rollouts.append({name: x.clone() for name, x in rollout._asdict().items()})
        starts.append(weights(trainer))
        stats.append(trainer.update_policy(rollout))
    torch.save({"initial": initial, "final": weights(trainer), "starts": starts, "gradients": gradients,
                "rollouts": rollouts, "stats": stats, "statistics": statistics(trainer),
                "observations": np.concatenate(envs.observations), "rewards": np.stack(envs.rewards),
                "done": np.stack(envs.done)}, out)
    dist.destroy_process_group()
    vpg.exit_process(0, ranks=2)  # as the script ends a rank


def weights(trainer: vpg.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.clone() for k, v in getattr(trainer, name).state_dict().items()} for name in ["policy", "value"]}


def load_weights(trainer: vpg.Trainer, saved: dict) -> None:
    trainer.policy.load_state_dict(saved["policy"])
    trainer.value.load_state_dict(saved["value"])


def record_gradients(trainer: vpg.Trainer) -> list[torch.Tensor]:
    """The gradient of every optimizer step `trainer` takes from now on, as one vector over both
    networks (0 where a step has none): what Adam is given, after the averaging over the ranks and
    the clip of its norm."""
    gradients = []
    parameters = list(trainer.policy.parameters()) + list(trainer.value.parameters())

    def keep(optimizer, args, kwargs):
        gradients.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                    for p in parameters]).clone())

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
    """Two gloo ranks, each with its own envs, through `UPDATES` updates of the real trainer."""
    folder = tmp_path_factory.mktemp("ranks")
    for process in start_ranks(run_rank, folder):
        process.join(timeout=120)
        assert process.exitcode == 0
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def test_ranks_start_equal_and_stay_identical(two_ranks):
    rank0, rank1 = two_ranks
    for network in ["policy", "value"]:
        for name, initial in rank0["initial"][network].items():
            torch.testing.assert_close(rank1["initial"][network][name], initial, rtol=0, atol=0)
            torch.testing.assert_close(rank1["final"][network][name], rank0["final"][network][name], rtol=0, atol=0)
            assert not torch.equal(rank0["final"][network][name], initial)
    # Each rank stepped its own envs, yet both hold the same statistics and logged the same means.
    assert not torch.equal(rank0["rollouts"][0]["obs"], rank1["rollouts"][0]["obs"])
    for kind in ["obs", "rewards"]:
        for key, value in rank0["statistics"][kind].items():
            assert torch.equal(torch.as_tensor(rank1["statistics"][kind][key]), torch.as_tensor(value)), (kind, key)
    assert rank0["stats"] == rank1["stats"]


def combined(rank0: dict, rank1: dict, update: int) -> vpg.Rollout:
    """The two ranks' rollouts of `update` side by side: one process's rollout of all four envs."""
    first, second = rank0["rollouts"][update], rank1["rollouts"][update]
    return vpg.Rollout(**{name: torch.cat([first[name], second[name]], dim=1) for name in first})


def test_ranks_equal_one_process_on_the_combined_batch(two_ranks):
    # What data-parallel training promises: the ranks' averaged gradients of means over equal
    # batches are the gradient of the mean over the combined batch, the advantages are normalised
    # over all of it, and the norm is clipped after averaging, as one process on the combined batch
    # does. Equal up to float32 rounding, which another order of the same sums changes: so the
    # gradients are compared relative to their norm, from the same weights. The weights after
    # several Adam steps are not compared: Adam divides each step by the gradient's running scale,
    # so a component near 0 whose rounding flips its sign moves its weight by up to twice the
    # learning rate, on one CPU and not on another (AVX2, AVX-512 and AMX sum in other orders).
    rank0, rank1 = two_ranks
    config = vpg.Config(**{**CONFIG, "num_envs": 4})
    single = vpg.Trainer(config, DriftingTask(4, seed=9), torch.device("cpu"))
    assert single.num_updates == 10
    gradients = record_gradients(single)
    # Each update from the ranks' weights at its start: the policy-gradient step's gradient must be
    # the one the ranks took. (Measured: within 1.5e-7 of its norm, on AVX-512 and with
    # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, on 1 or 2 threads; 0.84 of it when the ranks
    # skip the averaging, 0.37 when each normalises its advantages alone.)
    for update in range(UPDATES):
        load_weights(single, rank0["starts"][update])
        single.update = update
        gradients.clear()
        single.update_policy(combined(rank0, rank1, update))
        ours, theirs = gradients[0], rank0["gradients"][update * STEPS]
        assert torch.linalg.vector_norm(ours - theirs) <= 1e-5 * torch.linalg.vector_norm(ours), update

    # The whole run, from the same initial weights: the losses agree at every update, relative to
    # their scale. The policy loss is a mean of log-probabilities (of order 1) times normalised
    # advantages (standard deviation 1), so its scale is 1, though its value sits near 0.
    # (Measured: within 1e-7 of the scale; without the averaging, 5.6e-4 and more.)
    single = vpg.Trainer(config, DriftingTask(4, seed=9), torch.device("cpu"))
    load_weights(single, rank0["initial"])
    for update, stats in enumerate(rank0["stats"]):
        ours = single.update_policy(combined(rank0, rank1, update))
        assert ours["learning_rate"] == stats["learning_rate"]
        for name in ["policy_loss", "value_loss", "entropy"]:
            scale = 1.0 if name == "policy_loss" else abs(stats[name])
            assert abs(ours[name] - stats[name]) <= 1e-4 * scale, (update, name, ours[name], stats[name])
        # The KL estimate, the mean of (r - 1) - log r, of order 1e-4, is a difference of numbers
        # near 1: float32 rounding of the log-ratio moves it by about 1e-5 of itself.
        assert ours["approx_kl"] == pytest.approx(stats["approx_kl"], rel=1e-3), update


def test_the_pooled_statistics_are_those_of_both_streams(two_ranks):
    rank0, _ = two_ranks
    observations = np.concatenate([rank["observations"] for rank in two_ranks])
    obs = rank0["statistics"]["obs"]
    assert obs["count"] == len(observations) == 2 * 2 * (1 + UPDATES * CONFIG["num_steps"])
    np.testing.assert_allclose(obs["mean"].numpy(), observations.mean(0), rtol=1e-10)
    np.testing.assert_allclose(obs["var"].numpy(), observations.var(0), rtol=1e-10)
    # The reward scaler's discounted returns, recomputed from each rank's rewards and episode ends.
    returns = []
    for rank in two_ranks:
        running = np.zeros(2)
        for rewards, done in zip(rank["rewards"], rank["done"]):
            running = running * vpg.Config.gamma + rewards
            returns.append(running.copy())
            running[done] = 0.0
    returns = np.concatenate(returns)
    # With the scaler's prior, one return of mean 0 and variance 1, counted once for both ranks.
    mean, var = statistics_with_the_prior(returns)
    scaler = rank0["statistics"]["rewards"]
    assert scaler["count"] == 1 + len(returns)
    assert scaler["mean"].item() == pytest.approx(mean, rel=1e-10)
    assert scaler["var"].item() == pytest.approx(var, rel=1e-10)


def test_a_prior_counts_once_however_many_ranks_pool_it():
    # Three ranks' reward statistics, each starting from the scaler's prior, pooled as
    # `Ranks.share_statistics` pools them after each of two rollouts: every rank must end with the
    # statistics of all returns and the prior, counted once rather than once per rank.
    rng = np.random.default_rng(0)
    ranks = [vpg.SharedRunningMeanStd.starting_from(vpg.RewardScaler(2, 0.99).stats) for _ in range(3)]
    seen = []
    for _ in range(2):
        for stats in ranks:
            for _ in range(5):
                seen.append(rng.normal(3.0, 2.0, size=2))
                stats.update(seen[-1])
        vectors = [stats.fresh_vector() for stats in ranks]
        for stats in ranks:
            stats.agree(vectors)
    mean, var = statistics_with_the_prior(np.concatenate(seen))
    for stats in ranks:
        assert stats.count == 1 + 3 * 2 * 5 * 2
        assert stats.mean == pytest.approx(mean, rel=1e-12) and stats.var == pytest.approx(var, rel=1e-12)


def test_each_rank_steps_its_own_slice_of_the_run_envs():
    spaces = vpg.describe_env("Pendulum-v1")
    with vpg.Workers("Pendulum-v1", 4, 1, seed=3, spaces=spaces) as all_envs:
        everyone = all_envs.reset().copy()
    with vpg.Workers("Pendulum-v1", 2, 1, seed=3, spaces=spaces, first_env=2) as second_rank:
        np.testing.assert_array_equal(second_rank.reset(), everyone[2:])
    assert not np.array_equal(everyone[:2], everyone[2:])


def torchrun(*args, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), SCRIPT, "--env", "Pendulum-v1", "--num-envs", "2", "--num-steps", "64",
               "--num-workers", "1", "--value-epochs", "1", "--num-minibatches", "1", *map(str, args)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_torchrun_trains_on_two_ranks_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # --num-workers 0: the ranks on one machine share its cores, each taking its part for its workers.
    process = torchrun("--total-timesteps", 1024, "--checkpoint-every", 2, "--run-dir", run_dir, "--num-workers", 0)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    workers = max(1, min(2, len(os.sched_getaffinity(0)) // 2))
    assert f"2 envs in {workers} worker{'s' * (workers > 1)} on each of 2 ranks" in output
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    # 2 ranks x 2 envs x 64 steps = 256 steps an update.
    assert checkpoint["ranks"] == 2 and checkpoint["update"] == 4 and checkpoint["global_step"] == 1024
    assert len(checkpoint["torch_rng"]) == 2 and not torch.equal(*checkpoint["torch_rng"])
    # The statistics of both ranks: 2 x 2 first observations and one per step; 1,024 returns.
    assert checkpoint["obs_normalizer"]["count"] == 4 + 1024 and checkpoint["reward_scaler"]["count"] == 1024
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 alone writes
    assert output.count("training on cpu, 2 envs in 1 worker on each of 2 ranks") == 1
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("losses/policy_loss")] == [256, 512, 768, 1024]
    # Pendulum's episodes last 200 steps: each of the 4 envs of the 2 ranks finished one.
    assert [e.value for e in events.Scalars("charts/episodic_length")] == [200] * 4

    resumed = torchrun("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 1536)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] == 6 and checkpoint["global_step"] == 1536
    assert checkpoint["obs_normalizer"]["count"] == 1028 + 4 + 512

    alone = subprocess.run([sys.executable, SCRIPT, "--resume", str(run_dir / "checkpoint.pt")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "written by a run of 2 ranks; resume it with as many, not 1" in alone.stderr
