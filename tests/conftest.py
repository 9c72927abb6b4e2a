"""Shared set-up: the scripts live at the repository root and are imported as modules."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def breakout_id() -> str:
    import ppo_atari

    return ppo_atari.resolve_env_id("Breakout")
