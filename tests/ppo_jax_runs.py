"""What the tests of ppo_jax.py share: running the script as a user does, and reading what a run leaves."""

import os
import subprocess
import sys
from pathlib import Path

import flax.serialization
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT
from processes import alive, children_of  # noqa: F401 (used by the tests that import this)

SCRIPT = str(ROOT / "ppo_jax.py")


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """The environment of the script's runs: JAX's compilation cache shared by them, so that a run
    whose program an earlier one compiled (the same configuration again, say) loads it instead."""
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache"))}


@pytest.fixture(scope="module")
def run(environment):
    """`run(*args)`: `python ppo_jax.py ARGS`, finished, with its output."""

    def run(*args, timeout=300):
        return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=environment)

    return run


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_checkpoint(path: Path) -> dict:
    return flax.serialization.msgpack_restore(Path(path).read_bytes())

