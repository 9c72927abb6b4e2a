"""What the tests of ppo_jax.py share: running the script as a user does, and reading what a run leaves."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import flax.serialization
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT
from processes import alive, children_of  # noqa: F401 (used by the tests that import this)

SCRIPT = str(ROOT / "ppo_jax.py")


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """The environment of the script's runs: one JAX compilation cache for all the tests of the session,
    in every test process of xdist's, so that a run whose programs an earlier one compiled (the same
    configuration in another test, say, in either process) loads them instead. It keeps every program:
    JAX's default keeps only those that took over a second to compile, and a small run compiles a dozen
    of 0.1 s each. A size limit (never reached) is what makes JAX lock the cache while it reads or writes
    an entry, so that one process never reads an entry another is still writing."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax-cache"
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(2**34)}


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


def note_dispatches(monkeypatch, ppo_jax, note) -> None:
    """Have every chunk the command line dispatches call `note(its number of updates)` first."""
    compile_train_chunk = ppo_jax.compile_train_chunk

    def recording(*args, **kwargs):
        train_chunk = compile_train_chunk(*args, **kwargs)

        def dispatch(runners, count):
            note(int(count))
            return train_chunk(runners, count)

        return dispatch

    monkeypatch.setattr(ppo_jax, "compile_train_chunk", recording)


def read_checkpoint(path: Path) -> dict:
    return flax.serialization.msgpack_restore(Path(path).read_bytes())



def patched(code: str) -> list[str]:
    """The command line of a `python ppo_jax.py` that first runs `code` (Python, with `ppo_jax` imported): a fault
    injected into the script as a user would run it, forked workers included (they inherit the patch)."""
    return [sys.executable, "-c", f"import sys, ppo_jax\n{code}\nsys.exit(ppo_jax.main(sys.argv[1:]))"]


class Watched:
    """A `ppo_jax.py` process started in the background, its stderr read line by line with the time each came."""

    def __init__(self, command: list[str], environment: dict):
        self.process = subprocess.Popen([*map(str, command)], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                        env=environment)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float = 180) -> float:
        """The time the first line holding `text` came, waiting for it at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if text in line:
                    return when
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        self.process.kill()
        raise AssertionError(f"no line with {text!r}:\n{self.stderr}")

    def finish(self, timeout: float = 120) -> int:
        try:
            self.process.wait(timeout)
        finally:
            self.process.kill()
            self.reader.join(10)
        return self.process.returncode

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)
