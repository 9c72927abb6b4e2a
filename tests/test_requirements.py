"""The requirements files: one per script, one for the pages and one for the tests, all pinned, the
root `requirements.txt` installing every one of them, and each script's own file enough for it."""

import ast
import importlib.metadata
import re
import sys

import pytest

from conftest import ROOT

SCRIPTS = ["ppo_atari", "vpg_continuous", "ppo_jax"]
# Imported only for `--track`, and left out of the scripts' own files on purpose: it is optional (tests.txt has it).
OPTIONAL = {"wandb"}


def read_requirements(path):
    """`{distribution name: (line, path)}` of a requirements file and of the files its `-r` lines name."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            for name, where in read_requirements(path.parent / line[3:].strip()).items():
                found.setdefault(name, where)
            continue
        name = re.split(r"[\[=<>!~ ]", line, maxsplit=1)[0].lower()
        found.setdefault(name, (line, path))
    return found


def pins(path):
    """Every requirement line of a file and of the files it includes, as `(line, file)`."""
    lines = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += pins(path.parent / line[3:].strip())
        elif line:
            lines.append((line, path.name))
    return lines


def test_the_root_file_installs_every_file_of_requirements_and_nothing_of_its_own():
    root = ROOT / "requirements.txt"
    lines = [line.split("#", 1)[0].strip() for line in root.read_text().splitlines()]
    included = {line[3:].strip() for line in lines if line.startswith("-r ")}
    assert all(not line or line.startswith("-r ") for line in lines), "pins live in requirements/"
    assert included == {f"requirements/{path.name}" for path in (ROOT / "requirements").glob("*.txt")}


def test_every_requirement_is_pinned_and_a_package_has_one_version_everywhere():
    versions = {}
    for line, file in pins(ROOT / "requirements.txt"):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[a-z,-]+\])?==([0-9][0-9A-Za-z.]*)", line)
        assert match, f"{file}: {line} is not pinned with =="
        versions.setdefault(match[1].lower(), set()).add(match[3])
    assert {name: found for name, found in versions.items() if len(found) > 1} == {}


def imported_distributions(script: str) -> set[str]:
    """The distributions whose modules `script` imports anywhere (at the top or inside a function)."""
    modules = set()
    for node in ast.walk(ast.parse((ROOT / f"{script}.py").read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    modules -= set(sys.stdlib_module_names) | {"__future__"} | OPTIONAL
    owners = importlib.metadata.packages_distributions()
    assert not modules - set(owners), f"not installed here: {modules - set(owners)}"
    return {owners[module][0].lower() for module in modules}


def with_dependencies(names: set[str]) -> set[str]:
    """`names` and every distribution they declare as a dependency (extras aside), installed here."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # a dependency of another platform's
            continue
        for requirement in requirements:
            if "extra ==" not in requirement:
                todo.append(re.split(r"[\[=<>!~ ;(]", requirement, maxsplit=1)[0].lower().replace("_", "-"))
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_scripts_own_file_holds_everything_it_imports(script):
    # Listed, or declared by what is listed (gymnax brings seaborn, which ppo_jax.py draws MinAtar with).
    listed = with_dependencies(set(read_requirements(ROOT / "requirements" / f"{script}.txt")))
    needed = imported_distributions(script)
    if script != "ppo_jax":
        needed.add("tensorboard")  # torch.utils.tensorboard imports it when the run's writer starts
    assert needed - listed == set(), f"requirements/{script}.txt lacks {needed - listed}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_readme_installs_a_script_with_its_own_file(script):
    readme = (ROOT / "README.md").read_text()
    assert f"pip install -r requirements/{script}.txt" in readme
    assert "pip install -r requirements.txt" in readme  # the one command that installs everything
