"""vpg_continuous.py through its command line, as a user runs it. What the command lines of both
PyTorch scripts do alike is tested once, in `test_torch_scripts_cli.py`."""

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import vpg_continuous as vpg
from conftest import ROOT
from torch_scripts import VPG_CONTINUOUS
from videos import assert_plays

SCRIPT = str(ROOT / "vpg_continuous.py")
TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
        "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
        "losses/explained_variance", "perf/env_seconds", "perf/inference_seconds", "perf/update_seconds"]
# A small Pendulum run: 4 envs in 2 workers, 4 updates of 1,024 steps, checkpoints every 2 updates.
PENDULUM = ["--env", "Pendulum-v1", "--total-timesteps", 4096, "--num-envs", 4, "--num-steps", 256,
            "--num-workers", 2, "--value-epochs", 2, "--num-minibatches", 4, "--seed", 3]


def run(*args, timeout=300, **environment):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **environment})


def run_main(capsys, *args) -> tuple[int, str, str]:
    """`main()` in this process: the exit status, stdout and stderr, as the command line would give them."""
    try:
        status = vpg.main([str(a) for a in args])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def one_line_error(status: int, stderr: str, message: str) -> None:
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vpg_continuous.py: error:") and message in lines[0], stderr


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "pendulum"
    result = run(*PENDULUM, "--checkpoint-every", 2, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_training_leaves_tensorboard_tags_and_a_checkpoint(trained):
    run_dir, result = trained
    logged = scalars(run_dir)
    for tag in TAGS:
        assert tag in logged, tag
    assert [step for step, _ in logged["losses/policy_loss"]] == [1024, 2048, 3072, 4096]
    # Whole episodes with their real (unscaled) returns: Pendulum is cut at 200 steps, and its
    # rewards are costs between -16.3 and 0 per step.
    lengths = [length for _, length in logged["charts/episodic_length"]]
    assert len(lengths) == 4 * 5 and set(lengths) == {200}
    assert all(-16.3 * 200 <= r < -10 for _, r in logged["charts/episodic_return"])
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert "hyperparameters/text_summary" in events.Tags()["tensors"]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["format"] == "vpg_continuous/1" and checkpoint["env_id"] == "Pendulum-v1"
    assert checkpoint["update"] == 4 and checkpoint["global_step"] == 4096 and checkpoint["config"]["seed"] == 3
    # The observation statistics saw every observation of all 4 envs from both workers: the first
    # ones after reset, then one per step.
    assert checkpoint["obs_normalizer"]["count"] == 4 + 4096
    assert checkpoint["reward_scaler"]["count"] == 4096  # a return per step (and the prior's, with --reward-prior-and-clip)
    assert not list(run_dir.glob("*.tmp"))
    assert "step 4,096/4,096" in result.stderr and "SPS" in result.stderr


def test_same_seed_same_losses(trained, tmp_path):
    run_dir, _ = trained
    result = run(*PENDULUM, "--run-dir", tmp_path / "again")
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
    rates = dict(scalars(resumed_dir)["charts/learning_rate"])
    assert sorted(rates) == [5120, 6144]  # updates 5 and 6 of 6
    assert rates[5120] == pytest.approx(1e-3 * (1 - 4 / 6))
    assert rates[6144] == pytest.approx(1e-3 * (1 - 5 / 6))
    checkpoint = torch.load(resumed_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] == 6 and checkpoint["config"]["total_timesteps"] == 6144
    # The statistics carried on from the checkpoint: its 4,100 observations, then 4 + 2,048 more.
    assert checkpoint["obs_normalizer"]["count"] == 4100 + 4 + 2048
    assert f"resumed at step 4,096 (update 4) from {run_dir / 'checkpoint.pt'}" in result.stderr
    # The progress line's recent returns go on from the first run's: its last 20 episodes, then the new ones.
    first_returns = [value for _, value in scalars(run_dir)["charts/episodic_return"]]
    new_returns = [value for _, value in scalars(resumed_dir)["charts/episodic_return"]]
    assert len(first_returns) > 0 and len(new_returns) > 0
    first_checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert first_checkpoint["recent_returns"] == pytest.approx(first_returns[-20:])
    assert checkpoint["recent_returns"] == pytest.approx((first_returns + new_returns)[-20:])


def test_a_checkpoint_without_recent_returns_still_resumes(trained, tmp_path):
    run_dir, _ = trained
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    del checkpoint["recent_returns"]  # as written before the returns were kept
    torch.save(checkpoint, tmp_path / "old.pt")
    result = run("--resume", tmp_path / "old.pt", "--total-timesteps", 5120, "--run-dir", tmp_path / "resumed")
    assert result.returncode == 0, result.stderr
    assert "resumed at step 4,096 (update 4)" in result.stderr
    new_returns = [value for _, value in scalars(tmp_path / "resumed")["charts/episodic_return"]]
    resumed = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert resumed["recent_returns"] == pytest.approx(new_returns[-20:])


INVOCATION_DEFAULTS = VPG_CONTINUOUS.invocation


def test_a_checkpoint_resumes_with_its_hyperparameters_and_this_invocations_settings(trained, tmp_path):
    # A checkpoint holds every field in one dict, as when `Config` held them all; the settings of
    # the invocation that wrote it stay with that invocation.
    checkpoint = torch.load(trained[0] / "checkpoint.pt", weights_only=True)
    checkpoint["config"].update(learning_rate=3e-3, num_workers=3, device="cpu", start_method="spawn",
                                run_dir=str(tmp_path / "elsewhere"), checkpoint_every=7, eval="other.pt",
                                eval_episodes=3, eval_deterministic=True, capture_video=True, track=True,
                                wandb_project_name="other", wandb_entity="someone")
    torch.save(checkpoint, tmp_path / "old.pt")
    config, _ = vpg.parse_config(["--resume", str(tmp_path / "old.pt"), "--checkpoint-every", "5"])
    assert config.learning_rate == 3e-3 and config.seed == 3 and config.total_timesteps == 4096
    this_invocation = {**INVOCATION_DEFAULTS, "resume": str(tmp_path / "old.pt"), "checkpoint_every": 5}
    assert {name: getattr(config, name) for name in INVOCATION_DEFAULTS} == this_invocation


def test_eval_plays_whole_episodes_and_writes_videos(trained, tmp_path):
    run_dir, _ = trained
    result = run("--eval", run_dir / "checkpoint.pt", "--eval-episodes", 2, "--max-episode-steps", 30,
                 "--capture-video", "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Pendulum-v1: 2 episodes, return" in result.stdout and "±" in result.stdout
    assert "Traceback" not in result.stderr and "ALSA" not in result.stderr
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert [video.name for video in videos] == ["eval-Pendulum-episode00.mp4", "eval-Pendulum-episode01.mp4"]
    ok, frame = cv2.VideoCapture(str(videos[0])).read()
    assert ok and frame.shape == (500, 500, 3) and frame.min() < 100 < frame.max()
    assert_plays(videos[0], 500, 500, frames=31)  # the first frame and one per step
    assert [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("episode ")] == [
        "episode 1/2", "episode 2/2"]


def test_sigterm_stops_an_evaluation_that_records_videos(trained, tmp_path):
    # pygame's SDL, as it first renders, took SIGTERM for its own: the evaluation played on to the end. Once
    # that was mended, SIGTERM ended the process outright, leaving the hidden files of the videos being written.
    process = subprocess.Popen([sys.executable, SCRIPT, *map(str, ["--eval", trained[0] / "checkpoint.pt", "--eval-episodes",
                                                                   2, "--max-episode-steps", 5000, "--capture-video",
                                                                   "--run-dir", tmp_path])], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until the videos are being written
            if len(list((tmp_path / "videos").glob(".*.mp4"))) == 2 or process.poll() is not None:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
        assert not list((tmp_path / "videos").iterdir())  # the unfinished videos' hidden files are deleted
    finally:
        process.kill()


def test_a_jax_env_trains_in_spawned_workers(tmp_path):
    # Forked after `describe_env` had started JAX's threads, its workers hung before their first step.
    result = run("--env", "phys2d/Pendulum-v0", "--total-timesteps", 128, "--num-envs", 2, "--num-steps", 64,
                 "--num-minibatches", 2, "--value-epochs", 1, "--run-dir", tmp_path, timeout=120)
    assert result.returncode == 0 and "done: 128 steps" in result.stderr, result.stderr


def test_the_default_mujoco_env_trains_evaluates_and_records(tmp_path):
    # HalfCheetah-v5, the default, with its defaults but for a shorter run and episodes cut at
    # 250 steps: each of the 8 envs finishes two episodes in its 512 steps.
    result = run("--total-timesteps", 4096, "--max-episode-steps", 250, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "HalfCheetah-v5: training on cpu, 8 envs" in result.stderr
    assert [length for _, length in scalars(tmp_path)["charts/episodic_length"]] == [250] * 16
    checkpoint = tmp_path / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=True)["env_id"] == "HalfCheetah-v5"
    result = run("--eval", checkpoint, "--eval-episodes", 2, "--max-episode-steps", 10, "--capture-video")
    if result.returncode == 0:
        assert "HalfCheetah-v5: 2 episodes, return" in result.stdout
        assert_plays(tmp_path / "videos" / "eval-HalfCheetah-episode00.mp4", 480, 480, frames=11)
    else:  # a machine with no OpenGL MuJoCo can use: one line that says what to install
        one_line_error(result.returncode, result.stderr, "install")


def test_a_mujoco_gl_that_cannot_render_is_one_line(trained, tmp_path):
    # The platform is chosen before MuJoCo is imported, so the check comes before the checkpoint's
    # networks are looked at; a checkpoint that names HalfCheetah-v5 is enough.
    run_dir, _ = trained
    torch.save({**torch.load(run_dir / "checkpoint.pt", weights_only=True), "env_id": "HalfCheetah-v5"},
               tmp_path / "cheetah.pt")
    result = run("--eval", tmp_path / "cheetah.pt", "--env", "HalfCheetah-v5", "--capture-video", MUJOCO_GL="nonsense")
    one_line_error(result.returncode, result.stderr, "MUJOCO_GL=nonsense is none of egl, osmesa, glfw")


def test_no_opengl_at_all_names_what_to_install(monkeypatch):
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    monkeypatch.setattr(vpg.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(args, 1))
    with pytest.raises(vpg.ConfigError, match="apt install libegl1 .* apt install libosmesa6"):
        vpg.choose_mujoco_gl("HalfCheetah-v5")


@pytest.mark.parametrize("args, message", [
    (["--env", "HalfCheeta-v5"], "unknown environment 'HalfCheeta-v5'; did you mean HalfCheetah-v5"),
    (["--env", "CartPole-v1"], "CartPole-v1 has Discrete actions"),
    (["--num-minibatches", "3"], "does not split into 3 minibatches"),
    (["--num-steps", "-5"], "--num-steps must be positive"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number in float32's range (to 3.4e38), not nan"),
    (["--max-grad-norm", "1e39"], "--max-grad-norm must be a finite number in float32's range (to 3.4e38), not 1e+39"),
    (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
    (["--max-episode-steps", "0"], "--max-episode-steps must be positive"),
    (["--total-timesteps", "lots"], "invalid integer value: 'lots'"),
    (["--total-timesteps", "100"], "less than one batch"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--eval", "missing.pt"], "checkpoint missing.pt does not exist"),
    (["--resume", "."], "checkpoint . is not a file"),
    (["--resume", ""], "checkpoint '' is not a file"),  # it was a traceback, then a double space
    (["--eval", "a.pt", "--resume", "b.pt"], "cannot be used together"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    status, _, stderr = run_main(capsys, *args)
    one_line_error(status, stderr, message)


class ImageTask(gym.Env):
    """A task this script cannot learn: its observations are images."""
    observation_space = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


class MatrixActionTask(gym.Env):
    """A task this script cannot learn: its actions are a matrix."""
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2, 2), np.float32)


def unmakeable_task(**kwargs):
    raise ImportError("no simulator here\nsecond line")


@pytest.fixture
def tasks_it_cannot_learn():
    gym.register("TestsImageTask-v0", entry_point=ImageTask)
    gym.register("TestsMatrixActionTask-v0", entry_point=MatrixActionTask)
    gym.register("TestsUnmakeableTask-v0", entry_point=unmakeable_task)
    yield
    for env_id in ["TestsImageTask-v0", "TestsMatrixActionTask-v0", "TestsUnmakeableTask-v0"]:
        del gym.registry[env_id]


@pytest.mark.parametrize("env, message", [
    ("TestsImageTask-v0", "TestsImageTask-v0's observations are Box(0, 255, (8, 8, 3), uint8); vpg_continuous.py "
                          "needs a vector (a 1-D Box)"),
    ("TestsMatrixActionTask-v0", "TestsMatrixActionTask-v0's actions have shape (2, 2); vpg_continuous.py needs a "
                                 "vector"),
    ("TestsUnmakeableTask-v0", "cannot make TestsUnmakeableTask-v0: no simulator here"),
])
def test_a_task_that_cannot_be_made_or_learnt_is_one_line(env, message, tasks_it_cannot_learn, capsys):
    status, _, stderr = run_main(capsys, "--env", env)
    one_line_error(status, stderr, message)


def test_bad_input_through_the_real_command_line():
    result = run("--env", "MountainCar-v0", timeout=120)
    one_line_error(result.returncode, result.stderr, "MountainCar-v0 has Discrete actions")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_env_names_resolve_to_their_newest_version():
    assert vpg.resolve_env_id("HalfCheetah-v5") == "HalfCheetah-v5"
    assert vpg.resolve_env_id("halfcheetah") == "HalfCheetah-v5"
    assert vpg.resolve_env_id("Pendulum") == "Pendulum-v1"
    assert vpg.resolve_env_id("hopper-v4") == "Hopper-v4"


def test_help_shows_each_field_doc(capsys):
    status, out, _ = run_main(capsys, "--help")
    assert status == 0
    assert "--max-episode-steps" in out and "Cut each episode after this many steps" in out
    assert "--no-state-dependent-std" in out and "(default: HalfCheetah-v5)" in out


def test_damaged_and_foreign_checkpoints_exit_2(trained, tmp_path, capsys):
    run_dir, _ = trained
    checkpoint = run_dir / "checkpoint.pt"
    one_line_error(*run_main(capsys, "--eval", run_dir)[::2],  # the run's directory, not its checkpoint
                   f"checkpoint {run_dir} is not a file; the run's checkpoint in it is {checkpoint}")
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(checkpoint.read_bytes()[:5000])
    one_line_error(*run_main(capsys, "--eval", damaged)[::2], "the file is damaged or not a checkpoint of vpg_continuous.py")
    not_ours = tmp_path / "weights.pt"
    torch.save({"model": {}}, not_ours)
    one_line_error(*run_main(capsys, "--eval", not_ours)[::2], "is not a vpg_continuous.py checkpoint")
    one_line_error(*run_main(capsys, "--eval", checkpoint, "--env", "InvertedPendulum-v5")[::2],
                   "was trained on Pendulum-v1, not InvertedPendulum-v5")
    other_network = torch.load(checkpoint, weights_only=True)
    other_network["policy"]["mean.weight"] = torch.zeros(2, 128)
    torch.save(other_network, tmp_path / "other.pt")
    one_line_error(*run_main(capsys, "--eval", tmp_path / "other.pt")[::2], "holds a different policy network")
    one_line_error(*run_main(capsys, "--resume", checkpoint, "--num-envs", 2)[::2], "keeps its batch of 1024")
    one_line_error(*run_main(capsys, "--resume", checkpoint, "--no-normalize-observations")[::2],
                   "a resumed run keeps --normalize-observations as it was trained (on)")
    one_line_error(*run_main(capsys, "--resume", checkpoint, "--state-dependent-std")[::2],
                   "a resumed run keeps --state-dependent-std as it was trained (off)")
    pickled = tmp_path / "pickled.pt"
    pickled.write_bytes(pickle.dumps({"model": 1}, protocol=4))  # torch warned of it before refusing it
    one_line_error(*run_main(capsys, "--eval", pickled)[::2], "the file is damaged or not a checkpoint of vpg_continuous.py")
    one_line_error(*run_main(capsys, *PENDULUM, "--run-dir", run_dir)[::2], "already holds a checkpoint")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trains_resumes_and_evaluates_on_the_gpu(tmp_path, capsys):
    # The smoke run of the CPU on the GPU (`--device cuda`; `auto` keeps the CPU even here, see
    # `choose_device`), then the checkpoint read back on both.
    status, _, errors = run_main(capsys, *PENDULUM, "--device", "cuda", "--run-dir", tmp_path)
    assert status == 0 and "Pendulum-v1: training on cuda:0" in errors, errors
    checkpoint = tmp_path / "checkpoint.pt"
    status, _, errors = run_main(capsys, "--resume", checkpoint, "--total-timesteps", 8192, "--device", "cpu",
                                 "--run-dir", tmp_path / "on-cpu")
    assert status == 0 and "training on cpu" in errors, errors
    for device in ["cpu", "cuda"]:
        status, out, errors = run_main(capsys, "--eval", tmp_path / "on-cpu" / "checkpoint.pt", "--eval-episodes", 2,
                                       "--device", device)
        assert status == 0 and "2 episodes" in out, errors
