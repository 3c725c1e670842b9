"""``batchjob bench --image-sizes`` on the tiny LLaVA: ours against static generate on image rows, the
table's rows, total greedy agreement in float64, the JSON file; on the tiny LLaVA-NeXT, whose image token
counts follow the picture's size; a text model and bad sizes refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchjob.bench.images import NO_HF_CB, make_picture
from batchjob.cli import main
from tests.tiers import engine_fixture
from tests.vision_models import IMAGE_TOKENS, make_llava, make_llava_next


@engine_fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])  # rows built as admitted, or on two threads ahead (a job's way)
def test_image_rows_ours_against_static_generate(llava_dir, tmp_path, workers):
    out = tmp_path / "images.json"
    args = ["bench", "--model", str(llava_dir), "--image-sizes", "16,40", "--num-requests", "5"]
    args += ["--output-len", "3,6", "--dtype", "float64", "--device", "cpu", "--static-batch-size", "2"]
    args += ["--threads", "1", "--image-workers", str(workers), "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    text = result.output
    assert f"3 at 16 px ({IMAGE_TOKENS} image tokens), 2 at 40 px ({IMAGE_TOKENS} image tokens)" in text
    table = [line for line in text.splitlines() if line.startswith(("ours ", "static "))]
    assert [line.split()[0] for line in table] == ["ours", "static"], text
    assert "static batch_size=2" in table[1]
    assert NO_HF_CB in text and "hf-cb" not in text.replace(NO_HF_CB, "")
    assert "ratio ours/static (images/s" in text
    # float64: ours equals HF generate on the processor's batches token for token, every row
    assert "agreement: ours == static greedy tokens on 5/5 rows" in text

    body = json.loads(out.read_text())
    assert body["workload"]["rows_per_size"] == {"16": 3, "40": 2}
    assert body["agreement"]["static"] == {"equal": 5, "total": 5}
    assert [r["name"] for r in body["results"]] == ["ours", "static"]
    for r in body["results"]:
        assert r["error"] is None and r["images_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert 3 * 5 <= r["output_tokens"] <= 6 * 5
        assert 0 < r["extra"]["preprocess_seconds"] < r["wall_s"]
    ours = body["results"][0]
    assert ours["extra"]["encoded_images"] >= 5 and ours["settings"]["image_workers"] == workers
    assert 0 <= ours["extra"]["build_wait_seconds"] <= ours["wall_s"]
    assert f"the builds took {ours['extra']['preprocess_seconds']:.2f} s on {workers} thread(s)" in text
    assert set(body["ratios"]) == {"ours/static"} and body["ratios"]["ours/static"] > 0


@engine_fixture(scope="module")
def llava_next_dir(tmp_path_factory):
    return make_llava_next(tmp_path_factory.mktemp("llava_next") / "llava_next")


@pytest.mark.timeout(300)
def test_llava_next_rows_take_tokens_by_size(llava_next_dir, tmp_path):
    """Anyres tiles: a 16 px picture takes one grid, a 40 px one another, so the rows' prompts differ in
    length (static generate pads a batch to its longest); ours still equals static generate in float64."""
    out = tmp_path / "next.json"
    args = ["bench", "--model", str(llava_next_dir), "--image-sizes", "16,40", "--num-requests", "4"]
    args += ["--output-len", "3,5", "--dtype", "float64", "--device", "cpu", "--static-batch-size", "2"]
    args += ["--threads", "1", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 at 16 px (36 image tokens), 2 at 40 px (88 image tokens)" in result.output
    assert "agreement: ours == static greedy tokens on 4/4 rows" in result.output
    body = json.loads(out.read_text())
    assert body["workload"]["image_tokens_per_size"] == {"16": [36], "40": [88]}
    assert body["agreement"]["static"] == {"equal": 4, "total": 4}
    for r in body["results"]:
        assert r["images_per_s"] > 0 and r["output_tokens_per_s"] > 0
    assert body["results"][0]["extra"]["encoded_images"] >= 4


@pytest.mark.timeout(120)
def test_a_text_model_is_refused_before_work(tiny_model_dir):
    result = CliRunner().invoke(main, ["bench", "--model", str(tiny_model_dir), "--image-sizes", "224"])
    assert result.exit_code == 2, result.output
    assert "is a text model" in result.output and "llava" in result.output
    assert "Traceback" not in result.output and "loading" not in result.output


@pytest.mark.parametrize("sizes", ["224,x", "4", ""])
def test_bad_sizes_exit_2(sizes):
    result = CliRunner().invoke(main, ["bench", "--image-sizes", sizes])
    assert result.exit_code == 2, result.output
    assert "--image-sizes" in result.output and "Traceback" not in result.output


def test_default_model_is_refused():
    result = CliRunner().invoke(main, ["bench", "--image-sizes", "224"])
    assert result.exit_code == 2, result.output
    assert "needs a vision-language model" in result.output


def test_pictures_differ_and_have_their_size():
    a, b = make_picture(0, 64), make_picture(1, 64)
    assert a.size == (64, 64) and make_picture(2, 448).size == (448, 448)
    assert a.tobytes() != b.tobytes()
    assert make_picture(0, 64).tobytes() == a.tobytes()  # drawn from (seed, index): the same every run
