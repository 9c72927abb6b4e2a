"""Shared set-up: the scripts live at the repository root and are imported as modules."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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
