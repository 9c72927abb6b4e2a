"""ppo_jax.py on Atari: its copies of the `Game` wrapper and the `Workers` behave as ppo_atari.py's, and
a short run through the workers trains, checkpoints, resumes and evaluates."""

import signal
import subprocess
import sys
import time

import flax.serialization
import jax
import numpy as np
import pytest

import ppo_atari
import ppo_jax
from conftest import ROOT
from processes import deadline
from ppo_jax_runs import SCRIPT, alive, children_of, environment, read_checkpoint, run, scalars  # noqa: F401 (fixtures)
from videos import assert_plays


@pytest.mark.parametrize("name, options", [
    ("Breakout", dict()),  # FIRE after each lost life, five lives, game over
    ("Breakout", dict(life_loss=False, max_episode_frames=500)),  # truncation at the frame cap
    ("Freeway", dict(noop_max=5)),  # no FIRE
    ("SpaceInvaders", dict(sticky_actions=0.25)),  # the emulator's own random repeats
])
def test_game_is_ppo_atari_game(name, options):
    env_id = ppo_jax.resolve_env(name)[0]
    assert env_id == ppo_atari.resolve_env_id(name)
    ours, theirs = ppo_jax.Game(env_id, 7, **options), ppo_atari.Game(env_id, 7, **options)
    assert ours.n_actions == theirs.n_actions and ours.fire == theirs.fire
    np.testing.assert_array_equal(ours.reset(), theirs.reset())
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(600):
        action = int(rng.integers(ours.n_actions))
        step = ours.step(action)
        assert tuple(step) == tuple(theirs.step(action))
        np.testing.assert_array_equal(ours.obs, theirs.obs)
        if step.game_over:
            ends += 1
            np.testing.assert_array_equal(ours.reset(), theirs.reset())
    np.testing.assert_array_equal(ours.render(), theirs.render())
    if name == "Breakout":
        assert ends > 0


# A small frame cap, so that games are truncated within the test and `final_obs` is compared.
OPTIONS = dict(sticky_actions=0.0, life_loss=True, noop_max=30, frame_skip=4, max_episode_frames=600)


def test_workers_are_ppo_atari_workers(breakout_id):
    # Both started by `forkserver`: this process has started JAX's threads, which a fork would copy
    # in an unknown state. (The script forks its workers before JAX starts.)
    num_envs, seed = 5, 3
    rng = np.random.default_rng(0)
    truncations = ends = 0
    with deadline(180), ppo_jax.Workers(breakout_id, num_envs, 2, seed, OPTIONS, "forkserver") as ours, \
            ppo_atari.Workers(breakout_id, num_envs, 2, seed, OPTIONS, "forkserver") as theirs:
        assert ours.n_actions == theirs.n_actions == 4
        np.testing.assert_array_equal(ours.reset(), theirs.reset())
        for _ in range(400):
            actions = rng.integers(0, 4, num_envs)
            a, b = ours.step(actions), theirs.step(actions)
            for field in ["obs", "rewards", "terminated", "truncated"]:
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
            np.testing.assert_array_equal(a.final_obs[a.truncated], b.final_obs[b.truncated])
            assert a.finished_games == b.finished_games
            truncations += a.truncated.sum()
            ends += len(a.finished_games)
    assert truncations > 0 and ends > truncations  # both kinds of game end were compared


def test_a_worker_error_arrives_with_its_traceback_and_close_leaves_no_process(breakout_id):
    with deadline(60):
        workers = ppo_jax.Workers(breakout_id, 2, 2, 0, OPTIONS, "forkserver")
        pids = [process.pid for process in workers.processes]
        workers.reset()
        with pytest.raises(ppo_jax.WorkerError) as error:
            workers.step(np.array([0, 99]))  # Breakout has 4 actions
        workers.close()
    assert "worker 1 failed" in str(error.value) and "IndexError" in str(error.value) and "in step" in str(error.value)
    assert not [pid for pid in pids if alive(pid)]


class ScriptedGames:
    """A vector env of recognisable frames whose games are truncated where the test says."""

    def __init__(self, num_envs=2, truncate_at=None, n_actions=3):
        self.num_envs, self.n_actions = num_envs, n_actions
        self.t = 0
        self.truncate_at = truncate_at or {}
        self.obs = np.zeros((num_envs, 4, 84, 84), np.uint8)
        self.final_obs = np.zeros_like(self.obs)

    def reset(self):
        self.obs[:] = 0
        return self.obs

    def step(self, actions):
        self.t += 1
        self.obs[:] = 10 * self.t  # each step's frames are filled with a number of their own
        truncated = np.zeros(self.num_envs, bool)
        finished = []
        for env, when in self.truncate_at.items():
            if self.t == when:
                truncated[env] = True
                self.final_obs[env] = 255  # the final frame, unlike any other
                finished.append((env, 0.0, when))
        return ppo_jax.VecStep(self.obs, np.ones(self.num_envs, np.float32), np.zeros(self.num_envs, bool),
                               truncated, self.final_obs, finished)


def test_a_truncated_game_bootstraps_from_its_final_observation():
    config = ppo_jax.Config(env="Breakout", num_envs=2, num_steps=6, num_minibatches=2, update_epochs=1,
                            total_timesteps=24)
    trainer = ppo_jax.AtariTrainer(config, ScriptedGames(truncate_at={1: 3}), jax.random.key(0))
    rollout = trainer.collect_rollout()
    params = trainer.agent.params

    def value(fill):
        return float(trainer.value_of(params, np.full((2, 4, 84, 84), fill, np.uint8))[0])

    # Step index 2 truncated game 1: its next value is V(final frames), not V of the frames the env
    # returned; elsewhere it is the next step's value, and after the last step V of the next frames.
    assert rollout.next_values[2, 1] == pytest.approx(value(255), rel=1e-5)
    assert rollout.next_values[2, 0] == pytest.approx(rollout.values[3, 0], rel=1e-5)
    assert rollout.next_values[-1, 0] == pytest.approx(value(60), rel=1e-5)
    assert rollout.truncated.sum() == 1 and trainer.finished_games == [(1, 0.0, 3)]
    assert [int(rollout.obs[t, 0, 0, 0, 0]) for t in range(6)] == [0, 10, 20, 30, 40, 50]
    metrics = trainer.update_policy(rollout)
    assert trainer.update == 1 and metrics["learning_rate"] == pytest.approx(2.5e-4)


# Two updates of 4 games x 64 steps; games are cut at 400 frames (about 95 agent steps), so that
# each game ends, by truncation, within the run.
SHORT = ["--env", "Breakout", "--num-envs", 4, "--num-steps", 64, "--num-minibatches", 2, "--update-epochs", 2,
         "--total-timesteps", 512, "--max-episode-frames", 400, "--checkpoint-every", 1, "--seed", 2]


@pytest.fixture(scope="module")
def trained(run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "breakout"
    result = run(*SHORT, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_a_short_breakout_run_through_the_workers(trained):
    run_dir, result = trained
    logged = scalars(run_dir)
    for tag in ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
                "charts/clip_range", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
                "losses/clipfrac", "losses/explained_variance", "perf/env_seconds", "perf/update_seconds"]:
        assert tag in logged, tag
    assert [step for step, _ in logged["losses/policy_loss"]] == [256, 512]
    assert dict(logged["charts/clip_range"])[256] == pytest.approx(0.1)  # the Atari preset
    # Whole games, cut at 400 frames, reported in frames as CleanRL reports them.
    lengths = [length for _, length in logged["charts/episodic_length"]]
    assert len(lengths) >= 4 and all(length == 400 for length in lengths)
    checkpoint = read_checkpoint(run_dir / "checkpoint.msgpack")
    assert checkpoint["update"] == 2 and checkpoint["global_step"] == 512 and checkpoint["env_id"] == "ALE/Breakout-v5"
    assert checkpoint["agent"]["params"]["params"]["policy"]["kernel"].shape == (512, 4)
    assert "4 games in" in result.stderr and "step 512/512" in result.stderr


def test_resume_and_a_foreign_game(trained, run, tmp_path):
    run_dir, _ = trained
    result = run("--resume", run_dir / "checkpoint.msgpack", "--total-timesteps", 768, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    rates = dict(scalars(tmp_path)["charts/learning_rate"])
    assert list(rates) == [768] and rates[768] == pytest.approx(2.5e-4 * (1 - 2 / 3))
    assert f"resumed at step 512 (update 2) from {run_dir / 'checkpoint.msgpack'}" in result.stderr
    # The progress line's recent scores go on from the first run's: its last 20 games, then the new ones.
    first_scores = [score for _, score in scalars(run_dir)["charts/episodic_return"]]
    new_scores = [score for _, score in scalars(tmp_path).get("charts/episodic_return", [])]
    assert list(read_checkpoint(run_dir / "checkpoint.msgpack")["recent_scores"]) == first_scores[-20:]
    assert list(read_checkpoint(tmp_path / "checkpoint.msgpack")["recent_scores"]) == (first_scores + new_scores)[-20:]
    # A checkpoint written before the scores were kept resumes with none.
    old = read_checkpoint(run_dir / "checkpoint.msgpack")
    del old["recent_scores"]
    (tmp_path / "old.msgpack").write_bytes(flax.serialization.msgpack_serialize(old))
    result = run("--resume", tmp_path / "old.msgpack", "--total-timesteps", 768, "--run-dir", tmp_path / "old")
    assert result.returncode == 0 and "resumed at step 512 (update 2)" in result.stderr, result.stderr
    assert list(read_checkpoint(tmp_path / "old" / "checkpoint.msgpack")["recent_scores"]) == new_scores[-20:]
    result = run("--eval", run_dir / "checkpoint.msgpack", "--env", "Pong")
    assert result.returncode == 2 and "was trained on breakout, not pong" in result.stderr


def test_eval_plays_whole_games_and_writes_videos(trained, run, tmp_path):
    run_dir, _ = trained
    result = run("--eval", run_dir / "checkpoint.msgpack", "--eval-episodes", 2, "--capture-video",
                 "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ALE/Breakout-v5: 2 games, score ") and "±" in result.stdout
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 2
    assert assert_plays(videos[0], 320, 420) > 10


def test_ctrl_c_saves_a_checkpoint_and_leaves_no_worker(environment, tmp_path):
    args = [*SHORT[:SHORT.index("--total-timesteps")], "--total-timesteps", "10000000", "--run-dir", str(tmp_path)]
    process = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=environment)
    try:
        for line in process.stderr:
            if "training on" in line:
                break
        workers = children_of(process.pid)
        time.sleep(3)
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, errors
    assert "stopped at update" in errors and "Traceback" not in errors
    checkpoint = read_checkpoint(tmp_path / "checkpoint.msgpack")
    assert checkpoint["global_step"] == checkpoint["update"] * 256
    assert len(workers) >= 1
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)]
