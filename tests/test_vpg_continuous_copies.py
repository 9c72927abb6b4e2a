"""The pieces each script holds its own copy of behave alike.

No script imports another, so that each can be copied alone into a fork; where two need the same
piece (GAE, the schedules, the command line's helpers, the handling of Ctrl-C), each has its own
copy, and these tests keep the copies from drifting apart."""

import ast
import dataclasses
import inspect
import os
import signal
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

    assert vpg.field_docs(Example) == ppo_atari.field_docs(Example) == {"steps": "How many steps, over two lines."}
    shared = {f.name for f in dataclasses.fields(vpg.Config)} & {f.name for f in dataclasses.fields(ppo_atari.Config)}
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


def test_the_stop_requests_of_the_pytorch_scripts_are_one_text():
    # ppo_jax.py's StopRequest is its own design: it must act while XLA compiles or runs a chunk,
    # when no Python frame is there to raise into, so a thread watches the signals and a second one
    # exits the process. Its behaviour is tested in tests/test_ppo_jax_faults.py.
    texts = {script: class_source(script, "StopRequest") for script in ["ppo_atari.py", "vpg_continuous.py"]}
    assert len(set(texts.values())) == 1, "the StopRequest copies differ"


@pytest.mark.parametrize("module", [ppo_atari, vpg], ids=["ppo_atari", "vpg_continuous"])
def test_a_second_ctrl_c_aborts_in_one_process_and_is_the_same_request_among_ranks(module):
    # One process: the first Ctrl-C asks for a stop, the second, however soon, aborts.
    with module.StopRequest(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop() and stop.signal == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    # Among several ranks a terminal's Ctrl-C arrives twice at once: within `same_within` it is one.
    with module.StopRequest(announce=False, same_within=0.5) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop() and stop.signal == signal.SIGTERM
        time.sleep(0.6)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


FAULT_PIECES = ["DiskFull", "save_checkpoint", "last_checkpoint", "run_dir_lock", "undo_non_finite_updates",
                "aborted", "ignore_interrupts"]


@pytest.mark.parametrize("name", FAULT_PIECES)
def test_the_pytorch_scripts_handle_faults_with_one_text(name):
    # The full disk, the lock of the run directory, the undone update and the second Ctrl-C: the
    # two PyTorch scripts say and do the same, so the README describes them once.
    texts = [inspect.getsource(getattr(module, name)) for module in (ppo_atari, vpg)]
    assert texts[0] == texts[1], f"the copies of {name} differ"
