"""The benchmark scripts still run. They measure speed; these tests only check they produce numbers."""

import json
import subprocess
import sys

from conftest import ROOT


def test_throughput_benchmark_runs(tmp_path):
    out = tmp_path / "throughput.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--steps", "30",
                             "--repeats", "1", "--iterations", "1", "--warmup", "0", "--precision", "fp32",
                             "--num-envs", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert results["env"]["workers_sps"] > 0 and results["env"]["vector_env_sps"] > 0
    (run,) = results["train"]
    assert run["precision"] == "fp32" and run["sps"] > 0
    assert run["env_seconds"] + run["inference_seconds"] + run["update_seconds"] <= run["seconds_per_iteration"] * 1.01
