"""validate on an image job says what the row with the most images needs: its image tokens, the patches
the vision tower sees, the memory of encoding them and of their features, and the bound on a tower call
with what the engine keeps free for it; figures from the tiny LLaVA's config (vision/memory.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.tiers import engine_fixture
from tests.vision_models import IMAGE_TOKENS, make_image, make_llava

pytestmark = pytest.mark.timeout(300)


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


def test_validate_says_what_the_largest_image_row_needs(llava, tmp_path, monkeypatch):
    from transformers import AutoConfig

    from batchjob.cli import main
    from batchjob.engine.vision import memory

    monkeypatch.setattr(memory, "TOWER_CALL_PATCHES", 16)  # a call's floor under the tiny tower's 2 images

    make_image(1).save(tmp_path / "a.png")
    make_image(2, (60, 40)).save(tmp_path / "b.png")
    rows = [("r0", "a.png"), ("r1", ["a.png", "b.png"]), ("r2", None)]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"rid": r, "prompt": "x", "image": i}) + "\n" for r, i in rows)
    )
    args = ["validate", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--model", llava]
    args += ["--image-column", "image", "--device", "cpu", "--max-num-batched-tokens", 20]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    config = AutoConfig.from_pretrained(llava)
    tower = memory.Tower.of(config)
    n = 2 * IMAGE_TOKENS  # the tiny tower: one token a patch
    assert (
        f"images: the row with the most, in.jsonl line 2, has 2 (24 x 20, 60 x 40): {n} image tokens"
        in result.output
    ), result.output
    encode = tower.encode_bytes(n, IMAGE_TOKENS, 4) / 2**20
    assert f"{n} patches to the vision tower; encoding them takes about {encode:.1f} MiB" in result.output
    assert "vision tower: at most 20 patches a call (--max-num-batched-tokens, at least 16)" in result.output
    assert f"(that row's {n} patches are over the bound" in result.output
