"""The `Workers` of ppo_atari.py: the same games as in-process, loud failures, nothing left behind."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ppo_atari
from conftest import ROOT
from processes import deadline, living

# A small frame cap, so that games are truncated within the test and `final_obs` is exercised.
OPTIONS = dict(sticky_actions=0.0, life_loss=True, noop_max=30, frame_skip=4, max_episode_frames=600)


class InProcessGames:
    """The reference: the same games with the same seeds, stepped one after the other here."""

    def __init__(self, env_id, num_envs, seed):
        self.games = [ppo_atari.Game(env_id, s, **OPTIONS) for s in ppo_atari.game_seeds(seed, num_envs)]

    def reset(self):
        return np.stack([game.reset().copy() for game in self.games])

    def step(self, actions):
        rows = []
        for env, (game, action) in enumerate(zip(self.games, actions)):
            step = game.step(int(action))
            final = game.obs.copy()
            if step.game_over:
                game.reset()
            rows.append((step, final, game.obs.copy()))
        return rows


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_match_in_process_games(breakout_id, start_method):
    num_envs, seed = 5, 3
    reference = InProcessGames(breakout_id, num_envs, seed)
    rng = np.random.default_rng(0)
    ends = truncations = 0
    with deadline(120), ppo_atari.Workers(breakout_id, num_envs, 2, seed, OPTIONS, start_method) as workers:
        assert workers.n_actions == 4
        np.testing.assert_array_equal(workers.reset(), reference.reset())
        for _ in range(400):
            actions = rng.integers(0, workers.n_actions, num_envs)
            step = workers.step(actions)
            expected = reference.step(actions)
            np.testing.assert_array_equal(step.obs, np.stack([obs for _, _, obs in expected]))
            np.testing.assert_array_equal(step.rewards, [s.reward for s, _, _ in expected])
            np.testing.assert_array_equal(step.terminated, [s.terminated for s, _, _ in expected])
            np.testing.assert_array_equal(step.truncated, [s.truncated for s, _, _ in expected])
            for env, (s, final, _) in enumerate(expected):
                if s.truncated:
                    np.testing.assert_array_equal(step.final_obs[env], final)
            assert step.finished_games == [(env, s.score, s.length) for env, (s, _, _) in enumerate(expected)
                                           if s.game_over]
            ends += len(step.finished_games)
            truncations += step.truncated.sum()
    assert ends > 0 and truncations > 0  # both kinds of game end were compared


def test_an_exception_in_a_worker_arrives_with_its_traceback(breakout_id):
    with deadline(60), ppo_atari.Workers(breakout_id, 2, 2, 0, OPTIONS) as workers:
        workers.reset()
        with pytest.raises(ppo_atari.WorkerError) as error:
            workers.step(np.array([0, 99]))  # Breakout has 4 actions
    message = str(error.value)
    assert "worker 1 failed" in message
    assert "Traceback (most recent call last)" in message and "IndexError" in message
    assert "in step" in message  # the frame of Game.step, from the worker's own stack


def test_a_killed_worker_is_an_error_not_a_hang(breakout_id):
    with deadline(60), ppo_atari.Workers(breakout_id, 4, 2, 0, OPTIONS) as workers:
        workers.reset()
        os.kill(workers.processes[1].pid, signal.SIGKILL)
        with pytest.raises(ppo_atari.WorkerError, match=r"worker 1 \(pid \d+\) died unexpectedly \(killed by signal SIGKILL\)"):
            for _ in range(10):
                workers.step(np.zeros(4, np.int64))


def test_close_leaves_no_process(breakout_id):
    workers = ppo_atari.Workers(breakout_id, 4, 2, 0, OPTIONS)
    workers.reset()
    pids = [p.pid for p in workers.processes]
    assert living(pids) == pids
    workers.close()
    assert living(pids) == [] and mp.active_children() == []
    workers.close()  # closing twice is harmless


def test_workers_leave_the_signals_that_stop_a_run_to_the_main_process(breakout_id):
    # `kill -- -PGID`, a terminal's hang-up and SLURM's `scancel` signal every process of a run. A worker
    # that heard them died of them (spawned) or raised in the main process's handler it inherited (forked).
    with deadline(60), ppo_atari.Workers(breakout_id, 2, 2, 0, OPTIONS) as workers:
        workers.reset()
        for process in workers.processes:
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                os.kill(process.pid, signum)
        time.sleep(0.2)
        for _ in range(5):
            workers.step(np.zeros(2, np.int64))


class Heard(Exception):
    """What the tests' handler of Ctrl-C raises in the main process."""


def test_a_ctrl_c_while_the_workers_start_is_heard_and_leaves_no_worker(breakout_id, monkeypatch):
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
            ppo_atari.Workers(breakout_id, 4, 2, 0, OPTIONS)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert started and living([process.pid for process in started]) == []


def test_workers_exit_when_the_main_process_is_killed(breakout_id):
    # A main process that dies without closing its workers (SIGKILL, the OOM killer) must not
    # leave them behind: each worker watches its parent and exits when it is gone.
    program = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import numpy as np, ppo_atari
        workers = ppo_atari.Workers({breakout_id!r}, 4, 2, 0, {OPTIONS!r})
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


def test_games_get_distinct_seeds():
    seeds = ppo_atari.game_seeds(1, 16)
    assert len(set(seeds.tolist())) == 16
    assert not np.array_equal(seeds, ppo_atari.game_seeds(2, 16))
    np.testing.assert_array_equal(seeds[:4], ppo_atari.game_seeds(1, 4))
    assert not set(ppo_atari.game_seeds(1, 16, first_update=40).tolist()) & set(seeds.tolist())
