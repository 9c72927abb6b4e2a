"""One copy of the algorithm in each PyTorch script: every class that defines the rollout
(`collect_rollout`, `sample_actions`) or the update (`update_policy`, and `ppo_atari.py`'s step of a
minibatch, `minibatch_step`), but Part 1's `Trainer`, wraps
Part 1's through `super()`, so that a fork's edit of Part 1 reaches every run, on every device.

Read from the source, without running anything: the test fails for a second copy that a run on a
GPU or under torchrun would use (as `DoubleBufferedTrainer.collect_rollout` once was)."""

import ast

import pytest

from conftest import ROOT

METHODS = {"collect_rollout", "sample_actions", "update_policy", "minibatch_step"}


def calls_its_super(method: ast.FunctionDef) -> bool:
    """Whether `method` calls `super().<its own name>(...)`."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method.name
               and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", None) == "super"
               for node in ast.walk(method))


@pytest.mark.parametrize("script", ["ppo_atari.py", "vpg_continuous.py"])
def test_every_rollout_and_update_but_part_ones_wraps_part_ones(script):
    classes = [node for node in ast.parse((ROOT / script).read_text()).body if isinstance(node, ast.ClassDef)]
    part_one = next(cls for cls in classes if cls.name == "Trainer")
    assert {"collect_rollout", "update_policy"} <= {node.name for node in part_one.body if isinstance(node, ast.FunctionDef)}
    wrappers = 0
    for cls in classes:
        for method in (node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in METHODS):
            if cls is not part_one:
                assert calls_its_super(method), f"{cls.name}.{method.name} does not call Part 1's {method.name}"
                wrappers += 1
    assert wrappers >= 2  # the run's trainer times both: the test looks where it should


def test_a_second_copy_is_caught():
    second_copy = ast.parse("class Fast(Trainer):\n    def collect_rollout(self):\n        return self.play()\n")
    wrapper = ast.parse("class Run(Trainer):\n    def collect_rollout(self):\n        return super().collect_rollout()\n")
    assert not calls_its_super(second_copy.body[0].body[0]) and calls_its_super(wrapper.body[0].body[0])
