"""The benchmark scripts still run. They measure speed; these tests only check they produce numbers."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_throughput_benchmark_runs(tmp_path):
    out = tmp_path / "throughput.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--steps", "30",
                             "--repeats", "1", "--iterations", "1", "--warmup", "0", "--precision", "fp32",
                             "--num-envs", "4", "--sampling", "both", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    (env,) = results["env"]
    assert env["workers_sps"] > 0 and env["vector_env_sps"] > 0
    # Both ways of sampling, each beside the workers alone, measured once in the same run.
    assert [run["sampling"] for run in results["train"]] == ["serial", "double-buffered"]
    assert len({run["workers_alone_sps"] for run in results["train"]}) == 1
    for run in results["train"]:
        assert run["precision"] == "fp32" and run["num_envs"] == 4 and run["sps"] > 0 and run["workers_alone_sps"] > 0
        assert run["of_workers_alone"] == run["sps"] / run["workers_alone_sps"] and run["rounds_sps"] == [run["sps"]]
        assert run["env_seconds"] > 0 and run["inference_seconds"] > 0
        assert run["env_seconds"] + run["inference_seconds"] + run["update_seconds"] <= run["seconds_per_iteration"] * 1.01
    assert "of the workers alone" in result.stdout


def test_ppo_jax_speed_measures_ppo_atari_in_the_precision_asked_for():
    # The Atari comparison runs ppo_atari.py twice, in its default precision and in float32; this
    # checks the float32 one really is float32 and that its split adds up.
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ppo_jax_speed.py"), "--measure", "atari",
                             "ppo_atari:fp32", "--iterations", "1", "--warmup", "0"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout.strip().splitlines()[-1])
    assert run["script"] == "ppo_atari" and run["precision"] == "fp32" and run["sps"] > 0
    assert run["rollout_s"] + run["update_s"] <= run["seconds_per_iteration"] * 1.01


def test_ppo_jax_profile_accounts_for_the_update(tmp_path):
    # The split comes from profiler events matched to the compiled program: if the matching broke
    # (another jaxlib's names), most of the update would go unaccounted for, or nothing would be
    # called a window copy.
    out = tmp_path / "split.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ppo_jax_profile.py"), "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    profile = json.loads(out.read_text())
    accounted = sum(profile["split_ms"].values()) / 1e3
    assert 0.5 * profile["seconds"] < accounted <= 1.01 * profile["seconds"]
    assert profile["split_ms"]["building the windows: the first layer's"] > 0


def test_ppo_jax_profile_times_both_convolutions_and_puts_ppo_jax_back():
    # Inside `convolutions_as`, the Nature CNN really is built from flax's nn.Conv (its parameters say
    # so), and ppo_jax.py's own Convolution is back afterwards, even after an error.
    code = ("import json, jax, numpy as np, ppo_jax, ppo_jax_profile\n"
            "ours = ppo_jax.Convolution\n"
            "frames = np.zeros((1, 4, 84, 84), np.uint8)\n"
            "def layers(params): return sorted(params['params']['Convolution_0'] if 'Convolution_0' in params['params']"
            " else params['params']['FlaxConvolution_0'])\n"
            "with ppo_jax_profile.convolutions_as(ppo_jax_profile.FlaxConvolution):\n"
            "    theirs = layers(ppo_jax.NatureActorCritic(4).init(jax.random.key(0), frames))\n"
            "try:\n"
            "    with ppo_jax_profile.convolutions_as(ppo_jax_profile.FlaxConvolution):\n"
            "        raise KeyboardInterrupt\n"
            "except KeyboardInterrupt:\n"
            "    pass\n"
            "mine = layers(ppo_jax.NatureActorCritic(4).init(jax.random.key(0), frames))\n"
            "seconds = ppo_jax_profile.time_convolutions(num_frames=4, repeats=1)\n"
            "print(json.dumps({'theirs': theirs, 'mine': mine, 'restored': ppo_jax.Convolution is ours,"
            " 'seconds': [[*k, v] for k, v in seconds.items()]}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["theirs"] == ["Conv_0"] and out["mine"] == ["Dense_0"] and out["restored"]
    assert {(name, where) for name, where, _ in out["seconds"]} == {
        (name, where) for name in ("nn.Conv", "Convolution") for where in ("alone", "in a scan")}
    assert all(seconds > 0 for *_, seconds in out["seconds"])
