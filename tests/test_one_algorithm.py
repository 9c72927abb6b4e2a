"""One copy of the algorithm in each PyTorch script: a class of a later part that overrides a method
of a class of Part 1 (`Trainer`'s rollout, update and advantages, `ActorCritic`'s features,
`RunningMeanStd`'s update, ...) wraps Part 1's, through `super()` or Part 1's function of the same
name, so that a fork's edit of Part 1 reaches every run, on every device, under torchrun, in `--eval`
and in `load_policy`.

Read from the source, without running anything: the test fails for a second copy that a run on a
GPU or under torchrun would use (as `DoubleBufferedTrainer.collect_rollout` once was, and Part 4's
standardisation of the advantages and `TunedActorCritic.features` after it)."""

import ast

import pytest

from conftest import ROOT


def calls_part_ones(method: ast.FunctionDef) -> bool:
    """Whether `method` calls `super().<its own name>` (a call, or a property read) or Part 1's
    function of its name."""
    return any((isinstance(node, ast.Attribute) and node.attr == method.name and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "super")
               or (isinstance(node, ast.Call) and getattr(node.func, "id", None) == method.name)
               for node in ast.walk(method))


def overrides_of_part_one(script: str) -> list[tuple[str, ast.FunctionDef]]:
    """Each method of a class after Part 1 that overrides a method of a Part 1 class it extends."""
    source = (ROOT / script).read_text()
    part_two = next(number for number, line in enumerate(source.splitlines(), 1) if line.startswith("# ## Part 2"))
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}

    def part_one_ancestors(cls: ast.ClassDef) -> list[ast.ClassDef]:
        parents = [classes[base.id] for base in cls.bases if getattr(base, "id", None) in classes]
        return [parent for parent in parents if parent.lineno < part_two] + [
            ancestor for parent in parents for ancestor in part_one_ancestors(parent)]

    def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
        return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}

    return [(f"{cls.name}.{name}", method) for cls in classes.values() if cls.lineno > part_two
            for name, method in methods(cls).items()
            if any(name in methods(ancestor) for ancestor in part_one_ancestors(cls))]


@pytest.mark.parametrize("script", ["ppo_atari.py", "vpg_continuous.py"])
def test_every_override_of_part_one_wraps_part_ones(script):
    overrides = overrides_of_part_one(script)
    names = {name.split(".")[1] for name, _ in overrides}
    # The test looks where it should: the run's trainer wraps the rollout and the update, Part 4 the advantages.
    assert {"collect_rollout", "update_policy", "normalize_advantages", "steps_per_update"} <= names, names
    for name, method in overrides:
        assert calls_part_ones(method), f"{name} does not call Part 1's {method.name}"


def test_the_policy_of_a_checkpoint_draws_with_part_ones_sample_actions():
    # `--eval` and `load_policy` act through `Policy.act`: with Part 1's draw, an edit of it reaches them.
    import inspect

    import ppo_atari

    assert ppo_atari.Policy.sample_actions is ppo_atari.Trainer.sample_actions
    assert "self.sample_actions(" in inspect.getsource(ppo_atari.Policy.act)


def test_a_second_copy_is_caught():
    second_copy = ast.parse("class Fast(Trainer):\n    def collect_rollout(self):\n        return self.play()\n")
    wrapper = ast.parse("class Run(Trainer):\n    def collect_rollout(self):\n        return super().collect_rollout()\n")
    through_part_ones_function = ast.parse("def normalize_advantages(self, a):\n    return normalize_advantages(a, 0, 1)\n")
    a_property = ast.parse("def steps_per_update(self):\n    return super().steps_per_update * 2\n")
    assert not calls_part_ones(second_copy.body[0].body[0]) and calls_part_ones(wrapper.body[0].body[0])
    assert calls_part_ones(through_part_ones_function.body[0]) and calls_part_ones(a_property.body[0])
