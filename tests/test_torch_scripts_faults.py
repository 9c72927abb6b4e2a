"""ppo_atari.py and vpg_continuous.py when things go wrong: Ctrl-C twice or early, a diverging update,
bad numbers, a full disk, two runs in one directory, workers that hang or that fail before they are
ready or while training, and Ctrl-C while evaluating.

The two scripts hold the same text for all of this (`test_vpg_continuous_copies.py`), so each test
is written once and runs for both."""

import dataclasses
import errno
import math
import os
import signal
import subprocess
import sys
import time
import typing

import pytest
import torch

from processes import (alive, deadline, hang_up, interrupted_while_loading, living, on_a_terminal, process_tree,
                       read_until)
from torch_scripts import IDS, ROOT, SCRIPTS, Script


@pytest.fixture(params=SCRIPTS, ids=IDS)
def script(request) -> Script:
    return request.param


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def wait_for(process: subprocess.Popen, text: str) -> None:
    for line in process.stderr:
        if text in line:
            return
    raise AssertionError(f"the run ended before printing {text!r}")


# ## Ctrl-C, twice or early


def press_ctrl_c_twice() -> None:
    """What an impatient user does: the first Ctrl-C asks for a stop, the second aborts."""
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_during_the_write_of_a_checkpoint_waits_until_the_checkpoint_is_whole(script, tmp_path,
                                                                                      monkeypatch, capsys):
    # Raised inside torch.save, the interrupt used to leave its C++ writer half-closed: now and then
    # the process died in `terminate called ... c10::Error`, with the temporary file left behind.
    real_save = torch.save

    def save(obj, file):
        if obj["update"] == 2:
            press_ctrl_c_twice()  # its handler would run at the next bytecode: inside torch.save
        real_save(obj, file)

    monkeypatch.setattr(torch, "save", save)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1280, "--checkpoint-every", 1,
                                        "--run-dir", tmp_path)
    # The checkpoint of update 2 is written whole; then the two signals are a request and an abort.
    assert status == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"aborted by a second interrupt; the last checkpoint is {tmp_path / 'checkpoint.pt'}")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 2
    assert not list(tmp_path.glob("*.tmp"))


# In update 3, after update 2's checkpoint; or just before update 2's checkpoint is written, which
# is then written whole before the signals are heard.
@pytest.mark.parametrize("phase, last", [("training", 2), ("saving", 2)])
def test_a_second_ctrl_c_aborts_at_once_naming_the_last_checkpoint(script, phase, last, tmp_path, monkeypatch,
                                                                   capsys):
    module = script.module
    real_update, real_save = module.Trainer.update_policy, module.save_checkpoint

    def update(self, rollout):
        if phase == "training" and self.update == 2:
            press_ctrl_c_twice()
        return real_update(self, rollout)

    def save(state, path):
        if phase == "saving" and state["update"] == 2:
            press_ctrl_c_twice()
        real_save(state, path)

    monkeypatch.setattr(module.Trainer, "update_policy", update)
    monkeypatch.setattr(module, "save_checkpoint", save)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1280, "--checkpoint-every", 1,
                                        "--run-dir", tmp_path)
    assert status == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"aborted by a second interrupt; the last checkpoint is {tmp_path / 'checkpoint.pt'}")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == last
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("in_update, status", [(2, 0), (1, 143)])
def test_a_sigterm_in_the_last_update_finds_nothing_to_stop(script, in_update, status, tmp_path, monkeypatch,
                                                             capsys):
    # A scheduler's SIGTERM that comes in the last update used to end the run as stopped (143): a job
    # requeued on that status then had its resume refused, every step being trained. It ends as done.
    real_update = script.module.Trainer.update_policy

    def update(self, rollout):
        if self.update + 1 == in_update:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_update(self, rollout)

    monkeypatch.setattr(script.module.Trainer, "update_policy", update)
    run_dir = tmp_path / "a run"  # the resume line quotes its path, so that it can be pasted into a shell
    got, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 256, "--run-dir", run_dir)
    assert got == status and "Traceback" not in stderr, stderr
    path = run_dir / "checkpoint.pt"
    assert stderr.strip().splitlines()[-1] == (f"done: 256 steps; checkpoint in {path}" if status == 0
                                               else f"stopped at update 1; resume with --resume '{path}'")
    assert torch.load(path, weights_only=True)["update"] == in_update


def test_a_ctrl_c_while_closing_does_not_cut_it_short(script, tmp_path, monkeypatch, capsys):
    real_close = script.module.Workers.close

    def close(self):
        if self.processes:
            os.kill(os.getpid(), signal.SIGINT)
        real_close(self)

    monkeypatch.setattr(script.module.Workers, "close", close)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)
    assert status == 0 and "Traceback" not in stderr and "done: 128 steps" in stderr, stderr


@pytest.mark.parametrize("interval", [0.0, 0.01, 0.1])
def test_ctrl_c_pressed_again_and_again_leaves_no_traceback_and_no_worker(script, interval, tmp_path):
    process = script.start(*script.tiny, "--total-timesteps", 10**7, "--run-dir", tmp_path)
    try:
        wait_for(process, "training on")
        time.sleep(2)
        workers = process_tree(process.pid)
        for _ in range(4):
            process.send_signal(signal.SIGINT)
            time.sleep(interval)
        _, errors = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, errors
    assert "Traceback" not in errors and "KeyboardInterrupt" not in errors, errors
    if "aborted" in errors:
        assert errors.strip().splitlines()[-1] in [
            f"aborted by a second interrupt; the last checkpoint is {tmp_path / 'checkpoint.pt'}",
            "aborted by a second interrupt; no checkpoint was written"]
    else:
        assert "stopped at update" in errors
    assert not list(tmp_path.glob("*.tmp"))
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)]


def test_ctrl_c_held_down_while_the_run_closes_changes_nothing(script, tmp_path):
    # Ctrl-C held down: after the stop it asked for, a signal every 0.2 ms until the process is gone,
    # through the closing of the workers, the freeing of the run's objects and the exit.
    process = script.start(*script.tiny, "--total-timesteps", 10**7, "--run-dir", tmp_path)
    try:
        wait_for(process, "training on")
        time.sleep(2)  # training has begun: a signal now asks for a stop
        process.send_signal(signal.SIGINT)
        wait_for(process, "stopped at update")
        while process.poll() is None:
            process.send_signal(signal.SIGINT)
            time.sleep(0.0002)
        rest = process.stderr.read()
    finally:
        process.kill()
    assert process.returncode == 130 and not rest.strip(), rest


def test_ctrl_c_while_the_libraries_load_is_exit_130_without_a_traceback(script, tmp_path):
    result = interrupted_while_loading([sys.executable, script.path, "--help"], tmp_path)
    assert (result.returncode, result.stderr) == (130, ""), result.stderr  # it was Python's traceback


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_the_workers_start(script, tmp_path, presses):
    # Spawned workers take seconds to import torch: long enough to press Ctrl-C while they start.
    process = script.start(*script.tiny, "--total-timesteps", 10**7, "--num-workers", 2, "--start-method", "spawn",
                           "--run-dir", tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not process_tree(process.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        workers = process_tree(process.pid)
        for _ in range(presses):
            process.send_signal(signal.SIGINT)
            time.sleep(0.05)
        _, errors = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "training on" not in errors, errors
    assert process.returncode == 130 and "Traceback" not in errors, errors
    # Before training begins there is nothing to save: the first press aborts (as in ppo_jax.py).
    assert "interrupted before training began; no checkpoint was written" in errors, errors
    assert not (tmp_path / "checkpoint.pt").exists()
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)]


def test_a_terminal_that_hangs_up_stops_the_run_with_a_checkpoint(script, tmp_path):
    # The terminal's window closed, its ssh connection dropped: the kernel sends the session SIGHUP,
    # which used to kill the run with all it had trained since its last checkpoint (none here).
    process, window = on_a_terminal([sys.executable, script.path, *map(str, [*script.tiny, "--total-timesteps", 10**7,
                                                                             "--checkpoint-every", 10**6, "--run-dir",
                                                                             tmp_path])], cwd=ROOT)
    try:
        read_until(window, "step ")  # the progress line: an update is done
        workers = process_tree(process.pid)
        os.close(window)
        assert process.wait(timeout=60) == 128 + signal.SIGHUP
    finally:
        process.kill()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] >= 1
    assert not list(tmp_path.glob("*.tmp"))
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.parametrize("start_method", ["default", "spawn"])
def test_a_sigterm_to_the_whole_process_group_stops_the_run_with_a_checkpoint(script, start_method, tmp_path):
    # As `kill -- -PGID` and SLURM's `scancel` send it: the workers hear it too, and leave it to the run.
    # Forked, they would also have the run's handler; spawned, only their own ignoring keeps them alive.
    process = subprocess.Popen([sys.executable, script.path, *map(str, [*script.tiny, "--total-timesteps", 10**7,
                                                                        "--start-method", start_method,
                                                                        "--run-dir", tmp_path])],
                               stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        wait_for(process, "training on")
        time.sleep(2)
        workers = process_tree(process.pid)
        os.killpg(process.pid, signal.SIGTERM)
        _, errors = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM and "stopped at update" in errors, errors
    assert "failed" not in errors and "died" not in errors and "Traceback" not in errors, errors
    time.sleep(0.5)
    assert not [pid for pid in workers if alive(pid)]


def test_a_run_that_outlives_its_terminal_trains_on(script, tmp_path):
    # A run left behind with `& disown` (or started under `nohup`) never hears the hang-up, but its
    # stdout and stderr are still the terminal: its next line there failed ("input/output error"),
    # and the run ended with it.
    process, window = on_a_terminal([sys.executable, script.path, *map(str, [*script.tiny, "--total-timesteps", 128 * 20,
                                                                             "--run-dir", tmp_path])],
                                    hangup=signal.SIG_IGN, cwd=ROOT)
    assert hang_up(process, window) == 0
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["global_step"] == 128 * 20


# ## A diverging update


def test_weights_that_become_infinite_are_refused_and_never_checkpointed(script, tmp_path, monkeypatch, capsys):
    real_gradients = script.module.Trainer.compute_gradients

    def gradients_then_an_overflowed_weight(self, loss, *args):
        real_gradients(self, loss, *args)  # a finite loss ...
        if self.update == 2:
            with torch.no_grad():
                weights = next(getattr(self, script.network).parameters())
                weights[(0,) * weights.dim()] = math.inf  # ... and a weight that overflowed, in update 3

    monkeypatch.setattr(script.module.Trainer, "compute_gradients", gradients_then_an_overflowed_weight)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1280, "--checkpoint-every", 1,
                                        "--run-dir", tmp_path)
    assert status == 1, stderr
    assert "NaN or infinite in update 3" in stderr and f"the last good checkpoint is {tmp_path}" in stderr
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["update"] == 2
    assert all(torch.isfinite(weights).all() for weights in checkpoint[script.network].values())
    monkeypatch.undo()
    status, out, stderr = script.run_main(capsys, "--eval", tmp_path / "checkpoint.pt", "--eval-episodes", 2)
    assert status == 0 and "nan" not in out, stderr


def test_eval_of_non_finite_weights_is_one_line(script, tmp_path, capsys):
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[0] == 0
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    weights = next(iter(checkpoint[script.network].values()))
    weights[(0,) * weights.dim()] = math.inf
    torch.save(checkpoint, tmp_path / "poisoned.pt")
    script.one_line_error(*script.run_main(capsys, "--eval", tmp_path / "poisoned.pt")[::2], script.non_finite)


# ## Bad numbers


def numeric_fields(script: Script) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(script.module.RunConfig)
    fields = []
    for field in dataclasses.fields(script.module.RunConfig):
        kinds = set(typing.get_args(hints[field.name])) - {type(None)} or {hints[field.name]}
        fields += [(field.name, kind) for kind in kinds if kind in (int, float)]
    return fields


def test_every_numeric_field_is_covered(script):
    assert {name for name, _ in numeric_fields(script)} >= {"seed", "ent_coef", "vf_coef", "learning_rate",
                                                            "num_workers", "checkpoint_every", "eval_episodes",
                                                            script.numeric}


@pytest.mark.parametrize("script, name, kind", [
    pytest.param(script, name, kind, id=f"{script_id}-{name}-{kind.__name__}")
    for script, script_id in zip(SCRIPTS, IDS) for name, kind in numeric_fields(script)])
def test_every_numeric_flag_refuses_what_cannot_work(script, name, kind, capsys):
    bad = ["nan", "inf", "-inf"] if kind is float else ["-1", "2.5"]  # an integer's flag takes no fraction
    for value in bad:
        script.one_line_error(*script.run_main(capsys, f"{flag(name)}={value}")[::2], flag(name))


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seeds_beyond_32_bits_are_refused(script, seed, capsys):
    script.one_line_error(*script.run_main(capsys, "--seed", seed)[::2], "--seed must be in [0, 2**32 - 1]")


def test_a_run_dir_that_is_a_file_is_refused(script, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    script.one_line_error(*script.run_main(capsys, "--run-dir", tmp_path / "file")[::2], "is a file, not a directory")


def test_a_run_dir_that_cannot_be_written_in_is_refused(script, tmp_path, capsys):
    # A file on the path: the one failure to make a directory that a test run as root still meets.
    (tmp_path / "file").write_text("")
    script.one_line_error(*script.run_main(capsys, *script.tiny, "--run-dir", tmp_path / "file" / "run")[::2],
                          f"cannot write in {tmp_path / 'file' / 'run'}: Not a directory")
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path / "run")[0] == 0
    script.one_line_error(*script.run_main(capsys, "--eval", tmp_path / "run" / "checkpoint.pt", "--eval-episodes", 1,
                                           "--capture-video", "--run-dir", tmp_path / "file" / "eval")[::2],
                          f"cannot write in {tmp_path / 'file' / 'eval' / 'videos'}: Not a directory")


# ## A full disk


# A full disk, a quota on a cluster's shared file system, a disk that fails: each is the system's own words in
# one line, naming the checkpoint that is still whole.
@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left on device"),
                                         (errno.EDQUOT, "disk quota exceeded"), (errno.EIO, "input/output error")],
                         ids=["ENOSPC", "EDQUOT", "EIO"])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(script, code, words, tmp_path, monkeypatch,
                                                                    capsys):
    real_replace = os.replace
    written = []

    def replace_until_the_disk_fills(source, destination):
        written.append(source)
        if len(written) == 2:
            raise OSError(code, os.strerror(code), str(source))
        return real_replace(source, destination)

    monkeypatch.setattr(script.module.os, "replace", replace_until_the_disk_fills)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1280, "--checkpoint-every", 1,
                                        "--run-dir", tmp_path)
    assert status == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"{script.name}: error: {words} while writing {tmp_path / 'checkpoint.pt'}; "
        f"the last checkpoint is {tmp_path / 'checkpoint.pt'}")
    assert str(os.getpid()) in str(written[0])  # a temporary file of this process's own
    assert not list(tmp_path.glob("*.tmp"))
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 1


def test_a_really_full_disk_is_one_line_and_keeps_the_last_checkpoint(script, tmp_path, capsys):
    # Filesystems of their own, mounted in a namespace of this test's (where the system allows it). On the first, the
    # first checkpoint fits and a second beside it does not (written by torch straight to the file, a full disk was a
    # RuntimeError of its zip writer); on the second, 8 kB, TensorBoard's events fill it before any checkpoint is due
    # (its writer's thread died of it, and the run ended in two tracebacks).
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here to mount a small filesystem in")
    first_fits = {"ppo_atari.py": "30m", "vpg_continuous.py": "700k"}[script.name]  # its checkpoint: 20 MB, 430 kB
    for size, steps, every in [(first_fits, 1280, 1), ("8k", 12800, 1000)]:
        disk = tmp_path / f"disk-{size}"
        disk.mkdir()
        run, args = disk / "run", " ".join(map(str, script.tiny))
        command = (f"mount -t tmpfs -o size={size} tmpfs {disk} && {sys.executable} {script.path} {args} "
                   f"--total-timesteps {steps} --checkpoint-every {every} --run-dir {run}; echo status $?; ls {run}")
        if every == 1:  # the update of the checkpoint left, read back
            command += f"; {sys.executable} -c 'import torch; print(torch.load(\"{run}/checkpoint.pt\")[\"update\"])'"
        result = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=300)
        assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr, result.stderr
        status, *files = result.stdout.split()
        assert status == "status" and files[0] == "1" and not [name for name in files if name.endswith(".tmp")]
        line = [line for line in result.stderr.splitlines() if line.startswith(script.name)][0]
        if every == 1:
            assert line == (f"{script.name}: error: no space left on device while writing {run}/checkpoint.pt; "
                            f"the last checkpoint is {run}/checkpoint.pt")
            assert files[-1] == "1"  # the first checkpoint, whole
        else:
            assert line == f"{script.name}: error: no space left on device while writing {run}; none was written"
            assert "checkpoint.pt" not in files
    # --eval's videos, on 16 kB: the first game's does not fit. (vpg_continuous.py closes that video again as it
    # closes its tasks: the second close now does nothing, where it raised an error of its own over the first.)
    trained = tmp_path / "trained"
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", trained)[0] == 0
    disk = tmp_path / "disk-eval"
    disk.mkdir()
    command = (f"mount -t tmpfs -o size=16k tmpfs {disk} && {sys.executable} {script.path} --eval {trained}/checkpoint.pt "
               f"--eval-episodes 2 --capture-video --run-dir {disk}/eval; echo status $?")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr and result.stdout.split() == ["status", "1"], result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"{script.name}: error: no space left on device while writing "
                                                      f"{disk}/eval/videos; the last checkpoint is {trained}/checkpoint.pt")


# ## Two runs, one directory


def test_a_second_run_in_a_run_dir_in_use_is_refused(script, tmp_path, capsys):
    process = script.start(*script.tiny, "--total-timesteps", 10**7, "--run-dir", tmp_path)
    try:
        wait_for(process, "training on")
        script.one_line_error(*script.run_main(capsys, *script.tiny, "--total-timesteps", 128,
                                               "--run-dir", tmp_path)[::2],
                              f"{tmp_path} is in use by another run (process {process.pid})")
    finally:
        process.kill()
        process.communicate()
    # The lock dies with its process: the directory is free again.
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[0] == 0


def test_resuming_a_run_that_has_trained_all_its_steps_is_refused(script, tmp_path, capsys):
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[0] == 0
    script.one_line_error(*script.run_main(capsys, "--resume", tmp_path / "checkpoint.pt")[::2],
                          "steps, all that --total-timesteps 128 allows; to train on, resume with a larger one")


def test_resuming_into_another_runs_directory_is_refused(script, tmp_path, capsys):
    for name in ["a", "b"]:
        assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path / name)[0] == 0
    before = (tmp_path / "b" / "checkpoint.pt").read_bytes()
    script.one_line_error(*script.run_main(capsys, "--resume", tmp_path / "a" / "checkpoint.pt",
                                           "--total-timesteps", 256, "--run-dir", tmp_path / "b")[::2],
                          "already holds another run's checkpoint")
    assert (tmp_path / "b" / "checkpoint.pt").read_bytes() == before


def test_a_new_run_in_the_directory_of_a_ppo_jax_run_is_refused(script, tmp_path, capsys):
    # Each script checked for its own checkpoint only, so a run of another wrote its events beside
    # the first run's, and TensorBoard drew the two as one.
    (tmp_path / "checkpoint.msgpack").write_bytes(b"ppo_jax.py's")
    script.one_line_error(*script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[::2],
                          f"{tmp_path} already holds a run of ppo_jax.py (checkpoint.msgpack); choose another --run-dir")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint.msgpack", "run.lock"]


# ## Start-up faults


def stuck_workers(module):
    """The script's `Workers` of one game or env whose steps never return, like a simulator stuck in a loop."""
    if module.__name__ == "ppo_atari":
        import ppo_atari_helpers

        return module.Workers(ppo_atari_helpers.ENV_ID, 1, 1, 0, {}, make_env=ppo_atari_helpers.make_stuck_env)
    from vpg_continuous_helpers import StuckTask

    return module.Workers("Pendulum-v1", 1, 1, 0, module.describe_env("Pendulum-v1"), make_task=StuckTask)


def test_close_kills_a_worker_stuck_in_its_env(script):
    with deadline(60):
        workers = stuck_workers(script.module)
        workers.reset()
        workers._send(b"step")  # as `step` does; the answer never comes, and a Ctrl-C ends the wait
        pids = [process.pid for process in workers.processes]
        workers.close()
    left = living(pids)
    for pid in left:  # so that a failure here leaves no process for pytest's exit to wait on
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_a_worker_that_dies_before_it_is_ready_is_one_message(script, tmp_path, monkeypatch, capsys):
    script.make_envs_fail(monkeypatch, lambda *args, **kwargs: os._exit(3))
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--start-method", "fork",
                                        "--run-dir", tmp_path)
    assert status == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == [
        f"worker 0 (pid {stderr.split('(pid ')[1].split(')')[0]}) died unexpectedly (exit code 3)",
        "the workers did not start; no training was done"]


def test_an_env_that_cannot_be_made_shows_the_workers_traceback_once(script, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no simulator here")

    script.make_envs_fail(monkeypatch, broken)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--start-method", "fork",
                                        "--run-dir", tmp_path)
    assert status == 1, stderr
    assert stderr.count("Traceback") == 1 and "RuntimeError: no simulator here" in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "the workers did not start; no training was done"


def test_a_worker_that_fails_while_training_shows_its_traceback_and_the_weights_are_saved(script, tmp_path,
                                                                                         monkeypatch, capsys):
    # Each game plays 64 steps an update: its 100th step is in the second update's rollout, so the
    # weights of the first update are whole, and written before the failure is reported.
    real_step = script.env_class.step

    def step(self, action):
        self.steps_played = getattr(self, "steps_played", 0) + 1
        if self.steps_played == 100:
            raise RuntimeError("the simulator broke")
        return real_step(self, action)

    monkeypatch.setattr(script.env_class, "step", step)  # workers started by `fork` see it
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 512, "--start-method", "fork",
                                        "--run-dir", tmp_path)
    assert status == 1, stderr
    assert stderr.count("Traceback") == 1 and "RuntimeError: the simulator broke" in stderr, stderr
    assert stderr.strip().splitlines()[-1] == f"checkpoint of update 1 saved in {tmp_path / 'checkpoint.pt'}"
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 1
    monkeypatch.undo()
    status, _, stderr = script.run_main(capsys, "--resume", tmp_path / "checkpoint.pt")
    assert status == 0, stderr
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 4


def test_ctrl_c_while_evaluating_is_one_line_and_exit_130(script, tmp_path, monkeypatch, capsys):
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[0] == 0

    def step(self, action):
        raise KeyboardInterrupt  # what Python's own handler of Ctrl-C raises in the main thread

    monkeypatch.setattr(script.env_class, "step", step)
    status, _, stderr = script.run_main(capsys, "--eval", tmp_path / "checkpoint.pt", "--eval-episodes", 2)
    assert status == 130 and stderr.strip().splitlines() == [f"{script.name}: interrupted"], stderr


@pytest.mark.parametrize("edit, message", [
    (lambda checkpoint: checkpoint.update(config=None), "holds config of another kind: it was edited"),
    (lambda checkpoint: checkpoint.update(update="four"), "holds update of another kind: it was edited"),
    (lambda checkpoint: checkpoint.update(torch_rng=None), "holds torch_rng of another kind: it was edited"),
    (lambda checkpoint: checkpoint["config"].update(num_envs="2"), "holds settings of the wrong kind"),
])
def test_a_checkpoint_edited_by_hand_is_one_line(script, edit, message, tmp_path, capsys):
    # Each of these was a traceback (an AttributeError, a TypeError), or in --eval a run that went on.
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[0] == 0
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, tmp_path / "edited.pt")
    for command in ("--resume", "--eval"):
        script.one_line_error(*script.run_main(capsys, command, tmp_path / "edited.pt")[::2], message)


def test_a_checkpoint_missing_a_field_is_one_line(script, tmp_path, capsys):
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128, "--run-dir", tmp_path)[0] == 0
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del checkpoint[script.missing]
    torch.save(checkpoint, tmp_path / "older.pt")
    script.one_line_error(*script.run_main(capsys, "--eval", tmp_path / "older.pt")[::2], f"lacks {script.missing}")
