"""The pieces each script holds its own copy of behave alike.

No script imports another, so that each can be copied alone into a fork; where two need the same
piece (GAE, the schedules, the command line's helpers, the handling of Ctrl-C), each has its own
copy, and these tests keep the copies from drifting apart."""

import ast
import dataclasses
import inspect
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ppo_atari
import vpg_continuous as vpg


@pytest.mark.parametrize("seed", range(3))
def test_gae_is_the_same(seed):
    rng = np.random.default_rng(seed)
    shape = (30, 4)
    floats = [torch.tensor(rng.normal(size=shape), dtype=torch.float32) for _ in range(3)]
    ends = [torch.tensor(rng.random(shape) < 0.1) for _ in range(2)]
    for gamma, gae_lambda in [(0.99, 0.95), (0.99, 0.97), (0.9, 1.0)]:
        ours = vpg.compute_gae(*floats, *ends, gamma, gae_lambda)
        theirs = ppo_atari.compute_gae(*floats, *ends, gamma, gae_lambda)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_schedules_statistics_and_formats_are_the_same():
    for update in [0, 1, 50, 99]:
        assert vpg.linear_schedule(1e-3, update, 100) == ppo_atari.linear_schedule(1e-3, update, 100)
    targets, predictions = torch.randn(100), torch.randn(100)
    assert vpg.explained_variance(predictions, targets) == ppo_atari.explained_variance(predictions, targets)
    for text in ["12", "1e6", "1_000_000", "2.0e3"]:
        assert vpg.parse_int(text) == ppo_atari.parse_int(text)
    for seconds in [0.0, 59.9, 3600.0, 86_399.0, float("inf")]:
        assert vpg.format_duration(seconds) == ppo_atari.format_duration(seconds)


def test_the_command_line_is_derived_the_same_way():
    @dataclasses.dataclass
    class Example:
        steps: int = 3
        """How many   steps,
        over two lines."""
        name: str = "x"
        undocumented: float = 1.0

    @dataclasses.dataclass
    class Extended(Example):
        more: bool = False
        """A field of the subclass."""

    assert vpg.field_docs(Example) == ppo_atari.field_docs(Example) == {"steps": "How many steps, over two lines."}
    # A subclass's fields are documented beside those it inherits, as `RunConfig`'s beside `Config`'s.
    assert vpg.field_docs(Extended) == ppo_atari.field_docs(Extended) == {"steps": "How many steps, over two lines.",
                                                                          "more": "A field of the subclass."}
    shared = {f.name for f in dataclasses.fields(vpg.RunConfig)} & {f.name for f in dataclasses.fields(ppo_atari.RunConfig)}
    assert {"env", "total_timesteps", "num_envs", "num_steps", "seed", "device", "run_dir", "checkpoint_every",
            "resume", "eval", "eval_episodes", "capture_video"} <= shared
    assert vpg.RUN_OPTIONS - {"eval_deterministic"} == ppo_atari.RUN_OPTIONS - {"precision"}


def class_source(script: str, name: str) -> str:
    """The source text of a top-level class of a script, read without importing the script (importing
    ppo_jax.py here would start JAX before the other tests fork their workers)."""
    path = Path(__file__).resolve().parent.parent / script
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"{script} has no class {name}")


def test_the_three_scripts_decide_on_signals_with_one_stop_request():
    # How a signal is heard and how a run aborts differ (ppo_jax.py's main thread sits in XLA, so a
    # thread of its own hears them, `SignalThread`); what a signal does is decided by one text.
    texts = {script: class_source(script, "StopRequest") for script in ["ppo_atari.py", "vpg_continuous.py", "ppo_jax.py"]}
    assert len(set(texts.values())) == 1, "the StopRequest copies differ"


def stop_request_class():
    """The shared `StopRequest`, taken from its source as every script has it, with aborts recorded."""
    namespace = {"signal": signal, "sys": sys, "time": time}
    exec("from __future__ import annotations\n" + class_source("ppo_jax.py", "StopRequest"), namespace)

    class Recorded(namespace["StopRequest"]):
        def abort(self, why, signum):
            self.aborts.append((why, signum))

    return Recorded


def test_what_a_signal_does_in_each_phase_of_a_run():
    stop = stop_request_class()(announce=False)
    stop.aborts = []
    stop.handle(signal.SIGINT)  # before training: nothing to save, abort at once
    assert not stop() and stop.aborts == [("interrupted before training began", signal.SIGINT)]
    stop.training, stop.aborts = True, []
    stop.handle(signal.SIGTERM)  # the first in training: a request
    assert stop() and stop.signal == signal.SIGTERM and stop.aborts == []
    stop.handle(signal.SIGINT)  # a second, however soon, in one process: abort
    assert stop.aborts == [("aborted by a second interrupt", signal.SIGINT)]


def test_two_signals_at_once_are_one_request_among_ranks():
    stop = stop_request_class()(announce=False, same_within=0.5)
    stop.training, stop.aborts = True, []
    stop.handle(signal.SIGINT)
    stop.handle(signal.SIGINT)  # torchrun passes on the terminal's Ctrl-C: the same request
    assert stop() and stop.aborts == []
    time.sleep(0.6)
    stop.handle(signal.SIGINT)
    assert stop.aborts == [("aborted by a second interrupt", signal.SIGINT)]


@pytest.mark.parametrize("module", [ppo_atari, vpg], ids=["ppo_atari", "vpg_continuous"])
def test_the_pytorch_scripts_abort_by_raising_in_the_main_thread(module):
    before = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN in a shell's background job
    with module.StopRequest(announce=False) as stop:
        with pytest.raises(module.Aborted) as raised:
            os.kill(os.getpid(), signal.SIGTERM)  # before training
        assert raised.value.status == 143 and raised.value.why == "interrupted before training began"
        stop.training = True
        os.kill(os.getpid(), signal.SIGINT)
        assert stop() and stop.signal == signal.SIGINT
        with pytest.raises(module.Aborted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.status == 130 and raised.value.why == "aborted by a second interrupt"
    assert signal.getsignal(signal.SIGINT) is before


FAULT_PIECES = ["DiskFull", "save_checkpoint", "signals_held", "last_checkpoint", "run_dir_lock",
                "undo_non_finite_updates", "aborted", "ignore_interrupts", "ignore_signal"]


@pytest.mark.parametrize("module", [ppo_atari, vpg], ids=["ppo_atari", "vpg_continuous"])
def test_signals_while_closing_are_dropped_by_a_function_not_sig_ign(module, capfd):
    # Under SIG_IGN, a Ctrl-C that arrives while the handler is being set reaches Python after it,
    # and Python prints a traceback for it ("Signal 2 ignored due to race condition"), which the
    # repeated Ctrl-C test met about once in many runs. A handler that does nothing drops it.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        module.ignore_interrupts()
        for sig in before:
            assert signal.getsignal(sig) is module.ignore_signal
            os.kill(os.getpid(), sig)
        time.sleep(0.1)
        module.ignore_interrupts(for_good=True)  # after `main`: SIG_IGN, which the interpreter's shutdown keeps
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("name", FAULT_PIECES)
def test_the_pytorch_scripts_handle_faults_with_one_text(name):
    # The full disk, the lock of the run directory, the undone update and the second Ctrl-C: the
    # two PyTorch scripts say and do the same, so the README describes them once.
    texts = [inspect.getsource(getattr(module, name)) for module in (ppo_atari, vpg)]
    assert texts[0] == texts[1], f"the copies of {name} differ"
