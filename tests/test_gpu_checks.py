"""benchmarks/gpu_checks.sh, the prepared run for a machine with a GPU, lent for minutes: a mistake
in it would be found only there, with the minutes spent. Here, without a GPU: it parses, every test
it names exists, its steps fit the 10 minutes a lent machine gives one command, and a step that
fails leaves the others to run."""

import re
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"


def steps(part: str) -> list[tuple[str, int, str]]:
    """The steps of `part` as (name, seconds, command)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    block = re.search(rf'if \[ "\$part" = {part} \].*?\nfi\n', text, re.S).group(0)
    return [(name, int(seconds), command) for name, seconds, command in
            re.findall(r"^\s*step (\S+) (\d+) (.*)$", block, re.M)]


def test_it_parses_and_each_part_fits_one_command_of_a_lent_machine():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    for part in ("pytorch", "jax", "diagnose", "cleanrl"):
        assert steps(part) and sum(seconds for _, seconds, _ in steps(part)) <= 540, part


def test_every_test_it_names_exists():
    named = [word for part in ("pytorch", "jax") for _, _, command in steps(part)
             for word in shlex.split(command) if word.startswith("tests/")]
    assert len(named) >= 4
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *named], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the step would not fail")
def test_a_failed_step_leaves_the_others_to_run(tmp_path):
    # Without a GPU the two measuring steps fail at once; the tests after them still run (and skip).
    result = subprocess.run(["bash", str(SCRIPT), "pytorch"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PATH": f"{ROOT / '.no-such-dir'}:{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin",
                                 "OUT": str(tmp_path)})
    lines = result.stdout.strip().splitlines()[-3:]
    for line, name in zip(lines, ["throughput", "graph-update"]):
        assert line.startswith(f"{name}: exit ") and not line.startswith(f"{name}: exit 0 "), lines
    assert lines[2].startswith("torch-gpu-tests: exit 0 "), result.stdout[-3000:]
    assert {path.name for path in tmp_path.iterdir()} == {"throughput.log", "graph-update.log", "torch-gpu-tests.log"}
