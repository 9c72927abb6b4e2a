"""The video writer and the tracking helpers each script holds its own copy of: one text, and a
video that decodes as H.264 and plays in Chromium, where OpenCV's mp4v does not."""

import ast
from pathlib import Path

import cv2
import numpy as np
import pytest

import ppo_atari
from conftest import ROOT
from videos import assert_plays, chromium_plays, h264_frames

SCRIPTS = ["ppo_atari.py", "vpg_continuous.py", "ppo_jax.py"]


def definition(script: str, name: str) -> str:
    source = (ROOT / script).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"{script} defines no {name}")


@pytest.mark.parametrize("name", ["Video", "import_wandb", "start_tracking"])
def test_the_copies_are_one_text(name):
    assert len({definition(script, name) for script in SCRIPTS}) == 1, f"the {name} copies differ"


def frames(count: int, height: int, width: int) -> list[np.ndarray]:
    """A bright square moving over a dark background, so that every frame differs."""
    shown = []
    for index in range(count):
        frame = np.full((height, width, 3), 30, np.uint8)
        frame[10:30, 2 * index:2 * index + 20] = (250, 200, 20)
        shown.append(frame)
    return shown


def test_an_odd_sized_video_is_padded_to_even_and_plays(tmp_path):
    path = tmp_path / "odd.mp4"
    video = ppo_atari.Video(path, 15)
    for frame in frames(25, 101, 161):
        video.write(frame)
    video.close()
    video.close()  # a second close does nothing
    assert_plays(path, 162, 102, frames=25)
    # The picture survives the encoding: the square is where it was drawn.
    decoded = cv2.VideoCapture(str(path)).read()[1][:, :, ::-1]
    assert decoded.shape == (102, 162, 3) and decoded[20, 10, 0] > 200 and decoded[60, 100].max() < 60


def test_opencv_mp4v_is_what_chromium_refused(tmp_path):
    # What --capture-video wrote before: MPEG-4 Part 2, which Chromium cannot play (MEDIA_ERR_SRC_NOT_SUPPORTED).
    path = tmp_path / "mp4v.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 15, (160, 100))
    for frame in frames(25, 100, 160):
        writer.write(frame)
    writer.release()
    assert h264_frames(Path(path))[0] == "mpeg4"
    assert chromium_plays(path)["error"] == 4
