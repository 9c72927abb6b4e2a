"""`--capture-video` while training (ppo_atari.py and vpg_continuous.py): whole games or episodes of
the run's first env, on CleanRL's schedule, as H.264 mp4s in the run directory, each one whole
before it appears, and sent once to Weights & Biases with `--track`."""

import errno
import subprocess
import sys

import numpy as np
import pytest

import ppo_atari
import vpg_continuous as vpg
from conftest import ROOT
from processes import in_a_fresh_process
from videos import assert_plays, h264_frames

CUBES = [0, 1, 8, 27, 64, 125, 216, 343, 512, 729, 1000, 2000, 3000]


@pytest.mark.parametrize("records", [ppo_atari.records_game, vpg.records_episode], ids=["ppo_atari", "vpg"])
def test_the_schedule_is_the_cubes_to_1000_then_every_1000th(records):
    assert [index for index in range(3001) if records(index)] == CUBES


@in_a_fresh_process
def test_a_recorded_game_appears_whole_when_it_ends_and_only_the_scheduled_ones(tmp_path):
    options = {**ppo_atari.game_options(ppo_atari.Config()), "max_episode_frames": 200}
    game = ppo_atari.RecordedGame(ppo_atari.make_env("ALE/Breakout-v5", 3, options), tmp_path, "train-x-game{:04d}.mp4", 15)
    rng = np.random.default_rng(0)
    lengths, videos = [], ["train-x-game0000.mp4", "train-x-game0001.mp4"]
    for index in range(3):
        game.reset()
        steps = 0
        while True:
            step = game.step(int(rng.integers(game.n_actions)))
            steps += 1
            if step.game_over:
                break
            # While a game is played, its video is at most a hidden, unfinished file; those before it are whole.
            shown = sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith("."))
            assert shown == videos[:index]
        lengths.append(steps)
    assert sorted(path.name for path in tmp_path.iterdir()) == videos  # game 2 is not on the schedule
    for name, steps in zip(videos, lengths):
        # The first screen and one per step, in colour at twice the ALE's 160 x 210.
        assert h264_frames(tmp_path / name) == ("h264", "yuv420p", 320, 420, steps + 1)


def run(script: str, *args) -> None:
    """The script from the command line: a fresh process, so that its workers are forked from one
    that has started no threads (this one's OpenCV and x264 have)."""
    result = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_ppo_atari_records_its_first_game_while_training_and_a_resumed_run_adds_its_own(tmp_path):
    run("ppo_atari.py", "--env", "Breakout", "--total-timesteps", 256, "--num-envs", 2, "--num-steps", 64,
        "--num-workers", 1, "--max-episode-frames", 200, "--capture-video", "--run-dir", tmp_path)
    # The first game slot played 128 steps of games of at most 50: games 0 and 1 recorded, 2 not.
    videos = sorted((tmp_path / "videos").iterdir())
    first = ["train-Breakout-from-update0-game0000.mp4", "train-Breakout-from-update0-game0001.mp4"]
    assert [path.name for path in videos] == first
    assert assert_plays(videos[0], 320, 420) > 10
    run("ppo_atari.py", "--resume", tmp_path / "checkpoint.pt", "--total-timesteps", 512, "--max-episode-frames", 320,
        "--capture-video")
    # Resumed at update 2 for 128 steps of the first slot, its games numbered from 0 again: game 0 whole
    # (at most 80 steps), under a name of its own beside the first run's; game 1 cut short by the end
    # after more than the 41 steps x264 holds back before it writes a file, and no file of it left
    # (pathlib's `*` matches hidden names too).
    assert sorted(path.name for path in (tmp_path / "videos").glob("*.mp4")) == first + [
        "train-Breakout-from-update2-game0000.mp4"]


def test_vpg_records_its_first_env_while_training_and_a_resumed_run_adds_its_own(tmp_path):
    common = ["--env", "Pendulum-v1", "--num-envs", "2", "--num-steps", "128", "--num-workers", "1",
              "--capture-video"]
    run("vpg_continuous.py", *common, "--total-timesteps", 1024, "--run-dir", tmp_path)
    # The first env played 512 steps: episodes 0 to 1 of 200 steps recorded, 2 not, the third cut short.
    names = sorted(path.name for path in (tmp_path / "videos").iterdir())
    assert names == ["train-Pendulum-from-update0-episode0000.mp4", "train-Pendulum-from-update0-episode0001.mp4"]
    assert h264_frames(tmp_path / "videos" / names[0]) == ("h264", "yuv420p", 500, 500, 201)
    run("vpg_continuous.py", "--resume", tmp_path / "checkpoint.pt", "--total-timesteps", 1536, "--capture-video")
    # Resumed at update 4 for 256 steps of the first env: its episode 0 whole, episode 1 cut short.
    names = sorted(path.name for path in (tmp_path / "videos").iterdir())
    assert names == ["train-Pendulum-from-update0-episode0000.mp4", "train-Pendulum-from-update0-episode0001.mp4",
                     "train-Pendulum-from-update4-episode0000.mp4"]


@in_a_fresh_process
@pytest.mark.parametrize("close_fails", [False, True], ids=["closes", "close-fails"])
@pytest.mark.parametrize("script", ["ppo_atari", "vpg"])
def test_an_episode_cut_short_by_the_end_of_the_run_leaves_no_file(script, close_fails, tmp_path):
    if script == "ppo_atari":
        env = ppo_atari.RecordedGame(ppo_atari.make_env("ALE/Breakout-v5", 3, ppo_atari.game_options(ppo_atari.Config())),
                                     tmp_path, "train-x-game{:04d}.mp4", 15)
        action = 0
    else:
        env, action = vpg.RecordedTask("Pendulum-v1", 1, None, None, tmp_path, "train-x-episode{:04d}.mp4"), np.zeros(1)
    env.reset()
    steps = 0
    while not list(tmp_path.iterdir()):  # x264 holds its first frames back before the file is written
        env.step(action)
        steps += 1
    assert steps < 150 and [path.name for path in tmp_path.iterdir()] == [".train-x-game0000.mp4" if script == "ppo_atari"
                                                          else ".train-x-episode0000.mp4"]
    if close_fails:  # on a full disk, say: the file was left behind
        def close():
            raise OSError(errno.ENOSPC, "No space left on device")

        env.video.close = close
    env.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script", [ppo_atari, vpg], ids=["ppo_atari", "vpg"])
def test_each_whole_video_is_sent_to_wandb_once(script, tmp_path, monkeypatch):
    class FakeWandb:
        @staticmethod
        def Video(path, format):
            return ("video", path, format)

    class Tracking:
        def __init__(self):
            self.logged = []

        def log(self, data):
            self.logged.append(data)

    monkeypatch.setattr(script, "import_wandb", lambda: FakeWandb)
    sent, tracking = set(), Tracking()
    (tmp_path / "train-a-game0000.mp4").write_bytes(b"0")
    (tmp_path / ".train-a-game0001.mp4").write_bytes(b"unfinished")
    script.send_new_videos(tracking, tmp_path, sent)
    (tmp_path / "train-a-game0001.mp4").write_bytes(b"1")
    (tmp_path / "eval-a-game00.mp4").write_bytes(b"an evaluation's")
    script.send_new_videos(tracking, tmp_path, sent)
    script.send_new_videos(tracking, tmp_path, sent)
    assert tracking.logged == [{"videos": ("video", str(tmp_path / name), "mp4")}
                               for name in ["train-a-game0000.mp4", "train-a-game0001.mp4"]]

