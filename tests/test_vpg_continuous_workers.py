"""The `Workers` of vpg_continuous.py: the same envs as in-process, loud failures, nothing left behind."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

import vpg_continuous as vpg
from conftest import ROOT
from processes import deadline, living
from vpg_continuous_helpers import InProcessEnvs


class FailsOnLargeActions(gym.Env):
    """A task that raises inside `step` when its action exceeds 0.5: a bug in somebody's env."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,))
    action_space = gym.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        if action[0] > 0.5:
            raise ValueError(f"action {action[0]} is too large for this env")
        return np.zeros(3, np.float32), 0.0, False, False, {}


# Registered in this process; forked workers inherit the registry.
gym.register("FailsOnLargeActions-v0", entry_point=FailsOnLargeActions, max_episode_steps=100)


@pytest.mark.parametrize("env_id, max_episode_steps, action_scale, start_method", [
    ("Pendulum-v1", 50, 2.0, "fork"),           # never terminates: truncations only
    ("InvertedPendulum-v5", 20, 0.3, "spawn"),  # falls (terminations) or reaches the cap (truncations)
])
def test_workers_match_in_process_envs(env_id, max_episode_steps, action_scale, start_method):
    num_envs, seed = 5, 3
    reference = InProcessEnvs(env_id, num_envs, seed, max_episode_steps)
    spaces = vpg.describe_env(env_id)
    rng = np.random.default_rng(0)
    ends = {"terminated": 0, "truncated": 0}
    with deadline(120), vpg.Workers(env_id, num_envs, 2, seed, spaces, max_episode_steps, start_method) as workers:
        np.testing.assert_array_equal(workers.reset(), reference.reset())
        for _ in range(120):
            actions = rng.uniform(-action_scale, action_scale, (num_envs, spaces.action_dim))
            step = workers.step(actions)
            expected = reference.step(actions)
            np.testing.assert_array_equal(step.obs, expected.obs)
            np.testing.assert_array_equal(step.rewards, expected.rewards)
            np.testing.assert_array_equal(step.terminated, expected.terminated)
            np.testing.assert_array_equal(step.truncated, expected.truncated)
            np.testing.assert_array_equal(step.final_obs[step.truncated], expected.final_obs[expected.truncated])
            assert step.finished_episodes == expected.finished_episodes
            ends["terminated"] += step.terminated.sum()
            ends["truncated"] += step.truncated.sum()
    reference.close()
    assert ends["truncated"] > 0
    assert (ends["terminated"] > 0) == (env_id == "InvertedPendulum-v5")


def test_an_exception_in_a_worker_arrives_with_its_traceback():
    spaces = vpg.describe_env("FailsOnLargeActions-v0")
    with deadline(60), vpg.Workers("FailsOnLargeActions-v0", 2, 2, 0, spaces, start_method="fork") as workers:
        workers.reset()
        workers.step(np.array([[0.0], [0.0]]))
        with pytest.raises(vpg.WorkerError) as error:
            workers.step(np.array([[0.0], [0.75]]))
    message = str(error.value)
    assert "worker 1 failed" in message
    assert "Traceback (most recent call last)" in message and "ValueError: action 0.75 is too large" in message
    assert "in step" in message  # frames from the worker's own stack


def test_a_killed_worker_is_an_error_not_a_hang():
    spaces = vpg.describe_env("Pendulum-v1")
    with deadline(60), vpg.Workers("Pendulum-v1", 4, 2, 0, spaces) as workers:
        workers.reset()
        os.kill(workers.processes[1].pid, signal.SIGKILL)
        with pytest.raises(vpg.WorkerError, match=r"worker 1 \(pid \d+\) died unexpectedly \(killed by signal SIGKILL\)"):
            for _ in range(10):
                workers.step(np.zeros((4, 1)))


def test_close_leaves_no_process():
    workers = vpg.Workers("Pendulum-v1", 4, 2, 0, vpg.describe_env("Pendulum-v1"))
    workers.reset()
    pids = [p.pid for p in workers.processes]
    assert living(pids) == pids
    workers.close()
    assert living(pids) == [] and mp.active_children() == []
    workers.close()  # closing twice is harmless


def test_workers_leave_the_signals_that_stop_a_run_to_the_main_process():
    # `kill -- -PGID`, a terminal's hang-up and SLURM's `scancel` signal every process of a run. A worker
    # that heard them died of them (spawned) or raised in the main process's handler it inherited (forked).
    with deadline(60), vpg.Workers("Pendulum-v1", 2, 2, 0, vpg.describe_env("Pendulum-v1")) as workers:
        workers.reset()
        for process in workers.processes:
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                os.kill(process.pid, signum)
        time.sleep(0.2)
        for _ in range(5):
            workers.step(np.zeros((2, 1)))


class Heard(Exception):
    """What the tests' handler of Ctrl-C raises in the main process."""


def test_a_ctrl_c_while_the_workers_start_is_heard_and_leaves_no_worker(monkeypatch):
    # Ignored while the workers started, a Ctrl-C then was lost, and the run trained on. Now it is held back
    # until they have started. It is sent to this thread, the one a run has: sent to the process, it
    # could be taken by another thread of pytest-xdist's and, on a busy machine, be run here only
    # after the workers had started (once in about 30 runs of the suite).
    started, real_start = [], mp.process.BaseProcess.start

    def start_then_press_ctrl_c(process):
        real_start(process)
        started.append(process)
        if len(started) == 1:  # once: a second press, heard as the first one's closing runs, would cut it short
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    def hear(signum, frame):
        raise Heard(signum)

    monkeypatch.setattr(mp.process.BaseProcess, "start", start_then_press_ctrl_c)
    previous = signal.signal(signal.SIGINT, hear)
    try:
        with deadline(60), pytest.raises(Heard):
            vpg.Workers("Pendulum-v1", 4, 2, 0, vpg.describe_env("Pendulum-v1"))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert started and living([process.pid for process in started]) == []


def test_workers_exit_when_the_main_process_is_killed():
    # A main process that dies without closing its workers (SIGKILL, the OOM killer) must not
    # leave them behind: each worker watches its parent and exits when it is gone.
    program = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import vpg_continuous as vpg
        workers = vpg.Workers("Pendulum-v1", 4, 2, 0, vpg.describe_env("Pendulum-v1"))
        workers.reset()
        print(*[p.pid for p in workers.processes], flush=True)
        time.sleep(60)
    """)
    main = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in main.stdout.readline().split()]
        assert len(pids) == 2 and living(pids) == pids
        main.kill()
        main.wait()
        for _ in range(100):
            if not living(pids):
                break
            time.sleep(0.1)
        assert living(pids) == []
    finally:
        main.kill()


def test_envs_get_distinct_seeds_and_a_resumed_run_new_ones():
    seeds = vpg.env_seeds(1, 16)
    assert len(set(seeds.tolist())) == 16
    assert not np.array_equal(seeds, vpg.env_seeds(2, 16))
    np.testing.assert_array_equal(seeds[:4], vpg.env_seeds(1, 4))
    assert not set(vpg.env_seeds(1, 16, first_update=40).tolist()) & set(seeds.tolist())
