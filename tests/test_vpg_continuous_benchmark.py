"""benchmarks/vpg_halfcheetah.py still runs and reads back what the run logged (it measures; this only checks)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def test_benchmark_reports_the_curve_and_the_speed(tmp_path):
    out = tmp_path / "results.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vpg_halfcheetah.py"), "--env", "Pendulum-v1",
                             "--total-timesteps", "2048", "--runs", str(tmp_path), "--json", str(out), "--",
                             "--num-envs", "4", "--num-steps", "256", "--value-epochs", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["episodes"] == 8  # each of 4 envs plays 512 steps: two whole 200-step Pendulum episodes
    assert -16.3 * 200 <= run["final_return"] < 0 and run["sps"] > 0
    assert [step for step, _ in run["curve"]] == [int(2048 * i / 10) for i in range(1, 11)]
    # The phases of the updates, timed around the trainer's methods: each took some time, and the
    # envs and the networks together no longer than the run.
    phases = run["phase_seconds"]
    assert set(phases) == {"env", "inference", "update"} and min(phases.values()) > 0
    assert sum(phases.values()) < run["seconds"]
    # Flags after `--` name the runs' folder, so an ablation's runs go beside the default's.
    label = "num-envs_4_num-steps_256_value-epochs_1"
    assert run["run_dir"] == str(tmp_path / f"Pendulum-v1__1__{label}")
    assert f"Pendulum-v1, 2,048 steps, 1 seeds ({label}): return" in result.stdout


def benchmark(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vpg_halfcheetah.py"), "--env", "Pendulum-v1",
                           *args], capture_output=True, text=True, timeout=300, cwd=cwd)


# 4 envs x 64 steps: no 200-step Pendulum episode ends, so no return is logged.
SHORT = ["--total-timesteps", "256", "--", "--num-envs", "4", "--num-steps", "64", "--value-epochs", "1"]


def test_a_run_that_ends_no_episode_says_so_and_a_refused_run_is_one_line(tmp_path):
    # `--runs` relative to where the command is typed, though vpg_continuous.py runs in the repository's root.
    args = ["--runs", "runs", "--label", "short", *SHORT]
    result = benchmark(*args, cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "seed 1: no episode ended | " in result.stdout
    # The same run again: vpg_continuous.py refuses its folder in a line, and this says so in one more.
    result = benchmark(*args, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    run_dir = tmp_path / "runs" / "Pendulum-v1__1__short"
    assert result.stderr.strip().splitlines()[-2:] == [
        f"vpg_continuous.py: error: {run_dir} already holds a checkpoint; resume it with "
        f"--resume {run_dir / 'checkpoint.pt'} or choose another --run-dir",
        "vpg_continuous.py ended with exit status 2"]


@pytest.mark.parametrize("folder", ["missing", "a-file"])
def test_a_json_path_that_cannot_be_written_is_refused_before_any_run(folder, tmp_path):
    # A short run, so that one the check let through would soon fail the test rather than train for an hour.
    (tmp_path / "a-file").write_text("")
    result = benchmark("--json", str(tmp_path / folder / "results.json"), "--runs", str(tmp_path / "runs"), *SHORT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(f"{folder}/results.json: cannot write there")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]
