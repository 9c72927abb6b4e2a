"""ppo_jax.py under faults a user meets: bad numbers, Ctrl-C at any moment, a diverging run, a full disk, two
runs in one directory, damaged checkpoints, workers that cannot start. Each is one line and an exit status,
never a traceback, and every checkpoint a message names exists."""

import dataclasses
import signal
import subprocess
import sys
import time
import typing

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ppo_jax
from conftest import ROOT
from ppo_jax_runs import SCRIPT, Watched, environment, patched, read_checkpoint, run  # noqa: F401 (fixtures)


def ppo_jax_run(environment, command, *args, timeout=300):
    """`command ARGS` (a `patched` ppo_jax.py), finished, with its output."""
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=environment)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def main_error(capsys, *args) -> str:
    """`ppo_jax.main(ARGS)`, which must exit 2 with one line on stderr: that line."""
    try:
        status = ppo_jax.main([*map(str, args)])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    assert status == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("ppo_jax.py: error: "), line
    return line


# ## Every number on the command line, checked before any work

INT32 = "3e9"  # more than JAX's 32-bit counts hold
BAD_NUMBERS = {
    **{name: [("0", "must be positive"), ("-3", "must be positive"), (INT32, "must be at most 2,147,483,647")]
       for name in ["num_seeds", "num_envs", "num_steps", "num_minibatches", "update_epochs", "frame_skip",
                    "max_episode_frames", "checkpoint_every", "eval_episodes"]},
    "total_timesteps": [("0", "must be positive"), ("1e20", "updates, more than the 2,147,483,647")],
    **{name: [("-1", "must not be negative"), (INT32, "must be at most 2,147,483,647")]
       for name in ["noop_max", "num_workers"]},
    "seed": [("-1", "must be in [0, 4294967295]"), ("4294967296", "must be in [0, 4294967295]"),
             ("1e30", "must be in [0, 4294967295]")],
    **{name: [("0", "must be positive"), ("-1", "must be positive"), ("inf", "must be a finite number, not inf"),
              ("nan", "must be a finite number, not nan")]
       for name in ["learning_rate", "clip_range", "max_grad_norm", "target_kl"]},
    **{name: [("1.5", "must be in [0, 1]"), ("-0.1", "must be in [0, 1]"), ("inf", "must be a finite number"),
              ("nan", "must be a finite number")]
       for name in ["gamma", "gae_lambda", "sticky_actions"]},
    **{name: [("-1", "must not be negative"), ("inf", "must be a finite number, not inf"),
              ("nan", "must be a finite number, not nan")]
       for name in ["ent_coef", "vf_coef"]},
}


def numeric_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [field.name for field in dataclasses.fields(cls) if hints[field.name] in (int, float, float | None)]


@pytest.mark.parametrize("name", numeric_fields(ppo_jax.RunConfig))
def test_a_bad_number_exits_2_before_any_work(name, capsys, tmp_path):
    # Every numeric flag (one with no bad values listed above fails here), each of its bad values; a short
    # run, should one be taken.
    flag = "--" + name.replace("_", "-")
    for value, message in BAD_NUMBERS[name]:
        line = main_error(capsys, "--total-timesteps", 1024, f"{flag}={value}", "--run-dir", tmp_path / "run")
        assert line.startswith(f"ppo_jax.py: error: {flag} ") and message in line, line
        assert not (tmp_path / "run").exists()


def test_a_run_dir_that_is_a_file_exits_2(capsys, tmp_path):
    (tmp_path / "taken").write_text("")
    assert f"--run-dir {tmp_path / 'taken'} is a file, not a directory" in main_error(capsys, "--run-dir",
                                                                                       tmp_path / "taken")
