"""benchmarks/learning_curves.py on a cluster, through submitit: runs submitted with its local
executor (real jobs, real subprocesses), one stopped by SIGTERM mid-run, submitted again and resumed
to the same curve as a run never stopped; a failed run said with its last lines and not submitted
twice; how the signals of SLURM and of the local executor reach a job's script; against a real
SLURM where one answers. Then the Atari suite's human-normalised scores, on hand-checked numbers."""

import argparse
import functools
import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from conftest import ROOT
from ppo_jax_runs import environment  # noqa: F401 (a fixture)
from processes import deadline

SCRIPT = ROOT / "benchmarks" / "learning_curves.py"
if "learning_curves" in sys.modules:
    curves = sys.modules["learning_curves"]
else:
    spec = importlib.util.spec_from_file_location("learning_curves", SCRIPT)
    curves = importlib.util.module_from_spec(spec)
    sys.modules["learning_curves"] = curves  # dataclasses, and submitit's pickles, look the module up by name
    spec.loader.exec_module(curves)

pytest.importorskip("submitit")

# ppo_jax.py on gymnax's CartPole: its checkpoint holds every environment's state, so a run resumed
# from it goes on exactly as if never stopped, and the two curves can be compared point for point.
# 800 updates of 4 envs x 64 steps, a checkpoint every 50: the run stops at the end of a piece of 50.
SCHEDULE = 204_800
SCRIPT_FLAGS = ["--num-envs", "4", "--num-steps", "64", "--checkpoint-every", "50"]


def submit_command(name, tmp_path, cluster, *flags, schedule=SCHEDULE, script_flags=SCRIPT_FLAGS):
    return [sys.executable, str(SCRIPT), "--script", "ppo_jax.py", "--env", "CartPole-v1", "--schedule", str(schedule),
            "--name", name, "--points", "8", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
            "--cluster", cluster, "--cpus-per-job", "1", "--poll", "1", *flags, "--", *script_flags]


def wait_for(condition, seconds=240):
    """Wait until `condition()` holds; fail after `seconds` (in any thread: no SIGALRM)."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"still waiting after {seconds} s")
        time.sleep(0.1)


def score_columns(path):
    """The CSV without its training times: step, each curve's score, their mean."""
    rows = [line.split(",") for line in path.read_text().splitlines()]
    keep = [i for i, name in enumerate(rows[0]) if not name.startswith("seconds_")]
    return [[row[i] for i in keep] for row in rows]


def sittings(run_dir):
    """The last step of each event file of a run, in the order they were written."""
    found = [curves.read_sitting(path) for path in curves.event_files(run_dir)]
    return [max(step for step, _ in sitting.steps) for sitting in sorted(found, key=lambda sitting: sitting.start)]


def stop_and_compare(tmp_path, cluster, stop_job, environment):
    """Two runs of the same seed submitted side by side; one of them, `stopped`, has its job stopped by
    `stop_job(job_id)` once its first checkpoint is written. Both must end, and with the same curve.
    Their jobs share a JAX compilation cache of their own, and the resumed job must find every program
    it runs there: it runs the very programs of the job it resumes."""
    runs, cache = tmp_path / "runs", tmp_path / "jax-cache"
    environment = {**environment, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    straight = subprocess.Popen(submit_command("straight", tmp_path, cluster), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=environment)
    stopped = subprocess.Popen(submit_command("stopped", tmp_path, cluster), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment)
    run_dir = runs / "stopped" / "seed-1"
    try:
        wait_for(lambda: (run_dir / "checkpoint.msgpack").exists())
        first_job = json.loads((run_dir / "job.json").read_text())["job_id"]
        compiled = set(cache.glob("*-cache"))  # both runs compile the same programs; none is compiled later
        stop_job(first_job)
        outputs = {name: process.communicate(timeout=400) for name, process in
                   [("straight", straight), ("stopped", stopped)]}
    finally:
        for process in (straight, stopped):
            if process.poll() is None:
                process.kill()
    for name, process in [("straight", straight), ("stopped", stopped)]:
        assert process.returncode == 0, outputs[name][1]
    errors = outputs["stopped"][1]
    # Stopped mid-run, its checkpoint saved, submitted again as a new job, which resumed it.
    second_job = json.loads((run_dir / "job.json").read_text())["job_id"]
    ends = sittings(run_dir)  # a sitting stopped short of the schedule, then one to its end
    assert second_job != first_job and len(ends) == 2 and 0 < ends[0] < ends[1] == SCHEDULE // 256 * 256
    assert errors.count("submitted as job") == 2
    assert f"[stopped seed 1] running (job {first_job})" in errors and "[stopped seed 1] done at step" in errors
    assert f"[stopped seed 1] its job {first_job} stopped at step " in errors
    assert f": submitted as job {second_job} ({cluster}), from step {ends[0]:,}" in errors
    log = (run_dir / "learning_curves.log").read_text()
    assert "stopped at update" in log and "resumed at step" in log
    own = sorted(path.name.rsplit("-", 2)[0] for path in set(cache.glob("*-cache")) - compiled)
    assert compiled and not own, f"the resumed job compiled programs of its own: {own}"
    # The assembled curve is the uninterrupted run's, point for point.
    results = tmp_path / "results"
    assert score_columns(results / "stopped.csv") == score_columns(results / "straight.csv")
    last = score_columns(results / "stopped.csv")[-1]
    assert last[0] == str(SCHEDULE) and float(last[1]) > 0
    assert (results / "stopped.png").stat().st_size > 10_000
    return first_job, second_job


def test_a_job_stopped_by_sigterm_is_submitted_again_and_resumes_to_the_same_curve(tmp_path, environment):
    # The local executor's job is its controller process: SIGTERM to it reaches the job, which passes
    # one stop request on to the script.
    stop_and_compare(tmp_path, "local", lambda job_id: os.kill(int(job_id), signal.SIGTERM), environment)


def test_a_failed_run_is_said_with_its_last_lines_and_never_submitted_twice(tmp_path):
    # A batch of 4 x 64 steps does not split into 5 minibatches: the script exits 2 at once.
    command = submit_command("broken", tmp_path, "local", schedule=4096,
                             script_flags=["--num-envs", "4", "--num-steps", "64", "--num-minibatches", "5"])
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode == 1
    record = json.loads((tmp_path / "runs" / "broken" / "seed-1" / "job.json").read_text())
    failed = f"[broken seed 1] failed at step 0 (job {record['job_id']})"
    assert failed in first.stderr and "1 of 1 runs failed" in first.stderr
    assert "ppo_jax.py exited with status 2" in first.stderr and "minibatch" in first.stderr  # the script's own line

    status = subprocess.run([*command[:command.index("--")], "--status"], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and failed in status.stderr and "minibatch" in status.stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and failed in again.stderr and "submitted as job" not in again.stderr
    assert len(list((tmp_path / "runs" / "broken" / "jobs").glob("*_submitted.pkl"))) == 1
    assert json.loads((tmp_path / "runs" / "broken" / "seed-1" / "job.json").read_text()) == record


# A stand-in for a script: it says which stop requests reach it, and whether SIGUSR2 is ignored.
FAKE_SCRIPT = r"""
import os, signal, sys, time
def said(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    if signum == signal.SIGINT and sys.argv[2] == "exit-on-sigint":
        print("checkpoint saved", flush=True)
        sys.exit(130)
signal.signal(signal.SIGINT, said)
signal.signal(signal.SIGTERM, said)
os.kill(os.getpid(), signal.SIGUSR2)  # fatal unless ignored
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
"""


def run_fake(tmp_path, job, send, expected, mode="wait"):
    """Run the stand-in through `run_sitting` as a job of `job`; `send(child)` is called from another
    thread once it is ready, and the stand-in is told to end once its log shows `expected` and a
    second has passed (time for a signal too many to show). The lines it printed, the sitting's
    result, and its process group."""
    log, done = tmp_path / "fake.log", tmp_path / "done"
    seen = {}

    def signals():
        # The line "ready" itself: the command, shown in the log first, holds the word too, and a
        # signal sent before the stand-in has its handlers is lost (on a loaded machine it was).
        wait_for(lambda: log.exists() and "ready" in log.read_text().splitlines(), 60)
        child = curves.RUNNING[0]
        seen["group"] = os.getpgid(child.process.pid)
        send(child)
        wait_for(lambda: expected in log.read_text(), 60)
        time.sleep(1.0)

    def safely():
        try:
            signals()
        finally:
            done.touch()  # whatever happened, the stand-in ends

    thread = threading.Thread(target=safely)
    thread.start()
    with deadline(120):
        result = curves.run_sitting([sys.executable, "-c", FAKE_SCRIPT, str(done), mode], None, log, "fake", job)
    thread.join()
    lines = [line for line in log.read_text().splitlines() if line.startswith("got") or line == "ready"]
    return lines, result, seen.get("group")


def test_on_slurm_the_script_takes_slurms_own_signal_and_nothing_more(tmp_path):
    # SLURM signals every process of a job: the script and this process each get the SIGTERM.
    def slurm(child):
        child.process.send_signal(signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    lines, (status, at_budget, interrupted), group = run_fake(tmp_path, "slurm", slurm, "got SIGTERM")
    # SIGUSR2 ignored; no second request, which would abort the script.
    assert lines == ["ready", "got SIGTERM"], (tmp_path / "fake.log").read_text()
    assert interrupted and not at_budget and status == 0
    assert group == os.getpgrp()  # in the job's process group, where SLURM's signals reach it


def test_the_local_executor_signals_the_job_which_passes_on_one_request_and_never_an_abort(tmp_path):
    def local(child):
        os.kill(os.getpid(), signal.SIGTERM)  # the controller passes a SIGTERM on to the job
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)  # and at its end interrupts what is left

    lines, (status, _, interrupted), group = run_fake(tmp_path, "local", local, "got SIGINT")
    assert lines == ["ready", "got SIGINT"], (tmp_path / "fake.log").read_text()
    assert interrupted and group != os.getpgrp()


def test_sigusr2_before_a_time_limit_stops_the_script_and_hands_back_the_same_job(tmp_path):
    # What submitit does on SIGUSR2: call the job's `checkpoint`, requeue what it returns.
    job = curves.RunJob("t", "ppo_jax.py", "CartPole-v1", 1000, 1000, (), 1, str(tmp_path))
    handed_back = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: handed_back.append(job.checkpoint()))
    try:
        def slurm_warning(child):
            child.process.send_signal(signal.SIGUSR2)  # SLURM's --signal reaches the script too: ignored
            os.kill(os.getpid(), signal.SIGUSR2)

        lines, (status, _, _), _ = run_fake(tmp_path, "slurm", slurm_warning, "checkpoint saved",
                                            mode="exit-on-sigint")
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert lines == ["ready", "got SIGINT"] and status == 130
    assert "checkpoint saved" in (tmp_path / "fake.log").read_text()
    (delayed,) = handed_back
    assert delayed.function is job


@functools.cache
def slurm_answers() -> bool:
    """Whether a SLURM controller answers with a node free to run jobs (asked once: with the packages
    installed but no controller, sinfo takes 10 s to give up)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    try:
        states = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return states.returncode == 0 and any(state.strip("*~#") in ("idle", "mixed") for state in states.stdout.split())


def require_slurm():
    if not slurm_answers():
        # CI starts a SLURM (benchmarks/slurm_single_node.sh) and sets this, so that these never skip there.
        if os.environ.get("LEARNING_CURVES_SLURM_REQUIRED") == "1":
            pytest.fail("LEARNING_CURVES_SLURM_REQUIRED=1, but no SLURM answers with an idle node")
        pytest.skip("no SLURM here with an idle node (benchmarks/slurm_single_node.sh starts one)")


def test_on_a_real_slurm_a_cancelled_job_is_submitted_again_and_resumes_to_the_same_curve(tmp_path, environment):
    require_slurm()
    # `scancel` stops a job as a time limit does: SIGTERM to each of its processes.
    stop_and_compare(tmp_path, "slurm", lambda job_id: subprocess.run(["scancel", job_id], check=True), environment)


@pytest.mark.parametrize("flags, reason", [
    (["--partition", "no-such-partition"], "sbatch: "),
    (["--slurm-arg", "bogus=1"], "sbatch: unrecognized option '--bogus=1'"),  # it was sbatch's "Try sbatch --help"
])
def test_a_job_slurm_refuses_is_one_line_and_status_2(tmp_path, flags, reason):
    require_slurm()
    result = subprocess.run(submit_command("refused", tmp_path, "slurm", *flags), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(f"learning_curves.py: error: the job of refused seed 1 was refused: {reason}")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "runs" / "refused" / "seed-1" / "job.json").exists()


class Executor:
    """A stand-in for submitit's executor: it counts the jobs submitted, or refuses them as sbatch does."""

    def __init__(self, refusal=None):
        self.submitted, self.refusal = [], refusal

    def submit(self, job):
        if self.refusal:
            from submitit.core.utils import FailedJobError

            raise FailedJobError(self.refusal)
        self.submitted.append(job)
        return types.SimpleNamespace(job_id=str(100 + len(self.submitted)))


def test_sbatchs_own_reason_is_said_not_its_hint_to_try_help(tmp_path):
    task = curves.Task("t", "ppo_jax.py", "CartPole-v1", 1000, 1000, (1,))
    refusal = "sbatch: unrecognized option '--bogus=1'\nTry \"sbatch --help\" for more information"
    with pytest.raises(curves.UsageError) as refused:
        curves.submit(Executor(refusal), curves.RunState(task, 1, "new"), tmp_path, "slurm")
    assert str(refused.value) == "the job of t seed 1 was refused: sbatch: unrecognized option '--bogus=1'"


def test_a_run_submitted_meanwhile_by_another_command_is_not_submitted_again(tmp_path):
    # Two commands started at once both read the run as new; the second to submit finds the first's job.
    task = curves.Task("t", "ppo_jax.py", "CartPole-v1", 1000, 1000, (1,))
    seen = curves.run_state(task, 1, tmp_path, {})
    assert seen.state == "new"
    executor = Executor()
    assert curves.submit(executor, seen, tmp_path, "local") == ("101", True)
    assert curves.submit(executor, seen, tmp_path, "local") == ("101", False)
    assert len(executor.submitted) == 1
    # A run whose job stopped is submitted again once, by whichever command comes first.
    stopped = curves.RunState(task, 1, "stopped", 0, "101")
    assert curves.submit(executor, stopped, tmp_path, "local") == ("102", True)
    assert curves.submit(executor, stopped, tmp_path, "local") == ("102", False)
    assert len(executor.submitted) == 2


def test_jobs_larger_than_every_node_are_refused(tmp_path, monkeypatch):
    # SLURM left a job of 64 CPUs on a node of 2 queued for ever (squeue's reason: PartitionConfig).
    (tmp_path / "sinfo").write_text("#!/bin/sh\nprintf 'debug* 2\\nbig 32\\nbig 64\\n'\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    def check(cpus, partition=None, cluster="slurm"):
        curves.check_cpus_per_job(argparse.Namespace(cluster=cluster, partition=partition, slurm_arg=[],
                                                     cpus_per_job=cpus))

    check(2), check(64, "big"), check(1000, "no-such-partition")  # sbatch says what is wrong with that one
    with pytest.raises(curves.UsageError, match="--cpus-per-job 3: the largest node of the default partition has 2"):
        check(3)
    with pytest.raises(curves.UsageError, match="--cpus-per-job 65: the largest node of partition big has 64 CPUs"):
        check(65, "big")
    with pytest.raises(curves.UsageError, match=f"this machine has {os.cpu_count()} CPUs"):
        check(os.cpu_count() + 1, cluster="local")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    check(1000)  # no sinfo: sbatch judges


def test_a_damaged_job_record_is_one_line_and_status_2(tmp_path, capsys):
    run_dir = tmp_path / "t" / "seed-1"
    run_dir.mkdir(parents=True)
    argv = ["--script", "vpg_continuous.py", "--env", "Pendulum-v1", "--schedule", "1000", "--name", "t", "--status",
            "--runs", str(tmp_path), "--results", str(tmp_path)]
    for damaged in ['{"cluster": "local", "job_id": "12', '{"cluster": "local"}', "[1]"]:
        (run_dir / "job.json").write_text(damaged)
        assert curves.main(argv) == 2
        assert capsys.readouterr().err == (f"learning_curves.py: error: {run_dir / 'job.json'} is damaged: once no "
                                           "job of this run is queued or running, remove it, and the same command "
                                           "submits the run again\n")


# A stand-in for a script, for a job of submitit's local executor: it says it is ready, then waits for
# its stop request and says it saved.
SAVES_ON_SIGINT = r"""
import signal, sys, time
signal.signal(signal.SIGINT, lambda signum, frame: (print("checkpoint saved", flush=True), sys.exit(130)))
print("ready", flush=True)
time.sleep(60)
"""


def test_ctrl_c_at_the_terminal_under_the_local_executor_is_exit_130_without_a_traceback(tmp_path):
    # A Ctrl-C reaches the terminal's whole process group, the job's controller too, which once died
    # of it with a traceback. The job alone takes it: its script saves, and the command exits 130.
    (tmp_path / "standin.py").write_text(SAVES_ON_SIGINT)
    command = [sys.executable, str(SCRIPT), "--script", str(tmp_path / "standin.py"), "--env", "X", "--schedule",
               "1000", "--name", "t", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
               "--cluster", "local", "--cpus-per-job", "1", "--poll", "0.2"]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    log = tmp_path / "runs" / "t" / "seed-1" / "learning_curves.log"
    try:
        wait_for(lambda: log.exists() and "ready" in log.read_text().splitlines(), 120)
        os.killpg(process.pid, signal.SIGINT)
        _, errors = process.communicate(timeout=60)  # until the controller, which holds stderr too, has ended
    finally:
        process.kill()
    assert process.returncode == 130 and "Traceback" not in errors, errors
    assert "learning_curves.py: stopped waiting" in errors and "checkpoint saved" in log.read_text()


# ## The Atari suite's scores


def write_curve(path, scores_by_seed):
    """A suite game's CSV, as learning_curves.py writes it, ending at 10M with these seeds' scores."""
    names = [f"seed_{seed}" for seed in scores_by_seed]
    mean = sum(scores_by_seed.values()) / len(scores_by_seed)
    path.write_text(",".join(["step", *names, "mean", *(f"seconds_{name}" for name in names)]) + "\n"
                    + ",".join(["5000000", *([""] * len(names)), "", *(["1.0"] * len(names))]) + "\n"
                    + ",".join(["10000000", *map(str, scores_by_seed.values()), str(mean), *(["2.0"] * len(names))])
                    + "\n")


def test_human_normalised_scores_on_hand_checked_numbers():
    hns = curves.human_normalised
    assert hns("Breakout", 1.7) == 0.0 and hns("Breakout", 30.5) == pytest.approx(1.0)
    assert hns("Pong", -3.05) == pytest.approx(0.5)  # halfway from -20.7 to 14.6
    assert hns("BeamRider", 4504.55) == pytest.approx(0.25)  # 363.9 + (16926.5 - 363.9) / 4
    assert hns("Skiing", -4336.9) == pytest.approx(1.0) and hns("Skiing", -17098.1) == 0.0  # negative scores
    assert len(curves.ATARI_SCORES) == 57 and len(curves.SUITES["atari57"]) == 57
    assert curves.SUITES["atari3"] == ("Pong", "BeamRider", "Breakout")
    assert all(human > random for random, human in curves.ATARI_SCORES.values())


def test_the_suites_table_is_computed_from_the_runs_csvs(tmp_path, monkeypatch, capsys):
    # Pong at 0.5 and BeamRider at 0.25 (one seed each), Breakout at 2.0: seeds 1 and 2 score 58.3 and
    # 60.3, whose mean 59.3 is 1.7 + 2 x 28.8. Median 0.5, mean (0.5 + 0.25 + 2.0) / 3.
    write_curve(tmp_path / "ppo_atari-Pong.csv", {1: -3.05})
    write_curve(tmp_path / "ppo_atari-BeamRider.csv", {1: 4504.55})
    write_curve(tmp_path / "ppo_atari-Breakout.csv", {1: 58.3, 2: 60.3})
    monkeypatch.setattr(curves, "ale_games", lambda: set(curves.ATARI_SCORES))
    assert curves.main(["--suite", "atari3", "--plot-only", "--runs", str(tmp_path / "runs"),
                        "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| this project's ppo_atari.py | 0.500 | 0.917 |" in out
    assert "| CleanRL ppo_atari_envpool_xla_jax.py, 10M steps, 3 seeds, all 57 | 1.04 | 7.18 |" in out
    assert "| Breakout | 10M | 2 | 59.3 | 1.7 | 30.5 | 2.000 |" in out
    assert "do not compare with CleanRL's" in out  # 3 games are not the 57
    rows = (tmp_path / "atari3-ppo_atari-hns.csv").read_text().splitlines()
    assert rows[0] == "game,step,seeds,score,random,human,hns"
    assert rows[1:] == ["Pong,10000000,1,-3.05,-20.7,14.6,0.5", "BeamRider,10000000,1,4504.55,363.9,16926.5,0.25",
                        "Breakout,10000000,2,59.3,1.7,30.5,2.0"]
    assert (tmp_path / "atari3-ppo_atari-hns.md").read_text() in out


def test_games_the_installed_ale_py_lacks_are_named_and_skipped_in_one_line(tmp_path, monkeypatch, capsys):
    write_curve(tmp_path / "ppo_jax-Breakout.csv", {1: 30.5})
    write_curve(tmp_path / "ppo_jax-BeamRider.csv", {1: 363.9})
    monkeypatch.setattr(curves, "ale_games", lambda: set(curves.ATARI_SCORES) - {"Pong"})
    assert curves.main(["--suite", "atari3", "--script", "ppo_jax.py", "--plot-only", "--runs", str(tmp_path / "r"),
                        "--results", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    skipped = [line for line in captured.err.splitlines() if "Pong" in line]
    assert skipped == ["atari3: the installed ale-py lacks 1 of its games, skipped: Pong"]
    assert "| this project's ppo_jax.py | 0.500 | 0.500 |" in captured.out  # the median of 0 and 1
    assert "skipped: Pong." in captured.out


def test_over_all_57_games_the_median_and_mean_compare_with_cleanrls():
    # Every game at its human score (HNS 1) but Pong at 85.2 (3: -20.7 + 3 x 35.3) and Breakout at -27.1
    # (-1: 1.7 - 28.8): median 1, mean (55 + 3 - 1) / 57 = 1.
    scores = [curves.GameScore(game, curves.ATARI_SCORES[game][1], 10_000_000, 3) for game in curves.ATARI_SCORES]
    scores = [curves.GameScore(score.game, {"Pong": 85.2, "Breakout": -27.1}.get(score.game, score.score),
                               score.step, score.seeds) for score in scores]
    assert [round(score.normalised, 9) for score in scores if score.game in ("Pong", "Breakout")] == [-1.0, 3.0]
    assert curves.summarise(scores) == {"median": pytest.approx(1.0), "mean": pytest.approx(1.0)}
    table = curves.hns_table("atari57", "ppo_jax.py", scores, [])
    assert "| over 57 of the 57 games | median HNS | mean HNS |" in table
    assert "| this project's ppo_jax.py | 1.000 | 1.000 |" in table and "do not compare" not in table


def test_the_installed_ale_py_has_every_game_of_the_57():
    pytest.importorskip("ale_py")
    assert set(curves.SUITES["atari57"]) <= curves.ale_games()


@pytest.mark.parametrize("argv, message", [
    (["--suite", "atari57", "breakout"], "--suite and a task name cannot be used together"),
    (["--suite", "atari3", "--script", "vpg_continuous.py"], "runs ppo_atari.py or ppo_jax.py"),
    (["breakout", "--partition", "gpu"], "need --cluster"),
    (["breakout", "--cluster", "local", "--slurm-arg", "qos=high"], "they need --cluster slurm"),
    (["breakout", "--cluster", "slurm", "--time-limit", "0"], "--time-limit and --cpus-per-job must be positive"),
    (["breakout", "--plot-only", "--cluster", "slurm"], "--plot-only trains nothing"),
    # NaN passed `--poll <= 0` and was time.sleep's traceback once the jobs were submitted, as was inf.
    *[(["breakout", "--status", "--poll", poll], f"--poll is the seconds between two looks at the jobs: above 0 "
                                                 f"and at most a day (86400), not {shown}")
      for poll, shown in [("nan", "nan"), ("inf", "inf"), ("0", "0"), ("-1", "-1")]],
])
def test_bad_cluster_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    assert curves.main([*argv, "--runs", str(tmp_path), "--results", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("learning_curves.py: error: ") and message in error
    with pytest.raises(SystemExit) as exit:
        curves.main(["breakout", "--slurm-arg", "--qos"])
    assert exit.value.code == 2


def test_a_damaged_record_of_a_jobs_end_is_the_jobs_failure_not_a_traceback(tmp_path):
    task = curves.Task("t", "ppo_jax.py", "CartPole-v1", 1000, 1000, (1,))
    assert curves.submit(Executor(), curves.run_state(task, 1, tmp_path, {}), tmp_path, "local") == ("101", True)
    result = curves.jobs_folder(task, tmp_path) / "101_0_result.pkl"
    result.parent.mkdir(parents=True, exist_ok=True)
    for damaged in (b"\x80\x05\x95 cut short", b"", pickle.dumps(["not", "submitit's"])):
        result.write_bytes(damaged)
        seen = curves.run_state(task, 1, tmp_path, {})
        assert (seen.state, seen.job_id) == ("failed", "101")
        assert seen.detail[0] == f"the record of its job's end, {result}, is damaged"
    result.write_bytes(pickle.dumps(("error", "Traceback (most recent call last):\nValueError: boom\n")))
    assert curves.run_state(task, 1, tmp_path, {}).detail[0] == "ValueError: boom"
