"""The pages in docs/ as a reader sees them, opened in headless Chromium.

Where no Chromium is found these tests are skipped, with the reason; CI installs Debian's
`chromium` and sets DOCS_BROWSER_REQUIRED=1, which turns that skip into a failure. CHROMIUM names
another Chromium or Chrome binary.
"""

import ast
import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import cv2
import numpy as np
import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
SCRIPTS = sorted(ROOT.glob("*.py"))
PAGES = [f"{script.stem}.html" for script in SCRIPTS]
LAPTOP = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}
# Headless on a machine with no display, no GPU and no network: without the last four flags,
# Chromium keeps trying to reach Google's services.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def find_chromium() -> str | None:
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def skip_or_fail(reason: str) -> None:
    if os.environ.get("DOCS_BROWSER_REQUIRED") == "1":
        pytest.fail(f"{reason} (DOCS_BROWSER_REQUIRED=1: these tests must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    chromium = find_chromium()
    if chromium is None:
        skip_or_fail("no Chromium to open the pages in: install it (`apt-get install chromium` on Debian) "
                     "or set CHROMIUM to a Chromium or Chrome binary")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("Playwright is not installed: pip install -r requirements.txt")
    with sync_playwright() as playwright:
        # Playwright drives the Chromium found here; it never downloads a browser of its own.
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


class Opened:
    """A page loaded in a fresh context, with every request it made. Any request for something
    outside docs/ is refused and recorded, so a page that needs the network shows it here."""

    def __init__(self, browser, url: str, viewport: dict):
        self.outside: list[str] = []
        self.loaded: list[str] = []
        self.failed: list[str] = []
        self.context = browser.new_context(viewport=viewport, device_scale_factor=1)
        self.context.route("**/*", self._guard)
        self.page = self.context.new_page()
        self.page.on("requestfailed", lambda request: self.failed.append(request.url))
        self.page.goto(url, wait_until="load")
        self.page.evaluate("document.fonts.ready.then(() => true)")

    def _guard(self, route) -> None:
        url = route.request.url
        parsed = urlparse(url)
        inside = parsed.scheme == "file" and Path(unquote(parsed.path)).resolve().is_relative_to(DOCS)
        local = parsed.scheme == "http" and parsed.hostname == "127.0.0.1"
        if inside or local:
            self.loaded.append(url)
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()


@pytest.fixture(scope="module")
def opened(browser):
    """Open a page of docs/ from its file at a viewport; each is loaded once for all the tests."""
    cache: dict[tuple[str, int], Opened] = {}

    def open_page(name: str, viewport: dict) -> Opened:
        key = (name, viewport["width"])
        if key not in cache:
            cache[key] = Opened(browser, (DOCS / name).as_uri(), viewport)
        return cache[key]

    yield open_page
    for page in cache.values():
        page.context.close()


def test_there_is_a_page_for_every_script():
    missing = [name for name in PAGES + ["index.html"] if not (DOCS / name).exists()]
    assert not missing, f"no page {missing}: run `python docs/build.py`"


@pytest.mark.parametrize("name", PAGES + ["index.html"])
@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
def test_a_page_loads_only_files_of_docs(opened, name, viewport):
    page = opened(name, viewport)
    assert page.outside == [], f"{name} asked the network for {page.outside}"
    assert page.failed == [], f"{name} could not load {page.failed}"
    assert any(url.endswith("/style.css") for url in page.loaded)


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
@pytest.mark.parametrize("name", PAGES + ["index.html"])
def test_a_screenshot_is_not_blank(opened, name, viewport):
    png = opened(name, viewport).page.screenshot()
    image = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_GRAYSCALE)
    assert image.shape == (viewport["height"], viewport["width"])
    values, counts = np.unique(image, return_counts=True)
    ink = 1 - counts.max() / image.size  # pixels not of the most common shade
    assert ink > 0.05 and len(values) > 32 and image.std() > 8, f"{name} looks blank: {ink:.1%} ink"


# What is left of LaTeX when it was not rendered: a command, or math still between dollars.
RAW_LATEX = re.compile(r"\\[A-Za-z]+|\\[{}\[\]()]|\$\$|(?<![\w$])\$[^\s$][^$]*(?<=[^\s$])\$(?![\w$])")

VISIBLE_TEXT = """() => {
  const text = [];
  for (const note of document.querySelectorAll('.note, .index > p, .index li, .index td')) {
    const copy = note.cloneNode(true);
    copy.querySelectorAll('code, pre, math').forEach(e => e.remove());
    text.push(copy.textContent);
  }
  for (const comment of document.querySelectorAll('.code .c1, .code .c, .code .cm')) {
    const copy = comment.cloneNode(true);
    copy.querySelectorAll('math').forEach(e => e.remove());
    text.push(copy.textContent);
  }
  for (const math of document.querySelectorAll('math')) text.push(math.textContent);
  return text;
}"""


@pytest.mark.parametrize("name", PAGES + ["index.html"])
def test_no_raw_latex_is_left_in_the_visible_text(opened, name):
    texts = opened(name, LAPTOP).page.evaluate(VISIBLE_TEXT)
    raw = sorted({match.group(0) for text in texts for match in RAW_LATEX.finditer(text)})
    assert texts and not raw, f"{name} shows LaTeX that was not rendered: {raw}"


@pytest.mark.parametrize("name", PAGES)
def test_every_math_element_is_drawn_with_a_math_font(opened, name):
    page = opened(name, LAPTOP).page
    sizes = page.evaluate("""() => [...document.querySelectorAll('math')].map(m => {
        const box = m.getBoundingClientRect();
        return [m.textContent, box.width, box.height];
    })""")
    assert sizes, f"{name} has no math"
    unsized = [text for text, width, height in sizes if not (width > 0 and height > 0)]
    assert not unsized, f"{name}: math with no rendered size: {unsized[:5]}"
    # The font that gives MathML its stretchy brackets and accents: bundled in docs/fonts.
    assert page.evaluate("""() => [...document.fonts].some(f => f.family.replace(/"/g, '') === 'Page Math'
                                                             && f.status === 'loaded')""")


def definitions(script: Path) -> list[tuple[str, int, int | None]]:
    """(name, first line with decorators, line of its docstring or None) of every def and class."""
    source = script.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            body = node.body[0]
            documented = (isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant)
                          and isinstance(body.value.value, str))
            found.append((node.name, first, body.lineno if documented else None))
    return found


SECTIONS = """() => [...document.querySelectorAll('main > .section')].map(section => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const prose = section.querySelector('.prose'), code = section.querySelector('.code pre');
  return {
    firstLine: Number(section.dataset.firstLine || 0),
    notes: [...section.querySelectorAll('.note')].map(n => Number(n.dataset.line)),
    proseText: prose.textContent.trim().length,
    prose: box(prose),
    code: code ? box(code) : null,
    lines: [...section.querySelectorAll('.line')].map(l => Number(l.id.slice(1))),
  };
})"""


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_definition_starts_a_section_beside_its_docstring(opened, script):
    sections = opened(f"{script.stem}.html", LAPTOP).page.evaluate(SECTIONS)
    by_first_line = {section["firstLine"]: section for section in sections}
    for name, first, docstring in definitions(script):
        section = by_first_line.get(first)
        assert section is not None, f"{script.name}:{first}: `{name}` does not start a section"
        if docstring is not None:
            assert docstring in section["notes"], f"{script.name}:{first}: the docstring of `{name}` is not beside it"
    for section in sections:
        if section["proseText"] and section["code"]:
            left, top, right, _ = section["prose"]
            code_left, code_top, _, _ = section["code"]
            where = f"{script.name}:{section['firstLine']}"
            assert right <= code_left + 1 and right - left >= 300, f"{where}: the prose is not left of its code"
            assert abs(top - code_top) <= 12, f"{where}: the prose and its code do not start level"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_on_a_phone_prose_comes_above_its_code_and_nothing_is_too_wide(opened, script):
    page = opened(f"{script.stem}.html", PHONE).page
    for section in page.evaluate(SECTIONS):
        if section["proseText"] and section["code"]:
            assert section["prose"][3] <= section["code"][1] + 1, f"{script.name}:{section['firstLine']}"
            assert section["code"][2] - section["code"][0] >= PHONE["width"] - 2
    too_wide = page.evaluate("""() => [...document.querySelectorAll('.prose *')]
        .filter(e => !e.closest('pre, .math-display, table') && e.getBoundingClientRect().right > innerWidth + 1)
        .map(e => e.tagName + ': ' + e.textContent.slice(0, 60))""")
    assert not too_wide, f"{script.name}: wider than a phone: {too_wide[:5]}"
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]


# Every block of code or commands, and every line in it, that reaches past the right edge of its box.
# Such text is hidden: a headless or touch browser draws no scroll bar to say that there is more.
CUT_OFF = """() => {
  const cut = [];
  for (const pre of document.querySelectorAll('pre')) {
    const right = pre.getBoundingClientRect().right;
    if (pre.scrollWidth > pre.clientWidth + 1) cut.push('block: ' + pre.textContent.slice(0, 60));
    for (const line of pre.querySelectorAll('.line'))
      for (const rect of line.getClientRects())
        if (rect.right > right + 1) cut.push(line.id + ': ' + line.textContent.slice(0, 60));
  }
  return cut;
}"""


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
@pytest.mark.parametrize("name", PAGES + ["index.html"])
def test_no_code_or_command_is_cut_off_at_the_right(opened, name, viewport):
    page = opened(name, viewport).page
    cut = page.evaluate(CUT_OFF)
    assert not cut, f"{name} hides the end of {len(cut)} lines: {cut[:5]}"
    # A long line wraps, and its continuation starts right of where the line itself starts.
    if name != "index.html":
        assert page.evaluate("document.querySelectorAll('.prose pre.block').length") > 0  # the commands
        hanging = page.evaluate("""() => [...document.querySelectorAll('.code .line')]
            .filter(l => l.getClientRects().length === 1 && l.getBoundingClientRect().height > 30).slice(0, 20)
            .map(l => { const r = document.createRange(); r.selectNodeContents(l);
                        const rects = [...r.getClientRects()].filter(x => x.width > 0);
                        return [l.id, rects[0].left, Math.min(...rects.filter(x => x.top > rects[0].top + 5).map(x => x.left))]; })""")
        assert hanging, f"{name}: no line long enough to wrap at {viewport['width']} px"
        assert all(continued > first for _, first, continued in hanging), hanging


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_code_lines_carry_the_line_numbers_of_the_script(opened, script):
    lines = script.read_text().split("\n")
    shown = opened(f"{script.stem}.html", LAPTOP).page.evaluate("""() => [...document.querySelectorAll('.line')]
        .filter(l => !l.querySelector('math')).map(l => [Number(l.id.slice(1)), l.textContent])""")
    assert len(shown) > len(lines) / 3
    wrong = [number for number, text in shown if text != lines[number - 1]]
    assert not wrong, f"{script.name}: lines {wrong[:10]} differ from the script"
    numbers = [number for number, _ in shown]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)


@pytest.mark.parametrize("name", PAGES)
def test_the_contents_link_to_headings(opened, name):
    targets = opened(name, LAPTOP).page.evaluate("""() => [...document.querySelectorAll('nav.contents a')]
        .map(a => [a.getAttribute('href'), !!document.getElementById(a.getAttribute('href').slice(1))])""")
    assert targets and all(found for _, found in targets), targets


def test_the_index_links_every_page_and_shows_the_results(opened):
    page = opened("index.html", LAPTOP).page
    links = page.evaluate("() => [...document.querySelectorAll('.cards a')].map(a => a.getAttribute('href'))")
    assert set(PAGES) <= set(links)
    headings = page.evaluate("() => [...document.querySelectorAll('h2')].map(h => h.textContent)")
    assert any("Results" in heading for heading in headings)
    assert page.evaluate("document.querySelectorAll('table td').length") > 0


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
@pytest.mark.parametrize("name", PAGES + ["index.html"])
def test_every_figure_loads_says_what_it_shows_and_fits_its_column(opened, name, viewport):
    page = opened(name, viewport).page
    page.evaluate("Promise.all([...document.images].map(i => i.decode().catch(() => null)))")
    figures = page.evaluate("""() => [...document.querySelectorAll('img')].map(i => ({
        src: i.getAttribute('src'), alt: i.alt, loaded: i.complete && i.naturalWidth > 0,
        width: i.getBoundingClientRect().width, room: i.parentElement.getBoundingClientRect().width}))""")
    for figure in figures:
        assert figure["src"].startswith("figures/") and figure["loaded"], figure
        assert len(figure["alt"].split()) >= 5, f"the alt text of {figure['src']} should say what it shows"
        assert 0 < figure["width"] <= figure["room"] + 1, figure
    if name == "index.html":
        assert figures, "the README's results open with the learning curves"
    if viewport is LAPTOP:
        # Drawn near their own size (800 px), so that the legend's 8-point text can be read.
        page_width = page.evaluate("() => [...document.images].map(i => [i.naturalWidth, i.getBoundingClientRect().width])")
        assert all(shown >= 0.9 * natural for natural, shown in page_width), (name, page_width)


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
@pytest.mark.parametrize("name", PAGES + ["index.html"])
def test_no_command_in_the_prose_breaks_in_the_middle_of_a_flag(opened, name, viewport):
    page = opened(name, viewport).page
    words = page.evaluate("""() => [...document.querySelectorAll('.prose code, .index code')]
        .flatMap(c => [...c.querySelectorAll('.nobr')]).map(w => [w.textContent, w.getClientRects().length])""")
    assert any(text.startswith("--") for text, _ in words), f"{name}: no flag in the prose"
    broken = [text for text, lines in words if lines != 1]
    assert not broken, f"{name}: broken across lines: {broken[:5]}"


def test_the_folder_serves_as_a_static_site(browser):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(DOCS))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/"
        index = Opened(browser, base + "index.html", LAPTOP)
        try:
            for link in index.page.evaluate("() => [...document.querySelectorAll('.cards h3 a')].map(a => a.href)"):
                response = index.page.goto(link)
                assert response.ok, link
                # Let the page's math font finish loading: leaving a page first cancels its request,
                # which would be recorded as a failed load (seen on a loaded 2-core machine).
                index.page.evaluate("document.fonts.ready.then(() => true)")
                assert index.page.evaluate("document.querySelectorAll('main > .section').length") > 10
            assert index.outside == [] and index.failed == []
        finally:
            index.context.close()
    finally:
        server.shutdown()
        server.server_close()
