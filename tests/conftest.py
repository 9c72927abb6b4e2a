"""Shared set-up: the scripts live at the repository root and are imported as modules, and each
test process gets its share of the cores."""

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Under pytest-xdist, each test process runs PyTorch on its share of the cores, and so do the
# scripts its tests start (they inherit the setting). PyTorch's CPU threads wait for each other by
# spinning, and two processes whose threads together outnumber the cores can keep each other
# spinning. On 2 cores of an AMD EPYC, beside a process multiplying matrices on both cores, 16
# minibatch steps of `ppo_atari.py`'s network in bfloat16 took 2.7 s in 2 runs of 6, 31 s in one,
# and did not finish within a minute in the other 3; with one thread in each process, 1.2 s in all
# 6 (`python benchmarks/shared_cores.py`, then `--threads 1 --neighbour-threads 1`). CI once saw a
# Ctrl-C test time out so, waiting for the update to end. This runs before anything imports torch,
# and leaves a value the user set alone.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))


def readme_example(module: str) -> str:
    """The README's Python block that starts `from <module> import load_policy`, as a test runs it."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    found = [block for block in blocks if block.startswith(f"from {module} import load_policy")]
    assert len(found) == 1, f"the README shows load_policy of {module} once"
    code = found[0]
    assert len(code.strip().splitlines()) <= 10, "the README shows a policy in at most 10 lines"
    return code


@pytest.fixture(scope="session")
def breakout_id() -> str:
    import ppo_atari

    return ppo_atari.resolve_env_id("Breakout")


def pytest_collection_modifyitems(items):
    """Run the tests of ppo_jax.py last. Once JAX has started its thread pools, a fork from this
    process (the other scripts' workers fork by default on Linux) copies a process whose other
    threads may hold locks the child then waits on forever; JAX warns of it at every fork. The sort
    is stable, so every file keeps its own order."""
    items.sort(key=lambda item: item.path.name.startswith("test_ppo_jax"))
