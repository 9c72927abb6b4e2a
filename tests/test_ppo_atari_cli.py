"""ppo_atari.py through its command line, as a user runs it. What the command lines of both PyTorch
scripts do alike is tested once, in `test_torch_scripts_cli.py`."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ppo_atari
from conftest import ROOT
from torch_scripts import PPO_ATARI
from videos import assert_plays

SCRIPT = str(ROOT / "ppo_atari.py")
TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
        "charts/clip_range", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
        "losses/clipfrac", "losses/explained_variance"]


def run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4,096-step Breakout run: four updates of 8 games x 128 steps, checkpoints every two."""
    run_dir = tmp_path_factory.mktemp("runs") / "breakout"
    result = run("--env", "Breakout", "--total-timesteps", 4096, "--seed", 3, "--checkpoint-every", 2,
                 "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_training_leaves_tensorboard_tags_and_a_checkpoint(trained):
    run_dir, result = trained
    logged = scalars(run_dir)
    for tag in TAGS:
        assert tag in logged, tag
    # Each term of the loss under CleanRL's names, and not their weighted sum, which CleanRL does not log.
    assert {tag for tag in logged if tag.startswith("losses/")} == {tag for tag in TAGS if tag.startswith("losses/")}
    assert [step for step, _ in logged["losses/policy_loss"]] == [1024, 2048, 3072, 4096]
    # Real scores of whole games, not clipped per-life rewards: Breakout games last over 100 steps.
    assert all(length > 100 for _, length in logged["charts/episodic_length"])
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert "hyperparameters/text_summary" in events.Tags()["tensors"]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] == 4 and checkpoint["global_step"] == 4096 and checkpoint["game"] == "breakout"
    assert checkpoint["config"]["seed"] == 3
    assert not list(run_dir.glob("*.tmp"))
    assert "step 4,096/4,096" in result.stderr and "SPS" in result.stderr


def test_each_update_splits_its_time_into_games_inference_and_update(trained):
    # perf/<phase>_seconds: the seconds an update spent waiting for the games, choosing actions (with
    # the rollout's copies) and learning. Three parts of the time between two updates' events, none
    # counted twice: their sum is less than that time, which also holds the logging and checkpoints.
    events = EventAccumulator(str(trained[0]))
    events.Reload()
    phases = {phase: events.Scalars(f"perf/{phase}_seconds") for phase in ("env", "inference", "update")}
    logged = [event.wall_time for event in phases["update"]]
    assert len(logged) == 4
    for update in range(1, 4):
        seconds = [phases[phase][update].value for phase in phases]
        assert min(seconds) > 0 and sum(seconds) < logged[update] - logged[update - 1], seconds


def test_same_seed_same_losses(trained, tmp_path):
    run_dir, _ = trained
    result = run("--env", "Breakout", "--total-timesteps", 4096, "--seed", 3, "--run-dir", tmp_path / "again")
    assert result.returncode == 0, result.stderr
    first, second = scalars(run_dir), scalars(tmp_path / "again")
    for tag in ["losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
                "charts/episodic_return"]:
        assert first[tag] == second[tag], tag


def test_resume_continues_on_schedule(trained, tmp_path):
    run_dir, _ = trained
    resumed_dir = tmp_path / "resumed"
    # Extending the run: the checkpoint's hyperparameters, with a longer budget from the command line.
    result = run("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 6144, "--run-dir", resumed_dir)
    assert result.returncode == 0, result.stderr
    logged = scalars(resumed_dir)
    rates = dict(logged["charts/learning_rate"])
    assert sorted(rates) == [5120, 6144]  # updates 5 and 6 of 6
    assert rates[5120] == pytest.approx(2.5e-4 * (1 - 4 / 6))
    assert rates[6144] == pytest.approx(2.5e-4 * (1 - 5 / 6))
    assert dict(logged["charts/clip_range"])[6144] == pytest.approx(0.1 * (1 - 5 / 6))
    checkpoint = torch.load(resumed_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] == 6 and checkpoint["config"]["total_timesteps"] == 6144
    assert f"resumed at step 4,096 (update 4) from {run_dir / 'checkpoint.pt'}" in result.stderr
    # The progress line's recent scores go on from the first run's: its last 20 games, then the new ones.
    first_scores = [score for _, score in scalars(run_dir)["charts/episodic_return"]]
    new_scores = [score for _, score in logged.get("charts/episodic_return", [])]
    assert len(first_scores) > 0
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["recent_scores"] == first_scores[-20:]
    assert checkpoint["recent_scores"] == (first_scores + new_scores)[-20:]


def test_a_resumed_run_plays_new_games(trained, tmp_path, monkeypatch, capsys):
    # The games restart on resume (their emulator state is not saved); from new seeds, so that a job
    # resumed many times does not open each stretch of its training with the same games.
    seeds, make_env = [], ppo_atari.make_env

    def recording(env_id, seed, options, **kwargs):  # in this process, the game that probes the games' shape
        seeds.append(int(seed))
        return make_env(env_id, seed, options, **kwargs)

    monkeypatch.setattr(ppo_atari, "make_env", recording)
    status, _, err = PPO_ATARI.run_main(capsys, "--resume", trained[0] / "checkpoint.pt", "--total-timesteps", 5120,
                                        "--run-dir", tmp_path)
    assert status == 0, err
    assert seeds == [ppo_atari.game_seeds(3, 1, first_update=4)[0]]
    assert seeds[0] not in ppo_atari.game_seeds(3, 8)


def test_a_checkpoint_without_recent_scores_still_resumes(trained, tmp_path):
    run_dir, _ = trained
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    del checkpoint["recent_scores"]  # as written before the scores were kept
    torch.save(checkpoint, tmp_path / "old.pt")
    result = run("--resume", tmp_path / "old.pt", "--total-timesteps", 5120, "--run-dir", tmp_path / "resumed")
    assert result.returncode == 0, result.stderr
    assert "resumed at step 4,096 (update 4)" in result.stderr
    new_scores = [score for _, score in scalars(tmp_path / "resumed").get("charts/episodic_return", [])]
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["recent_scores"] == new_scores[-20:]


INVOCATION_DEFAULTS = PPO_ATARI.invocation


def test_a_checkpoint_resumes_with_its_hyperparameters_and_this_invocations_settings(trained, tmp_path):
    # A checkpoint holds every field in one dict, as when `Config` held them all; the settings of
    # the invocation that wrote it stay with that invocation.
    checkpoint = torch.load(trained[0] / "checkpoint.pt", weights_only=True)
    checkpoint["config"].update(learning_rate=1e-3, num_workers=3, device="cpu", precision="bf16", start_method="spawn",
                                run_dir=str(tmp_path / "elsewhere"), checkpoint_every=7, eval="other.pt",
                                eval_episodes=3, capture_video=True, track=True, wandb_project_name="other",
                                wandb_entity="someone")
    torch.save(checkpoint, tmp_path / "old.pt")
    config, _ = ppo_atari.parse_config(["--resume", str(tmp_path / "old.pt"), "--checkpoint-every", "5"])
    assert config.learning_rate == 1e-3 and config.seed == 3 and config.total_timesteps == 4096
    this_invocation = {**INVOCATION_DEFAULTS, "resume": str(tmp_path / "old.pt"), "checkpoint_every": 5}
    assert {name: getattr(config, name) for name in INVOCATION_DEFAULTS} == this_invocation


def test_eval_plays_whole_games_and_writes_videos(trained, tmp_path):
    run_dir, _ = trained
    # Short games and a time limit that a machine twice as slow, or twice as busy, still meets.
    result = run("--eval", run_dir / "checkpoint.pt", "--eval-episodes", 2, "--max-episode-frames", 600,
                 "--capture-video", "--run-dir", tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "ALE/Breakout-v5: 2 games, score" in result.stdout and "±" in result.stdout
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 2
    assert assert_plays(videos[0], 320, 420) > 10
    with av.open(str(videos[0])) as video:  # in real time: the emulator's 60 frames a second over the frame skip
        assert video.streams.video[0].average_rate == 15


def test_eval_reports_each_games_whole_score_from_games_unlike_the_training_ones(trained, monkeypatch, capsys):
    seeds, actions = [], []

    class ThreeSteps:
        """Breakout's shape: a game of three steps that scores 2 points, none in its last step."""

        n_actions = 4

        def __init__(self, env_id, seed, options):
            self.obs = np.zeros(ppo_atari.Game.observation_shape, np.uint8)
            seeds.append(int(seed))

        def reset(self):
            self.steps = 0
            return self.obs

        def step(self, action):
            actions.append(int(action))
            self.steps += 1
            over = self.steps == 3
            return ppo_atari.Transition(reward=float(not over), terminated=over, truncated=False, game_over=over,
                                        score=float(min(self.steps, 2)), length=4 * self.steps)

        def close(self):
            pass

    monkeypatch.setattr(ppo_atari, "make_env", ThreeSteps)
    status, out, err = PPO_ATARI.run_main(capsys, "--eval", trained[0] / "checkpoint.pt", "--eval-episodes", 3)
    assert status == 0 and out.startswith("ALE/Breakout-v5: 3 games, score 2.0 ± 0.0 (min 2, max 2)"), err
    assert set(seeds[1:]).isdisjoint(ppo_atari.game_seeds(3, 1000).tolist())  # after the probe of the network's shape
    # The policy samples its actions, from draws seeded by --seed: an evaluation can be played again.
    first = actions[:]
    assert PPO_ATARI.run_main(capsys, "--eval", trained[0] / "checkpoint.pt", "--eval-episodes", 3)[0] == 0
    assert len(first) == 9 and actions == first + first


def test_sigterm_ends_an_evaluation_and_deletes_its_unfinished_videos(trained, monkeypatch, capsys, tmp_path):
    # SIGTERM ended the process outright, leaving the hidden files of the videos being written. The videos
    # here are empty files: x264's and OpenCV's threads, once started in this process, would break the
    # workers that a later test of it forks.
    class EmptyVideo:
        def __init__(self, path, fps):
            self.path = path
            path.write_bytes(b"")

        def write(self, frame):
            pass

        def close(self):
            pass

    step, steps = ppo_atari.RecordedGame.step, []

    def step_then_sigterm(game, action):
        steps.append(game.name)
        if len(steps) == 20:
            assert sorted(path.name for path in (tmp_path / "videos").iterdir()) == [
                ".eval-Breakout-game00.mp4", ".eval-Breakout-game01.mp4"]
            os.kill(os.getpid(), signal.SIGTERM)
        return step(game, action)

    monkeypatch.setattr(ppo_atari, "Video", EmptyVideo)
    monkeypatch.setattr(ppo_atari, "video_frame", lambda game: None)
    monkeypatch.setattr(ppo_atari.RecordedGame, "step", step_then_sigterm)
    status, _, err = PPO_ATARI.run_main(capsys, "--eval", trained[0] / "checkpoint.pt", "--eval-episodes", 2,
                                        "--capture-video", "--run-dir", tmp_path)
    assert status == 143 and err.strip() == "ppo_atari.py: interrupted", err
    assert len(steps) == 20 and not list((tmp_path / "videos").iterdir())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # given back


@pytest.mark.parametrize("args, message", [
    (["--env", "Breakot"], "unknown Atari game 'Breakot'; did you mean Breakout"),
    (["--num-minibatches", "3"], "does not split into 3 minibatches"),
    (["--num-steps", "-5"], "--num-steps must be positive"),
    (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
    # One update, so that a rule no longer kept ends here as a short run rather than a run of 10M steps.
    (["--target-kl", "0", "--total-timesteps", "1024"], "--target-kl must be positive, not 0.0"),
    (["--seed", "4294967296", "--total-timesteps", "1024"], "--seed must be in [0, 2**32 - 1]"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number in float32's range (to 3.4e38), not nan"),
    (["--clip-range", "1e39"], "--clip-range must be a finite number in float32's range (to 3.4e38), not 1e+39"),
    (["--frame-skip", "100000"], "--max-episode-frames 108000 leaves no room to play after 30 no-ops and two steps "
                                 "of --frame-skip 100000"),  # it named --max-episode-frames alone
    (["--max-episode-frames", "2147483648"], "--max-episode-frames must be at most 2**31 - 1"),  # a worker's traceback
    (["--total-timesteps", "lots"], "invalid integer value: 'lots'"),
    (["--total-timesteps", "100"], "less than one batch"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--eval", "missing.pt"], "checkpoint missing.pt does not exist"),
    (["--resume", "."], "checkpoint . is not a file"),
    (["--eval", ""], "checkpoint '' is not a file"),
    (["--eval", "a.pt", "--resume", "b.pt"], "cannot be used together"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    status, _, stderr = PPO_ATARI.run_main(capsys, *args)  # in this process: the program's own is below
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("ppo_atari.py: error:"), stderr


@pytest.mark.parametrize("args", [["--env", "Breakot"], ["--no-such-flag"]])
def test_bad_input_to_the_program_is_one_line_and_status_2(args):
    # The same as a user meets it: a process of its own, a mistake of ours and one of argparse's.
    result = run(*args, timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("ppo_atari.py: error:") and "Traceback" not in result.stderr


def one_line_error(result, message):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_damaged_and_foreign_checkpoints_exit_2(trained, tmp_path, capsys):
    run_dir, _ = trained
    status, _, stderr = PPO_ATARI.run_main(capsys, "--resume", run_dir)  # the run's directory, not its checkpoint
    assert status == 2 and stderr.strip() == (f"ppo_atari.py: error: checkpoint {run_dir} is not a file; the run's "
                                              f"checkpoint in it is {run_dir / 'checkpoint.pt'}")
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes((run_dir / "checkpoint.pt").read_bytes()[:5000])
    one_line_error(run("--eval", damaged), "the file is damaged or not a checkpoint of ppo_atari.py")
    not_ours = tmp_path / "weights.pt"
    torch.save({"model": {}}, not_ours)
    one_line_error(run("--eval", not_ours), "is not a ppo_atari.py checkpoint")
    one_line_error(run("--eval", run_dir / "checkpoint.pt", "--env", "Pong"), "was trained on breakout, not pong")
    other_network = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    other_network["model"]["policy.weight"] = torch.zeros(6, 512)
    other_network["model"]["policy.bias"] = torch.zeros(6)
    torch.save(other_network, tmp_path / "other.pt")
    one_line_error(run("--eval", tmp_path / "other.pt"), "holds a different network: size mismatch for policy.weight")
    assert "\t" not in run("--eval", tmp_path / "other.pt").stderr  # torch's message indents its lines with a tab
    one_line_error(run("--resume", run_dir / "checkpoint.pt", "--num-envs", 4), "keeps its batch of 1024")
    one_line_error(run("--run-dir", run_dir), "already holds a checkpoint")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ctrl_c_on_the_gpu_saves_a_checkpoint_and_leaves_no_process(tmp_path):
    PPO_ATARI.ctrl_c_saves_a_checkpoint_and_leaves_no_process(tmp_path, "cuda")


def test_a_checkpoint_that_lacks_a_field_exits_2(trained, tmp_path):
    # Checkpoints hold one random state per rank since torchrun came; one written by an earlier
    # version of the script, without "ranks", is refused in one line rather than read half.
    checkpoint = torch.load(trained[0] / "checkpoint.pt", weights_only=True)
    del checkpoint["ranks"]
    torch.save(checkpoint, tmp_path / "old.pt")
    one_line_error(run("--resume", tmp_path / "old.pt"), "lacks ranks: another version of ppo_atari.py wrote it")


def test_a_second_signal_aborts_one_process_at_once():
    # One process hears a Ctrl-C once: a second one, however soon, aborts. Only the ranks of a
    # torchrun run, which hear each Ctrl-C twice, take two within a second as one.
    for same_within, aborts in [(0.0, True), (1.0, False)]:
        with ppo_atari.Signals(announce=False, same_within=same_within) as signals:
            signals.training = True
            os.kill(os.getpid(), signal.SIGINT)
            assert signals.requested == signal.SIGINT
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                aborted = False
            except KeyboardInterrupt:
                aborted = True
        assert aborted == aborts


def test_a_run_of_one_process_takes_no_second_signal_as_the_first(tmp_path, monkeypatch, capsys):
    chosen = []

    class Recorded(ppo_atari.Signals):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            chosen.append(self.same_within)

    monkeypatch.setattr(ppo_atari, "Signals", Recorded)
    status = ppo_atari.main(["--total-timesteps", "128", "--num-envs", "2", "--num-steps", "64",
                             "--run-dir", str(tmp_path)])
    assert status == 0 and chosen == [0.0]
