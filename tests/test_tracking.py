"""`--track`: each script sends its run to Weights & Biases, tested offline (WANDB_MODE=offline).

wandb is optional for a user, in no script's own requirements file; requirements/tests.txt installs
it, so that CI runs these offline runs. Where it is not installed they are skipped, and the one-line
message that asks for it is still tested."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

# A tiny training run of each script, as short as its command line allows.
TINY = {
    "ppo_atari": ["--env", "Breakout", "--total-timesteps", 1024, "--num-envs", 4, "--num-steps", 256,
                  "--max-episode-frames", 400, "--num-workers", 2],
    "vpg_continuous": ["--env", "Pendulum-v1", "--total-timesteps", 1024, "--num-envs", 4, "--num-steps", 256,
                       "--num-workers", 2],
    "ppo_jax": ["--env", "CartPole-v1", "--total-timesteps", 1024, "--num-steps", 64],
}


# The script run as from the command line, in a Python where `import wandb` fails.
WITHOUT_WANDB = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script", list(TINY))
def test_track_without_wandb_is_one_line_before_anything_starts(script, tmp_path):
    result = subprocess.run([sys.executable, "-c", WITHOUT_WANDB, str(ROOT / f"{script}.py"), *map(str, TINY[script]),
                             "--track", "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"{script}.py: error: --track needs wandb: pip install wandb==0.31.0"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", list(TINY))
def test_track_without_an_api_key_is_one_line(script, tmp_path):
    # Online, with no key in the environment or in ~/.netrc: wandb refuses, and the run ends in its words.
    pytest.importorskip("wandb")
    environment = {name: value for name, value in os.environ.items() if not name.startswith("WANDB_")}
    environment.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, str(ROOT / f"{script}.py"), *map(str, TINY[script]), "--track",
                             "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=environment, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"{script}.py: error: --track: No API key configured. Use "
                                                      "`wandb login` to log in."), result.stderr
    assert "Traceback" not in result.stderr


def scalar_tags(run_dir: Path) -> set[str]:
    """The scalar tags of a run's TensorBoard events, those of a writer in a subdirectory under its name."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in run_dir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        prefix = "" if events.parent == run_dir else f"{events.parent.relative_to(run_dir).as_posix()}/"
        tags |= {prefix + tag for tag in accumulator.Tags()["scalars"]}
    return tags


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


def run_offline(script: str, wandb_dir: Path, *args) -> subprocess.CompletedProcess:
    environment = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(ROOT / f"{script}.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=environment)


@pytest.mark.parametrize("script", list(TINY))
def test_track_offline_keeps_the_tensorboard_scalars_the_config_and_the_videos(script, tmp_path):
    pytest.importorskip("wandb")
    result = run_offline(script, tmp_path, *TINY[script], "--track", "--wandb-project-name", "tests",
                         "--capture-video", "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    runs = offline_runs(tmp_path)
    assert len(runs) == 1
    # The run's record holds what was synced from TensorBoard, under TensorBoard's tag names: every
    # scalar tag of every writer (ppo_jax.py's per-agent writers under agent-<i>/), though an event
    # may hold several of them (ppo_jax.py writes one event per writer and update). And the config.
    record = b"".join(path.read_bytes() for path in runs[0].glob("*.wandb"))
    tags = scalar_tags(tmp_path / "run")
    assert {"losses/policy_loss", "charts/learning_rate", "charts/SPS"} <= tags
    assert [tag for tag in sorted(tags) if tag.encode() not in record] == []
    assert b"total_timesteps" in record
    assert b"tests" in record  # the project named on the command line
    # The script itself (`save_code`), so that the run records the code that made it.
    assert f"{script}.py" in [path.name for path in runs[0].rglob("*") if path.is_file()]
    # Every video training wrote, sent as it was written (by the torch scripts, each once its game or
    # episode ended; by ppo_jax.py, the one of the last checkpoint).
    written = [video for video in (tmp_path / "run" / "videos").glob("*.mp4") if not video.name.startswith(".")]
    sent = list(runs[0].rglob("media/videos/*.mp4"))
    assert len(sent) == len(written) > 0, (written, sent)


def test_track_uploads_the_videos_of_an_evaluation(tmp_path):
    pytest.importorskip("wandb")
    result = run_offline("vpg_continuous", tmp_path, *TINY["vpg_continuous"], "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    result = run_offline("vpg_continuous", tmp_path, "--eval", tmp_path / "run" / "checkpoint.pt", "--eval-episodes", 2,
                         "--max-episode-steps", 20, "--capture-video", "--track")
    assert result.returncode == 0, result.stderr
    runs = offline_runs(tmp_path)
    assert len(runs) == 1
    uploaded = sorted(path for path in runs[0].rglob("*.mp4"))
    assert len(uploaded) == 2, uploaded
    assert b"eval/episodic_return" in b"".join(path.read_bytes() for path in runs[0].glob("*.wandb"))
