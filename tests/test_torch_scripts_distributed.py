"""ppo_atari.py and vpg_continuous.py past one device: what the two scripts' ranks do alike, written
once and run for both (each script's own tests of its ranks are in its own file)."""

import contextlib
import importlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ppo_atari_helpers import RandomFrames
from processes import free_port, living, process_tree
from torch_scripts import IDS, ROOT, SCRIPTS, Script
from vpg_continuous_helpers import DriftingTask


@pytest.fixture(params=SCRIPTS, ids=IDS)
def script(request) -> Script:
    return request.param


def test_a_rank_exits_with_its_status_and_its_output_flushed(script):
    # A rank skips the interpreter's shutdown (see `exit_process`), here an exit handler, but what
    # it printed must still arrive.
    name = script.module.__name__
    program = (f"import atexit, sys, {name}; atexit.register(print, 'shut down'); "
               "print('written', end=''); print('and this', end='', file=sys.stderr); "
               f"{name}.exit_process(5, ranks=2)")
    ended = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (ended.returncode, ended.stdout, ended.stderr) == (5, "written", "and this")
    with pytest.raises(SystemExit) as stopped:
        script.module.exit_process(3, ranks=1)  # one process exits as usual, through SystemExit
    assert stopped.value.code == 3


def small_trainer(name: str, rank: int):
    """Part 4's trainer of script `name` as rank `rank` of two, on a vector env of noise of its own."""
    module = importlib.import_module(name)
    ranks, cpu = module.Ranks(size=2, rank=rank), torch.device("cpu")
    if name == "ppo_atari":
        config = module.Config(num_envs=2, num_steps=8, num_minibatches=1, update_epochs=2, total_timesteps=320)
        return module.DataParallelTrainer(config, RandomFrames(2, seed=rank), cpu, ranks)
    config = module.Config(num_envs=2, num_steps=8, num_minibatches=1, value_epochs=2, total_timesteps=320)
    return module.DataParallelTrainer(config, DriftingTask(2, seed=rank), cpu, ranks)


def run_failing_rank(rank: int, port: int, out: str, name: str, dies_in: str) -> None:
    """Rank 1 dies after one update, in the next rollout or the next update; rank 0 goes on and
    writes down how it ended, then leaves at once, the moment at which an abort would come."""
    module = importlib.import_module(name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trainer = small_trainer(name, rank)
    trainer.update_policy(trainer.collect_rollout())
    if rank == 1:
        if dies_in == "update":
            trainer.collect_rollout()
        os._exit(3)
    try:
        for _ in range(5):
            trainer.update_policy(trainer.collect_rollout())
        Path(out).write_text(json.dumps({"message": "went on without rank 1"}))
    except module.RankFailure as error:
        # The failed operation's tensors must still be held here, by the kept error's frames.
        kept = module.FAILED_COLLECTIVES
        frames = traceback.walk_tb(kept[0].__traceback__) if kept else []
        tensors = sum(isinstance(value, torch.Tensor) for frame, _ in frames for value in frame.f_locals.values())
        Path(out).write_text(json.dumps({"message": str(error), "kept": len(kept), "tensors": tensors}))


@pytest.mark.parametrize("dies_in", ["rollout", "update"])
def test_a_failed_rank_stops_the_other_with_one_line(script, tmp_path, dies_in):
    port = free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=run_failing_rank, args=(rank, port, str(tmp_path / f"rank{rank}.json"),
                                                                script.module.__name__, dies_in))
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(timeout=120)
    finally:
        for process in processes:
            process.kill()
    # -6 for rank 0 would be gloo's thread aborting the process as it shuts down (see FAILED_COLLECTIVES).
    assert [process.exitcode for process in processes] == [0, 3]
    report = json.loads((tmp_path / "rank0.json").read_text())
    message = report["message"]
    assert message.startswith("rank 0: another rank failed or left (") and "\n" not in message, message
    assert report["kept"] == 1 and report["tensors"] >= 1, report


# Two ranks of 2 envs, 1 worker each, under torchrun; and the agent steps of an update of both.
TORCHRUN = {"ppo_atari": (["--num-envs", "2", "--num-steps", "32", "--num-workers", "1"], 2 * 2 * 32),
            "vpg_continuous": (["--env", "Pendulum-v1", "--num-envs", "2", "--num-steps", "64", "--num-workers", "1",
                                "--value-epochs", "1", "--num-minibatches", "1"], 2 * 2 * 64)}


@pytest.mark.parametrize("sent", ["ctrl-c", "slurm"])
def test_ctrl_c_under_torchrun_saves_a_checkpoint_and_leaves_no_process(script, sent, tmp_path):
    # A terminal's Ctrl-C reaches the foreground process group: torchrun alone, which starts each
    # rank in a session of its own (its `SubprocessHandler`, pytorch/pytorch#113231) and passes the
    # signal on once. SLURM's `scancel` or time limit signals every process of the job, the ranks
    # too, and torchrun passes it on a second time: the ranks must take the two as one request
    # (`Signals.same_within`) and still save.
    arguments, steps_per_update = TORCHRUN[script.module.__name__]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), script.path, *arguments, "--total-timesteps", "10000000", "--checkpoint-every",
               "1000", "--run-dir", str(tmp_path)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        for line in process.stdout:
            if "training on" in line:
                break
            assert time.monotonic() < deadline
        time.sleep(5)
        tree = process_tree(process.pid)
        assert len(tree) >= 4  # 2 ranks and their workers
        if sent == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            for pid in [process.pid, *tree]:
                with contextlib.suppress(ProcessLookupError):  # one that has just ended
                    os.kill(pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    # (torchrun itself ends with a traceback of the signal it received; the ranks print none.)
    assert "stopped at update" in output and "aborted" not in output and f'{script.name}", line' not in output, output
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] >= 1 and checkpoint["global_step"] == checkpoint["update"] * steps_per_update
    time.sleep(1)
    assert living(tree) == []
