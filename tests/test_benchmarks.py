"""The benchmark scripts still run, and refuse bad input. They measure speed; these tests only check
they produce numbers."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT


def test_throughput_benchmark_runs(tmp_path):
    out = tmp_path / "throughput.json"
    baseline = tmp_path / "baseline.py"  # an earlier copy of the script, as a change is measured
    baseline.write_text((ROOT / "ppo_atari.py").read_text())
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--steps", "30",
                             "--repeats", "1", "--iterations", "1", "--warmup", "0", "--precision", "fp32",
                             "--num-envs", "4", "--baseline", str(baseline), "--eager-update", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    (env,) = results["env"]
    assert env["workers_sps"] > 0 and env["vector_env_sps"] > 0
    # This script, the baseline and this script with its update launched step by step (as it is
    # anyway without a GPU), each beside the workers alone, measured once in the same run.
    assert [(run["script"], run["trainer"]) for run in results["train"]] == [
        (str(ROOT / "ppo_atari.py"), "RunTrainer"), (str(baseline), "RunTrainer"), (str(ROOT / "ppo_atari.py"), "RunTrainer")]
    assert not any(run["cuda_graph_update"] for run in results["train"])
    assert len({run["workers_alone_sps"] for run in results["train"]}) == 1
    for run in results["train"]:
        assert run["precision"] == "fp32" and run["num_envs"] == 4 and run["sps"] > 0 and run["workers_alone_sps"] > 0
        assert run["of_workers_alone"] == run["sps"] / run["workers_alone_sps"] and run["rounds_sps"] == [run["sps"]]
        assert run["env_seconds"] > 0 and run["inference_seconds"] > 0 and run["aten_calls_per_step"] > 0
        assert run["env_seconds"] + run["inference_seconds"] + run["update_seconds"] <= run["seconds_per_iteration"] * 1.01
    assert "of the workers alone" in result.stdout
    # The host's side of a step, for both scripts and both layouts of the stored frames.
    assert [host["script"] for host in results["host"]] == [str(ROOT / "ppo_atari.py"), str(baseline)]
    assert all(host["channels_last_us_per_step"] > 0 and host["channels_first_us_per_step"] > 0 for host in results["host"])


def graph_update(tmp_path, *args) -> dict:
    """The run of `graph_update.py` with `args`, from its JSON."""
    out = tmp_path / "graph-update.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_update.py"), "--num-envs", "2", *args,
                             "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "an update from the same weights left them apart by" in result.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["eager_seconds"] > 0 and run["graphed_seconds"] > 0
    return run


def test_a_graphed_update_feeds_part_ones_step_the_update_s_own_tensors(tmp_path):
    # Without a GPU nothing is captured, but the steps read the graph's fixed tensors: an update
    # from the same weights as the update launched step by step ends where it does, but for rounding (Adam's
    # learning rate as a float32 tensor), about 1e-6 of how far the update moved the weights, once in
    # 24 updates 5e-4 (a sample at the edge of the clip). A batch or a minibatch left uncopied ended
    # 0.8, and 0.5 to 1.6, of it apart, when the fixed tensors began as copies of the first ones.
    run = graph_update(tmp_path, "--device", "cpu", "--updates", "3")
    assert not run["captured"] and len(run["relative_weight_difference"]) == 3
    assert max(run["relative_weight_difference"]) < 0.05, run["relative_weight_difference"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_update_is_the_update_on_the_gpu(tmp_path):
    run = graph_update(tmp_path, "--device", "cuda", "--updates", "6")
    assert run["captured"]
    assert max(run["relative_weight_difference"]) < 0.05, run["relative_weight_difference"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_graphed_update_asks_for_a_gpu_in_one_line():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_update.py")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        "--device cuda needs a CUDA GPU, and torch finds none (--device cpu checks the copies alone)")


def test_shared_cores_benchmark_times_steps_beside_a_neighbour(tmp_path):
    # Two runs of two steps on one thread beside a neighbour on one; then a run past its limit is stopped.
    script = [sys.executable, str(ROOT / "benchmarks" / "shared_cores.py"), "--threads", "1", "--neighbour-threads", "1",
              "--steps", "2", "--precision", "fp32", "--json", str(tmp_path / "runs.json")]
    result = subprocess.run(script + ["--runs", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs["threads"] == 1 and runs["neighbour_threads"] == 1 and len(runs["runs"]) == 2
    for run in runs["runs"]:
        assert run["threads"] == 1 and not run["bf16"] and len(run["seconds"]) == 2 and min(run["seconds"]) > 0
    assert "1 thread beside 1 on " in result.stdout and ": 2 of 2 runs finished, in " in result.stdout
    result = subprocess.run(script + ["--runs", "1", "--limit", "0.1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "runs.json").read_text())["runs"] == [None]
    assert "run 1: stopped after 0.1 s" in result.stdout and "0 of 1 runs finished; 1 stopped after 0.1 s" in result.stdout


def test_ppo_jax_chunks_times_the_programs_and_the_device_under_the_command_line(tmp_path):
    # The run (B) has the configuration of the programs (A), 100 updates of 2 agents: with a compilation
    # cache it loads the programs (A) compiled, the command line's init and chunk among them.
    out, cache = tmp_path / "chunks.json", {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
                                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ppo_jax_chunks.py"), "--seeds", "2",
                             "--updates", "100", "--count", "50", "--total-timesteps", str(100 * 512), "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, **cache})
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    programs, run = results["programs"], results["run"]
    assert results["seeds"] == 2 and programs["updates"] == 100 and min(programs.values()) > 0
    assert {"chunk_of_50_ms_per_update", "chunk_of_100_ms_per_update_reading_the_flag"} <= set(programs)
    assert run["status"] == 0 and sum(run["chunk_counts"]) == 100 and run["device_busy_s"] > 0
    assert run["device_idle_between_chunks_s"] >= 0 and run["write_checkpoint_s"] > 0 and run["log_chunk_s"] > 0
    assert 0 <= run["in_dispatch_s"] <= run["seconds"] - run["before_first_chunk_s"]
    assert run["before_first_chunk_s"] + run["device_busy_s"] + run["device_idle_between_chunks_s"] \
        + run["after_last_chunk_s"] == pytest.approx(run["seconds"])


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


def test_ppo_jax_speed_measures_the_process_beside_the_compiled_program():
    # The command line's cost over the compiled program: both measured, one after the other, and their ratio.
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ppo_jax_speed.py"), "--part", "overhead",
                             "--seeds", "2", "--total-timesteps", "1024", "--repeats", "1"],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("(a) CartPole-v1, 1,024 steps x 2 agents: trace ") for line in lines), result.stdout
    assert any(line.startswith("(b) python ppo_jax.py --num-seeds 2 --total-timesteps 1024: ") for line in lines)
    ratio = next(line for line in lines if "the process over the compiled program" in line)
    assert float(ratio.split("): ")[1].split("x")[0]) > 0


@pytest.mark.parametrize("script, args, message", [
    ("throughput.py", ["--num-envs", "8", "0"], "--num-envs must be at least 1, not 0"),
    ("throughput.py", ["--rounds", "-1"], "--rounds must be at least 1, not -1"),
    ("throughput.py", ["--env", "Breakot"], "unknown Atari game 'Breakot'"),
    ("throughput.py", ["--baseline", "missing.py"], "--baseline missing.py is not a file"),
    ("ppo_jax_speed.py", ["--seeds", "16", "0"], "--seeds must be at least 1, not 0"),
    ("ppo_jax_speed.py", ["--compare", "missing.py"], "--compare missing.py is not a file"),
    ("ppo_jax_speed.py", ["--total-timesteps", "100"], "--total-timesteps must be at least 512, not 100"),
    ("throughput.py", ["--json", "missing/results.json"], "--json missing/results.json: cannot write there"),
    ("ppo_jax_speed.py", ["--json", "."], "--json .: cannot write there"),
    # A path under a file: refused now, not after the (short) part asked for has run.
    ("throughput.py", ["--part", "host", "--num-envs", "1", "--json", str(ROOT / "README.md" / "results.json")],
     f"--json {ROOT / 'README.md' / 'results.json'}: cannot write there"),
    ("ppo_jax_speed.py", ["--part", "compiled", "--seeds", "1", "--total-timesteps", "512", "--repeats", "1",
                          "--json", str(ROOT / "README.md" / "results.json")],
     f"--json {ROOT / 'README.md' / 'results.json'}: cannot write there"),
    ("ppo_jax_chunks.py", ["--updates", "5"], "--updates must be at least 100, not 5"),
    ("ppo_jax_chunks.py", ["--script", "missing.py"], "--script missing.py is not a file"),
    ("beside_cleanrl.py", ["--cleanrl", "."], "--cleanrl . holds no cleanrl/ppo_atari.py"),
    ("shared_cores.py", ["--runs", "0"], "argument --runs: must be at least 1, not 0"),
    ("shared_cores.py", ["--neighbour-threads", "two"], "argument --neighbour-threads: not a number: 'two'"),
])
def test_the_speed_benchmarks_refuse_bad_input_in_one_line(script, args, message, tmp_path):
    # Before anything is measured: an error line after argparse's usage, status 2, no traceback.
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and message in last, result.stderr


@pytest.mark.parametrize("script, flag, name, text, message", [
    ("throughput.py", "--baseline", "notes.txt", "hello world",
     "--baseline notes.txt does not load as a copy of ppo_atari.py: SyntaxError: invalid syntax (notes.txt, line 1)"),
    ("throughput.py", "--baseline", "other.py", "x = 1",
     "--baseline other.py is not a copy of ppo_atari.py: it defines no Config, Game, Trainer, FastSamplingTrainer"),
    ("ppo_jax_speed.py", "--compare", "notes.txt", "hello world",
     "--compare notes.txt is not Python: invalid syntax (notes.txt, line 1)"),
    ("ppo_jax_speed.py", "--compare", "other.py", "x = 1", "--compare other.py is not a ppo_jax.py: it defines no main"),
])
def test_a_file_to_measure_beside_the_script_that_is_not_one_is_refused_in_one_line(script, flag, name, text, message,
                                                                                   tmp_path):
    # Before anything is measured (this script's own run comes first), a line naming the file and what it lacks.
    (tmp_path / name).write_text(text)
    part = ["--part", "host", "--num-envs", "1"] if script == "throughput.py" else [
        "--part", "process", "--seeds", "1", "--total-timesteps", "512", "--repeats", "1"]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *part, flag, name],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"{script}: error: {message}", result.stderr


def test_a_compared_copy_that_fails_while_measured_ends_in_its_own_words_not_a_traceback(tmp_path, capsys):
    # A copy that defines what it should but fails when run: its error, then one line saying which
    # measurement failed, exit status 1 (`main` lets the SystemExit through, which prints no traceback).
    spec = importlib.util.spec_from_file_location("ppo_jax_speed", ROOT / "benchmarks" / "ppo_jax_speed.py")
    speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speed)
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\n\n\ndef main():\n    pass\n\n\nsys.exit('this copy is broken')\n")
    with pytest.raises(SystemExit) as failed:
        speed.in_fresh_process("process", "1", "512", str(broken))
    assert str(failed.value) == (f"ppo_jax_speed.py: measuring `process 1 512 {broken}` failed (exit status 1); "
                                 "what it wrote is above")
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == ["this copy is broken",
                                                                  f"{broken} ended with exit status 1"], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here to measure")
def test_the_throughput_benchmark_without_a_gpu_refuses_cuda_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--device", "cuda"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("throughput.py: error: --device cuda was asked for, but torch "
                                                      "finds no CUDA device")


STAND_IN_CLEANRL = """import os, sys, time
from pathlib import Path
from torch.utils.tensorboard import SummaryWriter
Path(os.environ["STAND_IN_NOTES"]).write_text(" ".join(sys.argv) + "\\n" + os.environ["PYTHONPATH"])
writer = SummaryWriter("runs/stand-in")
for step in (1024, 2048):  # CleanRL's SPS, once an update
    writer.add_scalar("charts/SPS", 100, step)
    time.sleep(0.5)
writer.close()
"""


def test_beside_cleanrl_runs_both_scripts_in_turns(tmp_path):
    # CleanRL's ppo_atari.py is not here: a stand-in takes its place, in a checkout's layout, and
    # notes how it was run. ppo_atari.py runs for real, 2 updates of 8 games x 128 steps.
    (tmp_path / "cleanrl" / "cleanrl").mkdir(parents=True)
    (tmp_path / "cleanrl" / "cleanrl" / "ppo_atari.py").write_text(STAND_IN_CLEANRL)
    (tmp_path / "site").mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "beside_cleanrl.py"), "--cleanrl", "cleanrl",
                             "--cleanrl-site", "site", "--total-timesteps", "2048", "--rounds", "1", "--json",
                             "out.json"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "STAND_IN_NOTES": str(tmp_path / "argv.txt")})
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["device"] == "cpu" and results["total_timesteps"] == 2048
    for name in ["ppo_atari.py", "CleanRL"]:
        (run,) = results["runs"][name]
        assert run["seconds"] > 0 and run == results["medians"][name]
        assert run["sps_whole_process"] == pytest.approx(2048 / run["seconds"])
    # The stand-in's two events, 1,024 steps and at least half a second apart (the clock's ticks aside).
    assert 0 < results["runs"]["CleanRL"][0]["sps_between_events"] <= 2100
    assert results["runs"]["ppo_atari.py"][0]["sps_between_events"] > 0
    # Its runner ran the script by its path, with CleanRL's flags, its own libraries first on its path.
    flags, path = (tmp_path / "argv.txt").read_text().splitlines()
    assert flags == f"{tmp_path / 'cleanrl' / 'cleanrl' / 'ppo_atari.py'} --seed 1 --total-timesteps 2048 --no-cuda"
    assert path.split(os.pathsep) == [str(tmp_path / "site"), str(tmp_path / "cleanrl")]
    assert result.stdout.splitlines()[-1].startswith("Breakout, 2,048 steps, cpu, medians of 1: ppo_atari.py ")


def busy_loops() -> list[str]:
    """The processes of `suite_time.sh --busy` that run now, read from /proc."""
    running = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended while /proc was read
            if b"a busy loop of suite_time.sh" in path.read_bytes():
                running.append(path.parent.name)
    return running


def test_suite_time_runs_the_tests_as_a_cpu_with_avx2_alone_beside_busy_loops(tmp_path):
    # `suite_time.sh --avx2 --busy 1` runs pytest on what it is given; the test it runs here looks
    # from inside: PyTorch held to AVX2, `--precision auto` in float32, XLA told AVX2, and one busy
    # loop more than before running beside it (none left once the script ends). Counted against
    # those already there: the suite itself may run under `suite_time.sh --busy`.
    before = len(busy_loops())
    probe = tmp_path / "test_probe.py"
    probe.write_text(f"""
import os, sys, torch
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
import ppo_atari
from test_benchmarks import busy_loops

def test_as_avx2():
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not ppo_atari.cpu_has_fast_bf16() and not ppo_atari.use_bf16("auto", torch.device("cpu"))
    assert "--xla_cpu_max_isa=AVX2" in os.environ["XLA_FLAGS"]
    assert len(busy_loops()) == {before} + 1
""")
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "suite_time.sh"), "--avx2", "--busy", "1", "-q",
                             "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(probe)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable})  # this venv, first on PATH or not
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout and "real" in result.stderr
    deadline = time.monotonic() + 10  # the loops are stopped as the script ends
    while len(busy_loops()) > before:
        assert time.monotonic() < deadline, "a busy loop outlived suite_time.sh"
        time.sleep(0.1)


def test_suite_time_refuses_a_busy_count_that_is_not_a_number():
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "suite_time.sh"), "--busy", "two"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.strip() == (
        "suite_time.sh: error: --busy needs a number of busy loops, not 'two'")
