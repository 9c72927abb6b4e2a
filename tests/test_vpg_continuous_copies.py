"""The pieces each script holds its own copy of behave alike.

No script imports another, so that each can be copied alone into a fork; where two need the same
piece (GAE, the schedules, the command line's helpers, the handling of Ctrl-C), each has its own
copy, and these tests keep the copies from drifting apart."""

import ast
import dataclasses
import inspect
import os
import pty
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
        assert vpg.integer(text) == ppo_atari.integer(text)
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

    def invocation(module):  # the settings of one invocation: the fields `RunConfig` adds to `Config`
        return {f.name for f in dataclasses.fields(module.RunConfig)} - {f.name for f in dataclasses.fields(module.Config)}

    assert invocation(vpg) - {"eval_deterministic"} == invocation(ppo_atari) - {"precision"}


def class_source(script: str, name: str) -> str:
    """The source text of a top-level class of a script, read without importing the script (importing
    ppo_jax.py here would start JAX before the other tests fork their workers)."""
    path = Path(__file__).resolve().parent.parent / script
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"{script} has no class {name}")


SCRIPTS = pytest.mark.parametrize("module", [ppo_atari, vpg], ids=["ppo_atari", "vpg_continuous"])


@SCRIPTS
def test_a_terminal_that_is_gone_becomes_dev_null(module):
    window, terminal = pty.openpty()
    stream = module.Terminal(os.fdopen(terminal, "w"))
    try:
        os.close(window)  # the terminal hangs up: writing there fails ("input/output error")
        print("a line for nobody", file=stream, flush=True)
        assert os.readlink(f"/proc/self/fd/{terminal}") == os.devnull
        print("and another", file=stream, flush=True)
    finally:
        stream.close()


def test_ppo_jax_has_the_same_terminal():
    assert class_source("ppo_jax.py", "Terminal") == class_source("ppo_atari.py", "Terminal")


@SCRIPTS
def test_what_a_signal_does_in_each_phase_of_a_run(module):
    signals = module.Signals(announce=False)
    with pytest.raises(module.Aborted) as raised:
        signals.handle(signal.SIGINT)  # before training: nothing to save, abort at once
    assert str(raised.value) == "interrupted before training began" and signals.requested is None
    signals.training = True
    signals.handle(signal.SIGTERM)  # the first in training: a request
    assert signals.requested == signal.SIGTERM
    with pytest.raises(module.Aborted) as raised:
        signals.handle(signal.SIGINT)  # a second, however soon, in one process: abort
    assert str(raised.value) == "aborted by a second interrupt" and raised.value.status == 130


@SCRIPTS
def test_signals_wait_while_a_checkpoint_is_written_and_are_dropped_while_closing(module):
    signals = module.Signals(announce=False)
    signals.training = True
    with pytest.raises(module.Aborted):
        with signals.held():
            signals.handle(signal.SIGINT)
            signals.handle(signal.SIGINT)
            assert signals.requested is None  # held back: the block goes on to its end
    assert signals.requested == signal.SIGINT  # then handled as they came: a request, and an abort
    signals.closing = True
    signals.handle(signal.SIGINT)  # while closing: dropped


@SCRIPTS
def test_a_signal_the_moment_a_closing_run_gives_back_the_handler_finds_the_run_closed(module, monkeypatch):
    # The script's own handler drops signals once `Signals.closed` says the run let go while closing.
    # It can run as soon as it is given back, before `__exit__` returns: CI once saw a traceback so.
    monkeypatch.setattr(module.Signals, "closed", False)
    seen, give_back = [], signal.signal

    def signal_arriving_at_once(signum, handler):
        previous = give_back(signum, handler)
        if handler is own_handler:
            handler(signum, None)
        return previous

    def own_handler(signum, frame):
        seen.append(module.Signals.closed)

    before = signal.signal(signal.SIGINT, own_handler)
    try:
        with module.Signals(announce=False) as signals:
            monkeypatch.setattr(signal, "signal", signal_arriving_at_once)
            signals.closing = True
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, before)
    assert seen == [True]


@SCRIPTS
def test_two_signals_at_once_are_one_request_among_ranks(module):
    signals = module.Signals(announce=False, same_within=0.5)
    signals.training = True
    signals.handle(signal.SIGINT)
    signals.handle(signal.SIGINT)  # torchrun passes on the terminal's Ctrl-C: the same request
    assert signals.requested == signal.SIGINT
    time.sleep(0.6)
    with pytest.raises(module.Aborted):
        signals.handle(signal.SIGINT)


@SCRIPTS
def test_the_pytorch_scripts_abort_by_raising_in_the_main_thread(module):
    before = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN in a shell's background job
    with module.Signals(announce=False) as signals:
        with pytest.raises(module.Aborted) as raised:
            os.kill(os.getpid(), signal.SIGTERM)  # before training
        assert raised.value.status == 143 and str(raised.value) == "interrupted before training began"
        signals.training = True
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.requested == signal.SIGINT
        with pytest.raises(module.Aborted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.status == 130 and str(raised.value) == "aborted by a second interrupt"
        signals.closing = True
        os.kill(os.getpid(), signal.SIGINT)  # dropped by the same handler: no race with a change of handlers
    assert signal.getsignal(signal.SIGINT) is before
    assert module.Signals.closed  # so the script's own handler drops what comes after
    with module.Signals(announce=False):
        pass
    assert not module.Signals.closed  # a run that did not close, for the next run in this process


# Every definition that ppo_atari.py and vpg_continuous.py hold as the same text, listed once: a
# change to one copy fails here until the other has it too (the README describes the pieces once).
SAME_TEXT = [
    # Part 1
    "linear_schedule", "explained_variance", "NonFiniteError",
    # Part 2
    "WorkerError", "numpy_views", "STOP_SIGNALS",
    # Part 3: the command line, checkpoints and faults, logging, signals, the run, tracking, video
    "ConfigError", "field_docs", "integer", "OneLineParser", "flag", "parse_config", "WriteFailed", "written", "save_checkpoint",
    "last_checkpoint", "writable_dir", "run_dir_lock", "format_duration", "how_many", "default_run_dir", "timer", "Aborted", "Stopped", "Signals", "Terminal",
    "check_rollout_fits",
    "import_wandb", "start_tracking", "send_new_videos", "Video",
    # Part 4
    "RankFailure", "exit_process",
]

# The near copies: the same text once each pair (ppo_atari.py's text, vpg_continuous.py's) is
# swapped, but for their docstrings, which say what differs and why. The pairs are each script's
# own words, and the few lines that are its own.
SCRIPT_NAMES = [("ppo_atari.py", "vpg_continuous.py")]
NEAR_COPIES = {
    "RunTrainer": [("class RunTrainer(FastSamplingTrainer):", "class RunTrainer(Trainer):"),
                   # ppo_atari.py's own: Part 2's trainer takes the precision of the torso.
                   ("super().__init__(config, envs, device, bf16=use_bf16(config.precision, device))",
                    "super().__init__(config, envs, device)")],
    "RunWorkers": [],
    "load_checkpoint": SCRIPT_NAMES,
}


def definition_source(script: str, name: str, docstring: bool = True) -> str:
    """The source text of a top-level definition (class, function or assignment) of a script, read
    from its file; without `docstring`, less the definition's own docstring."""
    source = (Path(__file__).resolve().parent.parent / script).read_text()
    for node in ast.parse(source).body:
        names = [target.id for target in getattr(node, "targets", []) if isinstance(target, ast.Name)]
        if getattr(node, "name", None) == name or name in names:
            text = ast.get_source_segment(source, node, padded=True)
            first = node.body[0] if isinstance(node, (ast.ClassDef, ast.FunctionDef)) else None
            if not docstring and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                text = text.replace(ast.get_source_segment(source, first, padded=True), "", 1)
            return text
    raise AssertionError(f"{script} has no definition {name}")


@pytest.mark.parametrize("name", SAME_TEXT)
def test_the_pytorch_scripts_share_one_text(name):
    assert definition_source("ppo_atari.py", name) == definition_source("vpg_continuous.py", name), \
        f"the copies of {name} differ"


@pytest.mark.parametrize("name", NEAR_COPIES)
def test_the_near_copies_differ_only_where_they_say(name):
    ours = definition_source("ppo_atari.py", name, docstring=False)
    for theirs_in_ppo, in_vpg in NEAR_COPIES[name]:
        assert theirs_in_ppo in ours, f"{name}: ppo_atari.py no longer has {theirs_in_ppo!r}"
        ours = ours.replace(theirs_in_ppo, in_vpg)
    assert ours == definition_source("vpg_continuous.py", name, docstring=False), f"the copies of {name} differ"


def test_every_definition_the_scripts_share_is_listed():
    # A new definition written the same in both (or the same but for a word) joins one of the lists
    # above, so that the copies cannot drift apart unnoticed.
    def names(script):
        tree = ast.parse((Path(__file__).resolve().parent.parent / script).read_text())
        return {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))} | {
            target.id for node in tree.body for target in getattr(node, "targets", []) if isinstance(target, ast.Name)}

    same = {name for name in names("ppo_atari.py") & names("vpg_continuous.py")
            if definition_source("ppo_atari.py", name) == definition_source("vpg_continuous.py", name)}
    assert same == set(SAME_TEXT)
