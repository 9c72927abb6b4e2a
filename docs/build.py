r"""Build the annotated pages: every script of the repository as a page with its prose beside its code.

```
python docs/build.py            # write docs/<script>.html and docs/index.html
python docs/build.py --check    # exit 1, naming them, if any page differs from what the sources make now
```

A script is every `*.py` file at the repository root. Its page is cut into sections, each a row of
prose on the left and the code it explains on the right (prose above code on a narrow screen):

* A block of full-line `#` comments starts a section; the code under it, up to the next block or
  definition, sits beside it. Comments at the end of a line of code stay in the code.
* Every `def` and `class` (with its decorators) starts a section. A docstring is shown as prose
  beside its definition and left out of the code. A comment block with nothing but blank lines
  between it and the definition below shares the definition's section.
* The module docstring is the page's introduction; code before the first comment or docstring
  gets a section with no prose.
* Prose is Markdown (CommonMark, with tables). `## Heading` in a comment becomes a page heading
  with an anchor, listed in the contents. Math in `$...$`, `$$...$$` or an amsmath environment
  (`\begin{align}...`) is turned into MathML here, so the browser needs nothing from the network;
  a `$` inside code, strings included, is never math.
* Code keeps the line numbers of the source file, and each line has an anchor (`#L42`).
* A figure, `![what it shows](benchmarks/results/curve.png)` with its path from the repository
  root, is copied to `docs/figures/`, so that the pages need nothing outside `docs/`; its alt text
  is required, and `--check` finds a copy that differs from its source.

The index lists the pages, each with what it teaches (its row in the README's table of scripts,
or else the first paragraph of its module docstring), and shows the README's results.
"""

from __future__ import annotations

import argparse
import ast
import html
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

import latex2mathml.converter
import pygments
import pygments.token
from markdown_it import MarkdownIt
from mdit_py_plugins.amsmath import amsmath_plugin
from mdit_py_plugins.dollarmath import dollarmath_plugin
from pygments.lexers import PythonLexer, get_lexer_by_name
from pygments.util import ClassNotFound

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "Policy gradients, annotated"


class BuildError(Exception):
    """Something in a source cannot be made into a page; the message names the file and line."""


def read_source(path: Path) -> str:
    """A file's text with `\\n` line ends, so that its lines are numbered as Python numbers them."""
    return path.read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n")


def source_lines(source: str) -> list[str]:
    """The lines of `source` (with `\\n` line ends); `str.splitlines` would also split at a form feed."""
    lines = source.split("\n")
    return lines[:-1] if source.endswith("\n") else lines


def source_segment(lines: list[str], node: ast.AST) -> str:
    """The source of `node`, as `ast.get_source_segment` gives it, cut from `source_lines`.

    That function splits the whole file again at every call: for the 340 docstrings of the three
    scripts, it was 11 of the 13 seconds a build took. `ast` counts columns in bytes of UTF-8.
    """
    first, last = node.lineno - 1, node.end_lineno - 1
    text = [line.encode() for line in lines[first:last + 1]]
    text[-1] = text[-1][:node.end_col_offset]  # first the end, which may be on the first line too
    text[0] = text[0][node.col_offset:]
    return b"\n".join(text).decode()


# ## Cutting a script into sections


@dataclass
class Prose:
    line: int
    """The source line where this piece of prose starts (shown in the page as `data-line`)."""
    text: str
    """Markdown."""


@dataclass
class Section:
    prose: list[Prose] = field(default_factory=list)
    code: list[int] = field(default_factory=list)
    """Source line numbers (from 1) of the code beside the prose, blank lines at either end removed."""
    definition: str | None = None
    """The qualified name of the `def` or `class` this section starts with, if it starts with one."""

    def has_code(self, lines: list[str]) -> bool:
        return any(lines[n - 1].strip() for n in self.code)


def full_line_comments(source: str) -> dict[int, str]:
    """Line number -> text of each comment that is alone on its line, without `#` and one space.

    The tokenizer tells a comment from a `#` inside a string. A shebang or encoding line at the
    top stays code.
    """
    lines = source_lines(source)
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, column = token.start
        if lines[row - 1][:column].strip():
            continue  # after code on the same line
        if row <= 2 and (token.string.startswith("#!") or re.match(r"#.*coding[:=]", token.string)):
            continue
        text = token.string[1:]
        comments[row] = text[1:] if text.startswith(" ") else text
    return comments


@dataclass
class Docstring:
    first: int
    last: int
    text: str
    owner: str | None
    """The qualified name of the class or function it documents; `None` for the module's."""


def docstrings_and_definitions(tree: ast.Module, source: str,
                                name: str) -> tuple[dict[int, Docstring], dict[int, str]]:
    r"""The docstrings that fill whole lines, by first line; and the first line of each definition.

    A definition starts at its first decorator. A docstring that shares a line with code (`def f():
    "doc"`) stays in the code. A docstring with a backslash before a letter must be raw (`r` before
    its quotes): in a plain string `\frac` would reach the page as a form feed and `rac`.
    """
    lines = source_lines(source)
    docstrings: dict[int, Docstring] = {}
    definitions: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        owner = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owner = prefix + node.name
            definitions[min([node.lineno] + [d.lineno for d in node.decorator_list])] = owner
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                expr = body[0]
                alone = (not lines[expr.lineno - 1][:expr.col_offset].strip()
                         and not lines[expr.end_lineno - 1][expr.end_col_offset:].strip())
                literal = source_segment(lines, expr)
                string_prefix = re.match(r"[A-Za-z]*", literal).group(0)
                if "r" not in string_prefix.lower() and re.search(r"\\[A-Za-z]", literal):
                    raise BuildError(f"{name}:{expr.lineno}: this docstring has a backslash before a letter but "
                                     'is not raw; write it r"""...""" so that LaTeX keeps its backslashes')
                if alone:
                    docstrings[expr.lineno] = Docstring(expr.lineno, expr.end_lineno,
                                                        ast.get_docstring(node, clean=True) or "", owner)
        for child in ast.iter_child_nodes(node):
            visit(child, owner + "." if owner else prefix)

    visit(tree, "")
    return docstrings, definitions


def split_sections(source: str, name: str = "<source>") -> list[Section]:
    """Cut a script into sections of prose and code, by the rules in this file's docstring."""
    lines = source_lines(source)
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise BuildError(f"{name}:{error.lineno}: cannot parse: {error.msg}") from None
    comments = full_line_comments(source)
    docstrings, definitions = docstrings_and_definitions(tree, source, name)

    sections = [Section()]
    comment_block: list[str] | None = None  # the comment block being read, if the last line was one
    number = 1
    while number <= len(lines):
        current = sections[-1]
        if number in docstrings:
            docstring = docstrings[number]
            if docstring.owner is None and current.has_code(lines):
                sections.append(current := Section())
            current.prose.append(Prose(number, docstring.text))
            comment_block = None
            number = docstring.last + 1
            continue
        if number in comments:
            if comment_block is None:
                if current.has_code(lines):
                    sections.append(current := Section())
                comment_block = []
                current.prose.append(Prose(number, ""))
            comment_block.append(comments[number])
            current.prose[-1].text = "\n".join(comment_block)
            number += 1
            continue
        comment_block = None
        if number in definitions:
            if current.has_code(lines) or current.definition is not None:
                sections.append(current := Section())
            current.definition = definitions[number]
        current.code.append(number)
        number += 1

    for section in sections:
        # Blank lines are dropped at either end, and where they only followed a docstring.
        kept: list[int] = []
        for number in section.code:
            if lines[number - 1].strip() or not kept or kept[-1] == number - 1:
                kept.append(number)
        section.code = kept
        while section.code and not lines[section.code[0] - 1].strip():
            section.code.pop(0)
        while section.code and not lines[section.code[-1] - 1].strip():
            section.code.pop()
    return [s for s in sections if s.prose or s.code]


# ## Math


def render_math(tex: str, display: bool, where: str) -> str:
    """MathML for a LaTeX formula, or a `BuildError` naming `where` if it cannot be shown right."""
    tex = tex.strip()
    # Equation numbers would restart at (1) in every formula of a page, and nothing refers to them:
    # `align` is shown as `align*`. `aligned` (inside `$$`) is laid out as `split`, which is the same.
    source = re.sub(r"\\(begin|end)\{(align|equation|gather|multline)\}", r"\\\1{\2*}", tex)
    source = re.sub(r"\\(begin|end)\{aligned\}", r"\\\1{split}", source)
    try:
        mathml = latex2mathml.converter.convert(source, display="block" if display else "inline")
    except Exception as error:  # latex2mathml raises its own exceptions and plain ones for bad input
        raise BuildError(f"{where}: cannot render the math {tex!r}: {error}") from None
    # An unknown command comes through as text (`<mi>\foo</mi>`), and an environment latex2mathml
    # cannot lay out as its `&` and a line break that MathML ignores: refuse both rather than
    # show a reader raw LaTeX or a formula run together.
    unknown = re.search(r">(\\[A-Za-z]+)<", mathml)
    if unknown:
        raise BuildError(f"{where}: the math {tex!r} uses {unknown.group(1)}, which latex2mathml does not know")
    if re.search(r"<mi>&amp;</mi>|<mi>&</mi>|linebreak=", mathml):
        raise BuildError(f"{where}: the math {tex!r} has rows or columns that latex2mathml cannot lay out; "
                         r"use \begin{align}, \begin{split} or \begin{cases}")
    root = ElementTree.fromstring(mathml.replace(' xmlns="http://www.w3.org/1998/Math/MathML"', ""))
    polish_mathml(root)
    mathml = ElementTree.tostring(root, encoding="unicode")
    return f'<div class="math-display">{mathml}</div>' if display else mathml


FUNCTION_NAMES = {"arccos", "arcsin", "arctan", "cos", "cosh", "cot", "csc", "deg", "det", "dim", "exp", "gcd",
                  "hom", "ker", "lg", "ln", "log", "sec", "sin", "sinh", "tan", "tanh"}
r"""What latex2mathml writes for `\log` and its kind: a word in an <mi>, with no space after it."""
OPENING = {"(", "[", "{", "|", "\u2016"}
BIG_OPERATORS = {"\u2211", "\u220f", "\u2210", "\u22c3", "\u22c2"}  # sum, product, coproduct, union, intersection


def polish_mathml(root: ElementTree.Element) -> None:
    """Correct latex2mathml's output where Chromium and the bundled font would draw it unlike TeX."""
    for parent in list(root.iter()):
        children = list(parent)
        for index, child in enumerate(children):
            following = children[index + 1] if index + 1 < len(children) else None
            # `\log` is an operator: a thin space before it after a symbol, and after it unless a
            # bracket follows (`\nabla \log \pi` but `\log(x)`).
            if child.tag == "mi" and child.text in FUNCTION_NAMES and not child.attrib:
                previous = children[index - 1] if index else None
                if following is not None and not (following.tag == "mo" and following.text in OPENING):
                    parent.insert(list(parent).index(child) + 1, ElementTree.Element("mspace", width="0.1667em"))
                if previous is not None and previous.tag not in ("mo", "mspace"):
                    parent.insert(list(parent).index(child), ElementTree.Element("mspace", width="0.1667em"))
            # `a|s` as TeX sets it, tight; MathML would space the bar like a relation.
            if child.tag == "mo" and child.text == "|" and child.get("stretchy") == "false":
                child.set("lspace", "0")
                child.set("rspace", "0")
            # `\max_a` and `\sum_t` put `a` and `t` under the operator in a display formula and
            # beside it inline, as TeX does.
            if (child.tag in ("msub", "msubsup") and len(child) and child[0].tag == "mo"
                    and ((child[0].text or "").isalpha() or child[0].text in BIG_OPERATORS)):
                child.tag = "munder" if child.tag == "msub" else "munderover"
                child[0].set("movablelimits", "true")
            # `\hat a`: the small circumflex, placed as an accent; the ASCII caret sits too high.
            if child.tag == "mover" and child.get("accent") == "true" and len(child) == 2 and child[1].text == "^":
                child[1].text = "\u02c6"
                child[1].set("stretchy", "false")
            # `\sim` is the relation, not a tilde letter.
            if child.tag == "mi" and child.text == "~":
                child.tag, child.text = "mo", "\u223c"
        # `\mathrm{done}` comes as one upright <mi> per letter; one <mi> for the word reads and
        # copies better (an <mi> of several letters is upright by itself).
        children = list(parent)
        run: list[ElementTree.Element] = []
        for child in children + [None]:
            letter = (child is not None and child.tag == "mi" and child.get("mathvariant") == "normal"
                      and len(child.text or "") == 1 and not len(child))
            if letter:
                run.append(child)
                continue
            if len(run) > 1:
                run[0].text = "".join(c.text for c in run)
                del run[0].attrib["mathvariant"]
                for extra in run[1:]:
                    parent.remove(extra)
            run = []


INLINE_MATH = re.compile(r"(?<![\\\d$])\$(?=\S)([^$\n]*?\S)\$(?!\d)")
"""`$...$` in a comment at the end of a line of code: no space inside the dollars, no digit outside."""


def comment_with_math(text: str, where: str) -> str:
    """A comment at the end of a code line, escaped, with its inline math rendered."""
    out, position = [], 0
    for match in INLINE_MATH.finditer(text):
        out.append(html.escape(text[position:match.start()], quote=False))
        out.append(render_math(match.group(1), display=False, where=where))
        position = match.end()
    out.append(html.escape(text[position:], quote=False))
    return "".join(out)


# ## Markdown


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


class Markdown:
    """CommonMark with tables, math as MathML, highlighted code blocks, and headings with anchors.

    One instance renders one page: it hands out unique heading ids and collects the headings for
    the contents. `links` maps a link target as written in a source (`ppo_atari.py`) to its target
    from `docs/`; other relative links are taken to be relative to the repository root. Figures
    are files of the repository under `root`; each one shown is added to `figures` (its path under
    `docs/`, and the file it is copied from).
    """

    def __init__(self, links: dict[str, str], root: Path = ROOT, figures: dict[str, Path] | None = None):
        self.links, self.root = links, root
        self.figures = {} if figures is None else figures
        self.headings: list[tuple[int, str, str]] = []  # (level, id, inner HTML)
        self.ids: set[str] = set()
        self.where = ""
        self.md = MarkdownIt("commonmark", {"html": False}).enable("table")
        self.md.use(dollarmath_plugin, allow_labels=False, allow_space=False, allow_digits=False,
                    double_inline=True)
        self.md.use(amsmath_plugin)

        # markdown-it calls a rule with its renderer first (it binds plain functions to it).
        def rule(method):
            return lambda renderer, tokens, index, options, env: method(tokens, index, options, env)

        def math(display: bool):
            return rule(lambda tokens, index, options, env: render_math(tokens[index].content, display, self.where))

        rules = {"math_inline": math(False), "math_inline_double": math(True), "math_block": math(True),
                 "amsmath": math(True), "heading_open": rule(self._heading_open),
                 "heading_close": rule(lambda tokens, index, options, env: f"</{tokens[index].tag}>\n"),
                 "fence": rule(self._code_block), "code_block": rule(self._code_block),
                 "link_open": rule(self._link_open), "image": rule(self._image),
                 "code_inline": rule(lambda tokens, index, options, env:
                                     f"<code>{unbroken_words(html.escape(tokens[index].content))}</code>")}
        for name, function in rules.items():
            self.md.add_render_rule(name, function)

    def render(self, text: str, where: str) -> str:
        self.where = where
        return self.md.render(text)

    def _heading_open(self, tokens, index, options, env) -> str:
        level = int(tokens[index].tag[1])
        inline = tokens[index + 1]
        base = slugify("".join(t.content for t in inline.children or [] if t.type in ("text", "code_inline")))
        anchor, n = base, 2
        while anchor in self.ids:
            anchor, n = f"{base}-{n}", n + 1
        self.ids.add(anchor)
        self.headings.append((level, anchor, self.md.renderer.render(inline.children or [], options, env)))
        return f'<h{level} id="{anchor}"><a class="anchor" href="#{anchor}" aria-label="Link to this heading">§</a>'

    def _code_block(self, tokens, index, options, env) -> str:
        token = tokens[index]
        language = token.info.split()[0] if token.info.strip() else "text"
        try:
            lexer = get_lexer_by_name(language, stripnl=False, ensurenl=False)
        except ClassNotFound:
            lexer = get_lexer_by_name("text", stripnl=False, ensurenl=False)
        body = "\n".join(tokens_to_html(pygments.lex(token.content.rstrip("\n"), lexer), unbroken=True))
        return f'<pre class="block"><code>{body}</code></pre>\n'

    def _link_open(self, tokens, index, options, env) -> str:
        token = tokens[index]
        href = token.attrGet("href") or ""
        if href in self.links:
            token.attrSet("href", self.links[href])
        elif href and not re.match(r"[a-z][a-z0-9+.-]*:|#|/", href):
            token.attrSet("href", "../" + href)
        return self.md.renderer.renderToken(tokens, index, options, env)


    def _image(self, tokens, index, options, env) -> str:
        token = tokens[index]
        source = token.attrGet("src") or ""
        alt = self.md.renderer.renderInlineAsText(token.children or [], options, env).strip()
        if not alt:
            raise BuildError(f"{self.where}: the figure {source} has no alt text; say what it shows")
        if re.match(r"[a-z][a-z0-9+.-]*:|/", source):
            raise BuildError(f"{self.where}: the figure {source} is not a file of the repository "
                             "(the pages load nothing from elsewhere)")
        path = self.root / source
        if not path.is_file():
            raise BuildError(f"{self.where}: the figure {source} does not exist")
        name = f"figures/{path.name}"
        if self.figures.setdefault(name, path).resolve() != path.resolve():
            raise BuildError(f"{self.where}: two figures are named {path.name}: {self.figures[name]} and {source}")
        return f'<img class="figure" src="{html.escape(name)}" alt="{html.escape(alt)}">'


# ## Highlighting


def css_class(token_type) -> str:
    while token_type not in pygments.token.STANDARD_TYPES:
        token_type = token_type.parent
    return pygments.token.STANDARD_TYPES[token_type]


# A browser may break a line after any hyphen, and so in the middle of a flag (`--capture-` at the
# end of one line, `video` on the next), which a reader then types as two words. In the prose's
# commands, each word with a hyphen is kept whole; a long one may still break after a `/` or `=`.
LONGEST_UNBROKEN = 40


def unbroken_words(escaped: str) -> str:
    """HTML text in which no word with a hyphen breaks at the hyphen (`<span class="nobr">`)."""
    def whole(match: re.Match) -> str:
        word = match.group()
        if "-" not in word:
            return word
        pieces = re.findall(r"[^/=]*[/=]|[^/=]+$", word)
        return "<wbr>".join(f'<span class="nobr">{piece}</span>' if "-" in piece and len(piece) <= LONGEST_UNBROKEN
                            else piece for piece in pieces)
    return re.sub(r"[^\s<>]+", whole, escaped)


def tokens_to_html(tokens, where: str = "", first_line: int | None = None, unbroken: bool = False) -> list[str]:
    """Pygments tokens as HTML spans, one string per line of the text; neighbours of one kind share a span.

    Given `first_line`, the tokens are a script's: math in its comments is rendered, and an error
    in it names `where` and the line. A code block quoted in prose is shown as it is, with its
    words unbroken at hyphens if `unbroken`.
    """
    lines: list[list[list]] = [[]]  # per line: [css class, is a comment, text]
    for token_type, value in tokens:
        name = css_class(token_type)
        name = "" if name == "w" else name
        for i, part in enumerate(value.split("\n")):
            if i:
                lines.append([])
            if not part:
                continue
            if lines[-1] and lines[-1][-1][0] == name:
                lines[-1][-1][2] += part
            else:
                lines[-1].append([name, token_type in pygments.token.Comment, part])
    html_lines = []
    for number, parts in enumerate(lines):
        place = f"{where}:{first_line + number}" if first_line is not None else where
        spans = []
        for name, is_comment, text in parts:
            if is_comment and first_line is not None:
                inner = comment_with_math(text, place)
            else:
                inner = html.escape(text, quote=False)
                inner = unbroken_words(inner) if unbroken else inner
            spans.append(f'<span class="{name}">{inner}</span>' if name else inner)
        html_lines.append("".join(spans))
    return html_lines


def highlight_python(source: str, name: str) -> list[str]:
    """The HTML of each line of a script, highlighted as one whole, so that a string that spans
    lines is coloured right on every line."""
    lexer = PythonLexer(stripnl=False, ensurenl=False)
    highlighted = tokens_to_html(pygments.lex(source, lexer), name, first_line=1)
    expected = len(source_lines(source))
    if len(highlighted) < expected:
        raise BuildError(f"{name}: highlighting gave {len(highlighted)} lines for {expected}")
    return highlighted[:expected]


# ## Pages


@dataclass
class Script:
    path: Path
    source: str
    title: str
    summary: str
    """Markdown: what the page teaches."""

    @property
    def page(self) -> str:
        return self.path.stem + ".html"


def page_head(title: str) -> str:
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n"
        '<link rel="stylesheet" href="style.css">\n'
        "</head>\n"
    )


def contents_list(headings: list[tuple[int, str, str]]) -> str:
    """The `##` and `###` headings as a nested list of links."""
    items = [(level, anchor, inner) for level, anchor, inner in headings if level in (2, 3)]
    if not items:
        return ""
    out = ['<nav class="contents" aria-label="Contents">\n<p class="contents-title">Contents</p>\n<ol>\n']
    in_sublist = False
    for i, (level, anchor, inner) in enumerate(items):
        link = f'<a href="#{anchor}">{inner}</a>'
        if level == 2:
            if in_sublist:
                out.append("</ol>\n")
                in_sublist = False
            out.append(("</li>\n" if i else "") + f"<li>{link}")
            continue
        if not in_sublist:
            out.append(("" if i else "<li>") + "\n<ol>\n")
            in_sublist = True
        out.append(f"<li>{link}</li>\n")
    out.append(("</ol>\n" if in_sublist else "") + "</li>\n</ol>\n</nav>\n")
    return "".join(out)


def render_script_page(script: Script, links: dict[str, str], root: Path = ROOT,
                       figures: dict[str, Path] | None = None) -> str:
    """The page of one script; the figures it shows are added to `figures`."""
    name = script.path.name
    lines = source_lines(script.source)
    code_html = highlight_python(script.source, name)
    markdown = Markdown(links, root, figures)
    sections = split_sections(script.source, name)
    # Prose first, so that every heading is known when the contents are placed in the first section.
    proses = ["".join(f'<div class="note" data-line="{piece.line}">\n'
                      f'{markdown.render(piece.text, f"{name}:{piece.line}")}</div>\n'
                      for piece in section.prose if piece.text.strip())
              for section in sections]
    proses[0] += contents_list(markdown.headings)

    rows = []
    for section, prose in zip(sections, proses):
        code = []
        for previous, number in zip([None] + section.code, section.code):
            # Mark where lines of code were left out (a docstring or a comment shown as prose).
            if previous is not None and any(lines[n - 1].strip() for n in range(previous + 1, number)):
                code.append('<span class="gap" aria-hidden="true"></span>')
            # The number is drawn by CSS from `data-n`, so that copying the code leaves it behind; it
            # links to the line, for the mouse only. `--indent` (the line's leading spaces) lets a line
            # too long for the column wrap to 4 columns past its own indentation.
            indent = len(lines[number - 1]) - len(lines[number - 1].lstrip(" "))
            style = f' style="--indent:{indent}"' if indent else ""
            code.append(f'<span class="line" id="L{number}"{style}><a class="ln" href="#L{number}" data-n="{number}" '
                        f'tabindex="-1" aria-hidden="true"></a>{code_html[number - 1]}</span>\n')
        attributes = "".join([' class="section"' if prose else ' class="section no-prose"',
                              f' data-definition="{section.definition}"' if section.definition else "",
                              f' data-first-line="{section.code[0]}"' if section.code else ""])
        code_column = f'<pre><code>{"".join(code)}</code></pre>' if code else ""
        rows.append(f'<section{attributes}>\n<div class="prose">\n{prose}</div>\n'
                    f'<div class="code">{code_column}</div>\n</section>\n')

    return (page_head(f"{script.title} · {name}")
            + '<body class="script-page">\n'
            + f'<header class="bar"><a href="index.html">{html.escape(PROJECT)}</a>'
            + f'<span class="sep">/</span><span class="file">{html.escape(name)}</span></header>\n'
            + f'<main>\n{"".join(rows)}</main>\n'
            + f"<footer class=\"bar\">Generated from <code>{html.escape(name)}</code> by "
            + "<code>docs/build.py</code>; the line numbers are those of the script.</footer>\n"
            + "</body>\n</html>\n")


# ## The index


def readme_parts(readme: str) -> tuple[str, str, dict[str, str], str]:
    """The README's title, its first paragraph, its table of scripts (file -> what it teaches) and
    its `## Results` section, all as Markdown."""
    title_match = re.search(r"^# (.+)$", readme, re.M)
    title = title_match.group(1).strip() if title_match else PROJECT
    paragraphs = re.split(r"\n\s*\n", readme[title_match.end():] if title_match else readme)
    intro = next((p.strip() for p in paragraphs if p.strip() and not p.lstrip().startswith(("|", "#", "```"))), "")
    table = {}
    for row in re.finditer(r"^\|\s*\[`?([\w.-]+\.py)`?\]\([^)]*\)\s*\|(.+)\|\s*$", readme, re.M):
        table[row.group(1)] = row.group(2).strip()
    results = re.search(r"^## Results\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    return title, intro, table, ("## Results\n" + results.group(1).strip() + "\n") if results else ""


def module_title_and_summary(source: str) -> tuple[str | None, str]:
    """The first `# ` heading of the module docstring and the paragraph after it."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    title = re.search(r"^# (.+)$", docstring, re.M)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", docstring[title.end():] if title else docstring)]
    summary = next((p for p in paragraphs if p and not p.startswith(("#", "```"))), "")
    return (title.group(1).strip() if title else None), summary


def render_index(scripts: list[Script], readme: str, links: dict[str, str], root: Path = ROOT,
                 figures: dict[str, Path] | None = None) -> str:
    title, intro, _, results = readme_parts(readme)
    markdown = Markdown(links, root, figures)
    cards = []
    for script in scripts:
        cards.append(
            f'<li class="card">\n<h3><a href="{script.page}">{html.escape(script.title)}</a></h3>\n'
            f'<p class="file"><a href="{script.page}"><code>{html.escape(script.path.name)}</code></a></p>\n'
            f'{markdown.render(script.summary, script.path.name)}</li>\n')
    return (
        page_head(title)
        + '<body class="index-page">\n<main class="index">\n'
        + f"<h1>{html.escape(title)}</h1>\n"
        + markdown.render(intro, "README.md")
        + '<h2 id="pages">The pages</h2>\n'
        + "<p>Each page is one script, whole: the prose on the left explains the code on its right "
        + "(on a phone, the prose comes first), the page reads in the order the algorithm runs, and "
        + "the line numbers are those of the file.</p>\n"
        + f'<ul class="cards">\n{"".join(cards)}</ul>\n'
        + markdown.render(results, "README.md")
        + "</main>\n"
        + '<footer class="bar">Generated by <code>docs/build.py</code> from the scripts and '
        + "<code>README.md</code>.</footer>\n"
        + "</body>\n</html>\n"
    )


# ## Building and checking


def find_scripts(root: Path) -> list[Script]:
    """The scripts at `root`, in the order of the README's table, then by name."""
    readme_path = root / "README.md"
    readme = readme_path.read_text(encoding="utf-8") if readme_path.exists() else ""
    table = readme_parts(readme)[2]
    order = list(table)
    paths = sorted(root.glob("*.py"), key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name))
    scripts = []
    for path in paths:
        source = read_source(path)
        try:
            title, summary = module_title_and_summary(source)
        except SyntaxError as error:
            raise BuildError(f"{path.name}:{error.lineno}: cannot parse: {error.msg}") from None
        scripts.append(Script(path, source, title or path.name, table.get(path.name, summary)))
    return scripts


def build(root: Path = ROOT) -> dict[Path, str | bytes]:
    """Every generated file, by path, as it should be now: the pages (text) and the figures they show (bytes)."""
    scripts = find_scripts(root)
    links = {script.path.name: script.page for script in scripts}
    links.update({f"./{script.path.name}": script.page for script in scripts})
    docs = root / "docs"
    figures: dict[str, Path] = {}
    pages: dict[Path, str | bytes] = {docs / script.page: render_script_page(script, links, root, figures)
                                      for script in scripts}
    readme_path = root / "README.md"
    readme = readme_path.read_text(encoding="utf-8") if readme_path.exists() else ""
    pages[docs / "index.html"] = render_index(scripts, readme, links, root, figures)
    pages.update({docs / name: source.read_bytes() for name, source in figures.items()})
    return pages


def generated_files(root: Path) -> list[Path]:
    """The files in `docs/` that the build makes: the pages and the copied figures."""
    return sorted((root / "docs").glob("*.html")) + sorted((root / "docs" / "figures").glob("*"))


def is_current(path: Path, content: str | bytes) -> bool:
    if not path.exists():
        return False
    return path.read_bytes() == content if isinstance(content, bytes) else path.read_text(encoding="utf-8") == content


def stale_pages(root: Path = ROOT) -> list[str]:
    """What `--check` reports: pages and figures missing or different, and generated files with no source left."""
    pages = build(root)
    problems = []
    for path, content in pages.items():
        if not path.exists():
            problems.append(f"{path.relative_to(root)} is missing")
        elif not is_current(path, content):
            problems.append(f"{path.relative_to(root)} is stale")
    for path in generated_files(root):
        if path not in pages:
            problems.append(f"{path.relative_to(root)} has no source behind it any more")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docs/build.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a page is missing or differs from what the sources make")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = stale_pages()
            for problem in problems:
                print(f"docs/build.py --check: {problem}", file=sys.stderr)
            if problems:
                print("regenerate the pages with: python docs/build.py", file=sys.stderr)
            return 1 if problems else 0
        pages = build()
    except BuildError as error:
        print(f"docs/build.py: error: {error}", file=sys.stderr)
        return 2
    for path, content in pages.items():
        if not is_current(path, content):
            path.parent.mkdir(exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8", newline="\n")
            print(f"wrote {path.relative_to(ROOT)}")
    for path in generated_files(ROOT):
        if path not in pages:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)}: its source is gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
