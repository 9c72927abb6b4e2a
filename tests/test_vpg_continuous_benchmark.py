"""benchmarks/vpg_halfcheetah.py still runs and reads back what the run logged (it measures; this only checks)."""

import json
import subprocess
import sys

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
    assert "Pendulum-v1, 2,048 steps, 1 seeds (default): return" in result.stdout
