"""`kapitsa run --image`: images before the prompt's text, on a tiny Qwen3.5 checkpoint with its
vision tower, through the real opener and loader; refusals come before the weights load."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kapitsa.commands.run import RunOptions, cmd_run, make_request
from kapitsa.errors import InvalidRequest
from kapitsa.testing.tiny import write_tiny_checkpoint


def _png(path: Path, fill: int) -> Path:
    out = io.BytesIO()
    Image.fromarray(np.full((24, 40, 3), fill, dtype=np.uint8)).save(out, "PNG")
    path.write_bytes(out.getvalue())
    return path


def _run(model: Path, *images: Path):  # noqa: ANN202 - RunResult
    options = RunOptions(
        model=str(model),
        prompt="Describe it.",
        max_tokens=8,
        json_out=True,
        speculative="none",
        images=images,
    )
    return cmd_run(options, write=lambda _text: None)


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vl") / "qwen", "qwen3_5", vision=True)


def test_the_image_decides_the_answer(vision_model: Path, tmp_path: Path) -> None:
    black, white = _png(tmp_path / "black.png", 0), _png(tmp_path / "white.png", 255)
    first = _run(vision_model, black)
    assert first.token_ids == _run(vision_model, black).token_ids
    assert first.token_ids != _run(vision_model, white).token_ids
    # a 40x24 image is (24/4)*(40/4)/4 = 15 tokens after the 2x2 merge; the second adds its own
    image_tokens = (24 // 4) * (40 // 4) // 4
    assert _run(vision_model, black, white).prompt_tokens - first.prompt_tokens >= image_tokens


def test_a_text_only_model_refuses_images(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "text", "qwen3_5")
    with pytest.raises(InvalidRequest, match="reads text only"):
        _run(model, _png(tmp_path / "a.png", 0))


def test_bad_images_fail_before_loading(tmp_path: Path) -> None:
    (tmp_path / "not.png").write_bytes(b"not an image")
    base = dict(model="nowhere", prompt="x")
    with pytest.raises(InvalidRequest, match="not.png.*could not be decoded"):
        make_request("x", RunOptions(**base, images=(tmp_path / "not.png",)))
    with pytest.raises(InvalidRequest, match="cannot read the image"):
        make_request("x", RunOptions(**base, images=(tmp_path / "missing.png",)))
    with pytest.raises(InvalidRequest, match="drop --raw"):
        make_request("x", RunOptions(**base, raw=True, images=(_png(tmp_path / "a.png", 0),)))
