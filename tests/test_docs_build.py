"""docs/build.py: how it pairs prose with code, renders prose and math, and tells a stale page."""

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT


def load_build():
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_build"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


build = load_build()


def sections_of(source: str):
    """Each section as (prose texts, code line numbers, definition) for a dedented sample."""
    return [([p.text for p in s.prose], s.code, s.definition)
            for s in build.split_sections(textwrap.dedent(source).lstrip("\n"))]


def test_a_comment_block_starts_a_section_with_the_code_under_it():
    sections = sections_of("""
        x = 1
        # Two lines of
        # one comment.
        y = 2
        z = 3

        # Another block.
        w = 4
        """)
    assert sections == [([], [1], None),
                        (["Two lines of\none comment."], [4, 5], None),
                        (["Another block."], [8], None)]


def test_code_before_the_first_comment_gets_a_section_without_prose():
    (first_prose, first_code, _), *_ = sections_of("""
        import os

        PATH = os.sep
        # Now prose.
        print(PATH)
        """)
    assert first_prose == [] and first_code == [1, 2, 3]


def test_blocks_with_no_code_between_them_share_a_section():
    assert sections_of("""
        # First paragraph.

        # Second paragraph.
        x = 1
        """) == [(["First paragraph.", "Second paragraph."], [4], None)]


def test_every_definition_starts_a_section_and_takes_the_comment_above_it():
    sections = sections_of("""
        # Helpers.


        @decorator
        def first():
            return 1
        def second():
            return 2


        class Third:
            def method(self):
                return 3
        """)
    assert sections == [(["Helpers."], [4, 5, 6], "first"),
                        ([], [7, 8], "second"),
                        ([], [11], "Third"),
                        ([], [12, 13], "Third.method")]


def test_a_docstring_is_prose_beside_its_definition_and_not_code():
    sections = sections_of('''
        """The module's introduction."""

        import os


        # A comment above.
        class Game:
            """One game.

            Several lines.
            """

            def step(self):
                """One step."""
                return os.sep
        ''')
    assert sections == [(["The module's introduction."], [3], None),
                        (["A comment above.", "One game.\n\nSeveral lines."], [7], "Game"),
                        (["One step."], [13, 15], "Game.step")]


def test_a_docstring_on_the_line_of_its_definition_stays_code():
    assert sections_of('''
        def f(): "doc"; return 1
        ''') == [([], [1], "f")]


def test_a_hash_in_a_string_is_not_a_comment_and_an_end_of_line_comment_stays_code():
    sections = sections_of('''
        text = """
        # not a comment: inside a string
        """
        x = 1  # stays beside its line
        ''')
    assert sections == [([], [1, 2, 3, 4], None)]


def page_for(tmp_path: Path, source: str, readme: str = "") -> str:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "sample.py").write_text(textwrap.dedent(source).lstrip("\n"))
    (tmp_path / "README.md").write_text(readme)
    return build.build(tmp_path)[tmp_path / "docs" / "sample.html"]


def test_headings_become_anchored_page_headings_in_the_contents(tmp_path):
    page = page_for(tmp_path, '''
        """# The title"""

        # ## Setup
        x = 1

        # ### Details
        y = 2

        # ## Setup
        z = 3
        ''')
    assert '<h1 id="the-title">' in page
    assert '<h2 id="setup">' in page and '<h3 id="details">' in page and '<h2 id="setup-2">' in page
    contents = page[page.index('<nav class="contents"'):page.index("</nav>")]
    assert re.findall(r'href="#([^"]+)"', contents) == ["setup", "details", "setup-2"]
    assert "<title>The title · sample.py</title>" in page


def test_code_keeps_the_line_numbers_of_the_source(tmp_path):
    source = '''
        r"""Intro."""

        def f(x):
            """Doc."""
            # A comment.
            return x < 1 and "a & b"
        '''
    page = page_for(tmp_path, source)
    lines = textwrap.dedent(source).lstrip("\n").split("\n")
    shown = re.findall(r'<span class="line" id="L(\d+)"(?: style="--indent:(\d+)")?><a class="ln" href="#L\1" '
                       r'data-n="\1"[^>]*></a>(.*?)</span>\n', page)
    assert [int(n) for n, _, _ in shown] == [3, 6]
    # Each line carries its indentation, which a wrapped line's continuation hangs from.
    assert [indent for _, indent, _ in shown] == ["", "4"]
    for number, _, html_text in shown:
        text = re.sub(r"<[^>]+>", "", html_text).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
        assert text == lines[int(number) - 1]


def test_a_dollar_in_code_is_not_math_but_math_in_prose_is(tmp_path):
    page = page_for(tmp_path, r'''
        # The cost is $c_t$, and `"$x$"` in inline code stays code.
        price = "$5 and $10"
        template = f"${x}$"
        ''')
    assert page.count("<math") == 1 and "<msub><mi>c</mi><mi>t</mi></msub>" in page
    assert "<code>&quot;$x$&quot;</code>" in page
    code = re.sub(r"<[^>]+>", "", page[page.index('id="L2"'):page.index("</code></pre>")])
    assert 'price = "$5 and $10"' in code and 'template = f"${x}$"' in code


def test_markdown_in_comments_and_docstrings_renders(tmp_path):
    page = page_for(tmp_path, '''
        def f():
            r"""A **bold** claim about `code`:

            * one item
            * another, with $\\hat A_t$

            $$\\begin{align} a &= b \\\\ c &= d \\end{align}$$
            """
        ''')
    assert "<strong>bold</strong>" in page and "<code>code</code>" in page
    assert re.search(r"<ul>\s*<li>one item</li>", page)
    assert '<div class="math-display"><math display="block"><mrow><mtable' in page
    assert "(1)" not in page  # equations are not numbered: nothing could refer to the numbers


def test_math_that_cannot_be_rendered_is_an_error_naming_the_line(tmp_path):
    with pytest.raises(build.BuildError, match=r"sample.py:2: .*\\undefinedcommand"):
        page_for(tmp_path, r'''
            x = 1
            # Uses $\undefinedcommand x$.
            y = 2
            ''')


def test_a_docstring_with_latex_must_be_raw(tmp_path):
    with pytest.raises(build.BuildError, match=r"sample.py:2: .*not raw"):
        page_for(tmp_path, '''
            def f():
                """The ratio $\\frac{a}{b}$."""
            ''')


def test_a_nodes_source_is_what_ast_gives_whatever_its_lines_and_letters():
    # The build cuts each docstring from lines split once; ast.get_source_segment is the reference.
    # Columns count bytes of UTF-8, so letters outside ASCII before a node or inside it must not shift it.
    source = textwrap.dedent('''\
        café = "crème"; x = 1
        def f():
            r"""Über $\\frac{a}{b}$,
            and ünïcode to the end."""  # é
            return {"ß": f(
                1)}
        ''')
    lines, nodes = build.source_lines(source), list(ast.walk(ast.parse(source)))
    assert len(nodes) > 10
    for node in nodes:
        if hasattr(node, "end_col_offset"):
            assert build.source_segment(lines, node) == ast.get_source_segment(source, node), ast.dump(node)


def test_the_index_lists_the_scripts_with_the_readme_and_shows_its_results(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "beta.py").write_text('"""# Beta\n\nBeta teaches B."""\n')
    (tmp_path / "alpha.py").write_text('"""# Alpha\n\nAlpha teaches A."""\n')
    (tmp_path / "README.md").write_text(textwrap.dedent("""\
        # A project

        What the project is.

        | script | what it teaches |
        | --- | --- |
        | [`beta.py`](beta.py) | the README's words for beta |

        ## Results

        | run | score |
        | --- | --- |
        | `beta.py` | 12 |

        ## Later
        Not shown.
        """))
    pages = build.build(tmp_path)
    index = pages[tmp_path / "docs" / "index.html"]
    assert set(pages) == {tmp_path / "docs" / name for name in ("index.html", "alpha.html", "beta.html")}
    assert index.index('href="beta.html"') < index.index('href="alpha.html"')  # the README's order first
    assert "the README's words for beta" in index and "Alpha teaches A." in index
    assert "<h2" in index and ">Results</h2>" in index and "<td>12</td>" in index and "Not shown" not in index


def copy_of_repository(tmp_path: Path) -> Path:
    """The scripts, README and docs/ of this repository, where they can be changed."""
    for path in ROOT.glob("*.py"):
        shutil.copy(path, tmp_path)
    shutil.copy(ROOT / "README.md", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")  # the figures
    return tmp_path


def run_build(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "docs" / "build.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_the_committed_pages_are_current():
    result = run_build(ROOT, "--check")
    assert result.returncode == 0, (
        f"{result.stderr}\nThe pages in docs/ are behind the scripts: run `python docs/build.py` and commit docs/.")


def test_check_fails_when_a_script_changes_and_passes_once_rebuilt(tmp_path):
    root = copy_of_repository(tmp_path)
    assert run_build(root, "--check").returncode == 0
    script = next(root.glob("*.py"))
    script.write_text(script.read_text() + "\n# A new closing remark.\n")
    result = run_build(root, "--check")
    assert result.returncode == 1 and f"docs/{script.stem}.html is stale" in result.stderr
    assert run_build(root).returncode == 0
    assert run_build(root, "--check").returncode == 0
    assert "A new closing remark." in (root / "docs" / f"{script.stem}.html").read_text()


def test_check_names_a_missing_page_and_a_page_whose_script_is_gone(tmp_path):
    root = copy_of_repository(tmp_path)
    (root / "extra.py").write_text('"""# Extra"""\n')
    (root / "docs" / "gone.html").write_text("<!DOCTYPE html>")
    result = run_build(root, "--check")
    assert result.returncode == 1
    assert "docs/extra.html is missing" in result.stderr and "docs/gone.html has no source" in result.stderr


PARTS = ["Part 1: The algorithm", "Part 2: Sampling at speed", "Part 3: Running it for real",
         "Part 4: More than one device"]


@pytest.mark.parametrize("script", ["ppo_atari.py", "vpg_continuous.py", "ppo_jax.py"])
def test_each_page_reads_in_the_four_parts_and_its_contents_nest_under_them(script):
    # The script's own headings, in order: the four parts at `##`, every section under one at `###`.
    headings = re.findall(r"^ *# (##+) (.+)$", (ROOT / script).read_text(), re.M)
    assert [text for level, text in headings if level == "##"] == PARTS
    assert headings[0] == ("##", PARTS[0]) and {level for level, _ in headings} <= {"##", "###"}
    # The page's contents list: the parts at the top level, each section nested in its part.
    page = (ROOT / "docs" / script.replace(".py", ".html")).read_text()
    nav = page[page.index('<nav class="contents"'):page.index("</nav>")]
    depth, top, nested = 0, [], 0
    for tag, text in re.findall(r"<(/?ol)>|<a [^>]*>(.*?)</a>", nav):
        if tag:
            depth += 1 if tag == "ol" else -1
        elif depth == 1:
            top.append(re.sub(r"<[^>]+>", "", text))
        else:
            nested += 1
    assert top == PARTS and nested == sum(level == "###" for level, _ in headings)


def a_figure(root: Path, name: str = "curve.png", content: bytes = b"\x89PNG fake") -> Path:
    path = root / "benchmarks" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_a_figure_is_copied_beside_the_pages_with_its_alt_text(tmp_path):
    (tmp_path / "docs").mkdir()
    a_figure(tmp_path)
    (tmp_path / "sample.py").write_text(
        '"""# Sample\n\n![The return against steps, for 4 seeds](benchmarks/results/curve.png)\n"""\n')
    (tmp_path / "README.md").write_text("# P\n\n## Results\n\n![The same curve](benchmarks/results/curve.png)\n")
    pages = build.build(tmp_path)
    assert pages[tmp_path / "docs" / "figures" / "curve.png"] == b"\x89PNG fake"
    for page, alt in [("sample.html", "The return against steps, for 4 seeds"), ("index.html", "The same curve")]:
        assert f'<img class="figure" src="figures/curve.png" alt="{alt}">' in pages[tmp_path / "docs" / page]


@pytest.mark.parametrize("markdown, message", [
    ("![](benchmarks/results/curve.png)", "has no alt text"),
    ("![A curve](benchmarks/results/none.png)", "benchmarks/results/none.png does not exist"),
    ("![A curve](https://example.org/curve.png)", "is not a file of the repository"),
])
def test_a_figure_without_alt_text_or_file_is_an_error_naming_the_line(tmp_path, markdown, message):
    (tmp_path / "docs").mkdir()
    a_figure(tmp_path)
    (tmp_path / "sample.py").write_text(f'x = 1\n\n# {markdown}\ny = 2\n')
    with pytest.raises(build.BuildError, match=f"sample.py:3: .*{re.escape(message)}"):
        build.build(tmp_path)


def test_check_finds_a_stale_figure_and_one_no_page_shows(tmp_path):
    root = copy_of_repository(tmp_path)
    figure = next((root / "docs" / "figures").glob("*.png"))
    source = root / "benchmarks" / "results" / figure.name
    source.write_bytes(source.read_bytes() + b"\0")
    (root / "docs" / "figures" / "unused.png").write_bytes(b"")
    result = run_build(root, "--check")
    assert result.returncode == 1
    assert f"docs/figures/{figure.name} is stale" in result.stderr
    assert "docs/figures/unused.png has no source" in result.stderr
    assert run_build(root).returncode == 0 and run_build(root, "--check").returncode == 0
    assert figure.read_bytes() == source.read_bytes() and not (root / "docs" / "figures" / "unused.png").exists()


def test_a_command_in_the_prose_breaks_at_spaces_never_at_a_flags_hyphen(tmp_path):
    page = page_for(tmp_path, '''
        r"""Intro: run `python x.py --capture-video --run-dir runs/a-b` to record.

        ```
        python x.py --eval runs/<run>/checkpoint.pt --eval-episodes 2
        XLA_FLAGS=--xla_force_host_platform_device_count=8 python x.py
        ```
        """
        ''')
    inline = page[page.index("<code>python x.py"):]
    inline = inline[:inline.index("</code>")]
    assert '<span class="nobr">--capture-video</span>' in inline
    assert '<span class="nobr">--run-dir</span>' in inline
    assert 'runs/<wbr><span class="nobr">a-b</span>' in inline  # a path may break after its slash
    block = page[page.index('<pre class="block">'):]
    block = block[:block.index("</pre>")]
    assert '<span class="nobr">--eval-episodes</span>' in block
    assert "&lt;run&gt;/checkpoint.pt" in re.sub(r"<(?!/?span|wbr)[^>]+>", "", block)
    assert 'XLA_FLAGS=<wbr><span class="nobr">--xla_force_host_platform_device_count=</span>' in block
    # What a reader copies is the command as written: the marks add no characters.
    text = re.sub(r"<[^>]+>", "", inline).replace("&lt;", "<").replace("&gt;", ">")
    assert text == "python x.py --capture-video --run-dir runs/a-b"
    code_lines = re.sub(r"<[^>]+>", "", block).replace("&lt;", "<").replace("&gt;", ">")
    assert "python x.py --eval runs/<run>/checkpoint.pt --eval-episodes 2" in code_lines
