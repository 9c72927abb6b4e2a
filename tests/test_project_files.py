"""The files a researcher needs before copying a script: the licence, named where a copy carries it,
and the citation."""

import ast
import re

import pytest

from conftest import ROOT

SCRIPTS = sorted(ROOT.glob("*.py"))


def test_the_licence_is_mit_and_the_readme_names_it():
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Permission is hereby granted, free of charge" in licence
    readme = (ROOT / "README.md").read_text()
    assert "[`LICENSE`](LICENSE)" in readme and "[`CITATION.cff`](CITATION.cff)" in readme


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_script_carries_its_licence_line(script):
    # A file copied alone into a fork keeps its licence: the line is in the page's introduction.
    docstring = ast.get_docstring(ast.parse(script.read_text()))
    assert docstring and re.search(r"^Licence: MIT \(see LICENSE[^\n]*\)", docstring, re.M), script.name


def test_the_citation_file_holds_what_citation_cff_requires():
    text = (ROOT / "CITATION.cff").read_text()
    for key in ["cff-version: 1.2.0", "message:", "title:", "authors:", "license: MIT"]:
        assert re.search(rf"^{re.escape(key)}", text, re.M), key
    assert "\t" not in text  # YAML forbids tabs for indentation


def test_the_readmes_results_open_with_the_figures():
    readme = (ROOT / "README.md").read_text()
    results = readme[readme.index("\n## Results\n"):]
    results = results[:results.find("\n## ", 1)]
    first_figure, first_table = results.find("!["), results.find("\n| ")
    assert first_figure != -1 and first_figure < first_table, "the curves come before the speed tables"
    for path in re.findall(r"!\[[^\]]+\]\(([^)]+)\)", results):
        assert (ROOT / path).is_file(), path
