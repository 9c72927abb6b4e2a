"""What a test asks of a video the scripts write: H.264 that decodes, and that Chromium plays."""

from pathlib import Path

import av

from test_docs_pages import CHROMIUM_FLAGS, find_chromium, skip_or_fail


def h264_frames(path: Path) -> tuple[str, str, int, int, int]:
    """(codec, pixel format, width, height, frames decoded) of the mp4 at `path`."""
    with av.open(str(path)) as file:
        stream = file.streams.video[0]
        frames = sum(1 for _ in file.decode(stream))
        return stream.codec_context.name, stream.codec_context.pix_fmt, stream.width, stream.height, frames


PLAYER = """<!doctype html><video id="video" muted preload="auto" src="{name}"></video>"""


def chromium_plays(path: Path) -> dict:
    """Load the mp4 in a <video> element of a file:// page in headless Chromium; what the element reports
    once it has a frame to show (`readyState` 2 or more) or gave up (`error`)."""
    chromium = find_chromium()
    if chromium is None:
        skip_or_fail("no Chromium to play the video in: install it (`apt-get install chromium` on Debian)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("Playwright is not installed: pip install -r requirements.txt")
    page_path = path.with_name(path.stem + ".html")
    page_path.write_text(PLAYER.format(name=path.name))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(page_path.as_uri(), wait_until="load")
            page.wait_for_function("() => { const v = document.getElementById('video');"
                                   " return v.readyState >= 2 || v.error !== null; }", timeout=20_000)
            return page.evaluate("() => { const v = document.getElementById('video');"
                                 " return {readyState: v.readyState, width: v.videoWidth, height: v.videoHeight,"
                                 " duration: v.duration, error: v.error && v.error.code}; }")
        finally:
            browser.close()


def assert_plays(path: Path, width: int, height: int, frames: int | None = None) -> int:
    """`path` is H.264 in yuv420p of `width` x `height` (and `frames` frames), and Chromium plays it;
    the number of frames."""
    codec, pixels, actual_width, actual_height, decoded = h264_frames(path)
    assert (codec, pixels, actual_width, actual_height) == ("h264", "yuv420p", width, height)
    if frames is not None:
        assert decoded == frames
    played = chromium_plays(path)
    assert played["error"] is None, f"Chromium refused {path.name}: MediaError code {played['error']}"
    assert played["readyState"] >= 2 and (played["width"], played["height"]) == (width, height), played
    return decoded

