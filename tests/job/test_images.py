"""Jobs with an image column (--image-column) over the tiny LLaVA, float64: each row's greedy tokens equal HF
``generate`` on the processor's inputs (binary cells, datasets Image structs, paths, lists, text-only rows);
bad images are error rows naming the row and the image; a text model is refused; a changed image file refuses
the resume; validate lists the images it can't open; a kill -9 then resume equals an uninterrupted run."""

from __future__ import annotations

import base64
import json
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchjob.job.requests import COMPLETIONS_NO_SYSTEM
from tests.faultproc import wait_for_points
from tests.jobproc import read_results, run_here
from tests.tiers import engine_fixture
from tests.vision_models import make_image, make_llava, png_bytes

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 8


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = make_llava(tmp_path_factory.mktemp("llava") / "llava")
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    return folder, AutoProcessor.from_pretrained(folder), hf


def _hf_tokens(processor, hf, images, text) -> list[int]:
    """HF generate on the processor's own inputs (its apply_chat_template, tokenized, images in the content)."""
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    # every output of the processor (a family's extras: image_sizes, pixel_attention_mask), pixels in float64
    kwargs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.inference_mode():
        out = hf.generate(**kwargs, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _args(inp, out, folder, *extra) -> list[str]:
    args = [
        "--input",
        inp,
        "--output",
        out,
        "--model",
        folder,
        "--image-column",
        "image",
        "--id-column",
        "rid",
    ]
    args += ["--max-new-tokens", MAX_NEW, "--device", "cpu", "--dtype", "float64", "--logprobs", "0"]
    return [str(a) for a in [*args, *extra]]


def _tokens(row) -> list[int]:
    return [t["token_id"] for t in row["logprobs"]]


def _write_inputs(root):
    """Three inputs of one job's rows, one per way of holding an image, and the images they name."""
    (root / "imgs").mkdir()
    make_image(7).save(root / "imgs" / "a.png")
    make_image(8, (30, 18)).save(root / "imgs" / "b.png")
    binary = pa.table(
        {
            "rid": ["b0", "b1", "b2", "b3"],
            "prompt": ["What is it?", "What is it?", "The quick brown fox", "Paris is"],
            "image": pa.array([png_bytes(1), png_bytes(5), None, png_bytes(3)], pa.binary()),
        }
    )
    pq.write_table(binary, root / "binary.parquet")
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    structs = pa.table(
        {
            "rid": ["s0", "s1", "s2"],
            "prompt": ["Describe.", "Compare these two.", "No image here"],
            "image": pa.array(
                [
                    [{"bytes": png_bytes(2), "path": "ignored.png"}],
                    [{"bytes": None, "path": "imgs/a.png"}, {"bytes": png_bytes(4), "path": None}],
                    [],
                ],
                pa.list_(struct),
            ),
        }
    )
    pq.write_table(structs, root / "structs.parquet")
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(6)).decode()
    lines = [
        ("p0", "imgs/a.png"),
        ("p1", ["imgs/b.png", str(root / "imgs" / "a.png"), data_url]),
        ("p2", None),
    ]
    with open(root / "paths.jsonl", "w") as f:
        for rid, image in lines:
            f.write(json.dumps({"rid": rid, "prompt": f"Look at {rid}", "image": image}) + "\n")


def _expected_images(root, rid):
    """The Pillow images each row holds, as the test wrote them."""
    from PIL import Image

    a, b = (
        Image.open(root / "imgs" / "a.png").convert("RGB"),
        Image.open(root / "imgs" / "b.png").convert("RGB"),
    )
    return {
        "b0": [make_image(1)],
        "b1": [make_image(5)],
        "b2": [],
        "b3": [make_image(3)],
        "s0": [make_image(2)],
        "s1": [a, make_image(4)],
        "s2": [],
        "p0": [a],
        "p1": [b, a, make_image(6)],
        "p2": [],
    }[rid]


@pytest.mark.parametrize("name", ["binary.parquet", "structs.parquet", "paths.jsonl"])
def test_image_rows_equal_hf_generate(llava, tmp_path, name):
    """Every row's tokens equal HF generate's on the processor's inputs; two images under one text differ."""
    folder, processor, hf = llava
    _write_inputs(tmp_path)
    code, output = run_here(_args(tmp_path / name, tmp_path / "out", folder))
    assert code == 0, output
    got = read_results(tmp_path / "out")
    assert got and all(r["error"] is None for r in got), [r["error"] for r in got]
    for r in got:
        images = _expected_images(tmp_path, r["rid"])
        assert _tokens(r) == _hf_tokens(processor, hf, images, r["prompt"]), r["rid"]
        assert len(_tokens(r)) == MAX_NEW
    if name == "binary.parquet":
        by = {r["rid"]: r for r in got}
        assert _tokens(by["b0"]) != _tokens(by["b1"])  # the same text under another image: another answer
        from batchjob.job.status import job_status

        lines = job_status(tmp_path / "out").lines("out")
        assert any("3 images, " in line for line in lines), lines  # three rows held one image each
        from batchjob.job.report import build

        assert "images/s (workers' last runs, summed): " in build([tmp_path / "out"]).read_text()


@pytest.mark.engine
@pytest.mark.parametrize("family", ["idefics3", "llava_next", "gemma3"])
def test_other_families_through_the_job(tmp_path, family):
    """Image rows of the families whose image token counts vary (crops, tiles) or whose image tokens attend
    both ways (Gemma 3) go through the job as LLaVA's do: each row's tokens equal HF generate's on that
    family's processor inputs."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests import vision_models

    folder = getattr(vision_models, f"make_{family}")(tmp_path / family)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    processor = AutoProcessor.from_pretrained(folder)
    _write_inputs(tmp_path)
    code, output = run_here(_args(tmp_path / "binary.parquet", tmp_path / "out", folder))
    assert code == 0, output
    got = read_results(tmp_path / "out")
    assert len(got) == 4 and all(r["error"] is None for r in got), [r["error"] for r in got]
    for r in got:
        images = _expected_images(tmp_path, r["rid"])
        assert _tokens(r) == _hf_tokens(processor, hf, images, r["prompt"]), r["rid"]


def test_bad_images_are_error_rows(llava, tmp_path):
    folder, _, _ = llava
    (tmp_path / "imgs").mkdir()
    make_image(1).save(tmp_path / "imgs" / "ok.png")
    make_image(2, (64, 64)).save(tmp_path / "imgs" / "big.png")
    (tmp_path / "imgs" / "corrupt.png").write_bytes(png_bytes(3)[:40])
    cells = {
        "ok": "imgs/ok.png",
        "missing": "imgs/nope.png",
        "corrupt": ["imgs/ok.png", "imgs/corrupt.png"],
        "remote": "https://example.com/cat.png",
        "number": 5,
        "big": "imgs/big.png",
        "data": "data:image/png;base64,###",
    }
    with open(tmp_path / "in.jsonl", "w") as f:
        for rid, image in cells.items():
            f.write(json.dumps({"rid": rid, "prompt": "What is it?", "image": image}) + "\n")
    args = _args(tmp_path / "in.jsonl", tmp_path / "out", folder, "--max-image-pixels", 1000)
    code, output = run_here(args)
    assert code == 0, output
    errors = {r["rid"]: r["error"] for r in read_results(tmp_path / "out")}
    assert errors["ok"] is None
    assert (
        errors["missing"].startswith("in.jsonl line 2: ")
        and "image 0 (imgs/nope.png): cannot be read" in errors["missing"]
    )
    assert "line 3" in errors["corrupt"] and "image 1 (imgs/corrupt.png)" in errors["corrupt"]
    assert "pass --allow-remote-images to fetch it" in errors["remote"]
    assert "line 5" in errors["number"] and "image 0 is int" in errors["number"]
    assert "64 x 64 = 4096 pixels is over --max-image-pixels 1000" in errors["big"]
    assert errors["data"].endswith(
        "image column 'image': image 0: the data: URL is not valid base64 (Only base64 data is allowed)"
    )


def test_text_model_refused(tiny_model_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"rid": "a", "prompt": "hi", "image": None}) + "\n")
    code, output = run_here(_args(tmp_path / "in.jsonl", tmp_path / "out", tiny_model_dir))
    assert code == 2, output
    assert "--image-column 'image'" in output and "is not a vision-language model" in output
    assert not (tmp_path / "out" / "_batchjob" / "manifest.jsonl").exists()


def test_image_families_without_a_vision_tower_config_are_refused_by_family():
    """Fuyu and Chameleon name no vision_config, so --image-column told them "is not a vision-language model;
    it takes no images": they are image-text families batchjob does not run, and are refused as such (a text
    model is still told it takes no images)."""
    from transformers import ChameleonConfig, FuyuConfig, LlamaConfig

    from batchjob.errors import ConfigError
    from batchjob.job.rows.images import check_image_model
    from batchjob.job.spec import make_spec

    spec = make_spec(input="x.jsonl", output="o", model="m", image_column="image", prompt_column="prompt")
    for config in (FuyuConfig(), ChameleonConfig()):
        family = f"vision-language model family {config.model_type!r} is not supported yet; supported: llava,"
        with pytest.raises(ConfigError, match=family):
            check_image_model(spec, config)
    with pytest.raises(ConfigError, match="'m' .llama. is not a vision-language model; it takes no images"):
        check_image_model(spec, LlamaConfig())


def test_changed_image_file_refuses_resume(llava, tmp_path):
    folder, _, _ = llava
    _write_inputs(tmp_path)
    args = _args(tmp_path / "paths.jsonl", tmp_path / "out", folder)
    code, output = run_here(args)
    assert code == 0, output
    code, output = run_here(args)
    assert code == 0 and "already complete" in output
    make_image(9).save(tmp_path / "imgs" / "b.png")
    code, output = run_here(args)
    assert code == 2, output
    assert "image files changed" in output and "paths.jsonl: imgs/b.png: its bytes changed" in output


def test_validate_names_images_it_cannot_open(llava, tmp_path):
    from click.testing import CliRunner

    from batchjob.cli import main

    folder, _, _ = llava
    (tmp_path / "ok.png").write_bytes(png_bytes(1))
    rows = [("a", "ok.png"), ("b", "gone.png"), ("c", None)]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"rid": r, "prompt": "x", "image": i}) + "\n" for r, i in rows)
    )
    args = ["validate", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--model", folder]
    result = CliRunner().invoke(main, [str(a) for a in [*args, "--image-column", "image"]])
    assert result.exit_code == 0, result.output
    assert "images: 1 of 2 can't be opened" in result.output
    assert "in.jsonl line 2: image column 'image': image 0 (gone.png): cannot be read" in result.output


def test_estimate_counts_image_tokens(llava, tmp_path):
    """validate --estimate reads image rows as a run does: their prompt lengths hold the image tokens (one
    image here: 38 tokens, its text alone 21), and the calibration runs them with their images."""
    from click.testing import CliRunner

    from batchjob.cli import main

    folder, _, _ = llava
    _write_inputs(tmp_path)  # binary.parquet: three rows of one image, one of text alone
    args = ["validate", "--input", tmp_path / "binary.parquet", "--output", tmp_path / "out", "--model", folder]
    args += ["--image-column", "image", "--estimate", "--max-new-tokens", 4]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    lengths = {line.split()[0]: int(line.split()[-1]) for line in result.output.splitlines() if "#" in line}
    assert lengths == {"16-31": 1, "32-63": 3}, result.output
    assert "4.0 tokens out a sample" in result.output, result.output  # the image rows ran, not errors


def test_sigkill_then_resume_equals_uninterrupted(launch, llava, tmp_path):
    """Killed (kill -9) at its first committed part, its in-flight rows checkpointed at every step before:
    the resume writes what an uninterrupted run writes."""
    folder, _, _ = llava
    rows = [
        {"rid": f"r{i:02d}", "prompt": f"Item {i} is", "image": png_bytes(i % 4) if i % 3 else None}
        for i in range(12)
    ]
    table = pa.table(
        {k: pa.array([r[k] for r in rows], pa.binary() if k == "image" else None) for k in rows[0]}
    )
    pq.write_table(table, tmp_path / "in.parquet")
    extra = ["--max-num-seqs", 2, "--temperature", 0.9, "--seed", 5]
    code, output = run_here(_args(tmp_path / "in.parquet", tmp_path / "ref", folder, *extra))
    assert code == 0, output
    expected = read_results(tmp_path / "ref")
    out = tmp_path / "out"
    args = _args(tmp_path / "in.parquet", out, folder, *extra, "--checkpoint-interval", 1e-6)
    proc = launch(args, BATCHJOB_FAULT_PAUSE="part_committed", OMP_NUM_THREADS="1")
    wait_for_points(proc)
    assert (out / "_batchjob" / "inflight.json").exists()  # rows in the engine were checkpointed
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    code, output = run_here(args)
    assert code == 0, output
    got = read_results(out)
    assert [r["rid"] for r in got] == [r["rid"] for r in expected]
    assert got == expected


def test_example_job_runs_with_a_vlm(llava, tmp_path):
    """jobs/images.toml over examples/images.jsonl, the model given by --model: every row answered."""
    from pathlib import Path

    folder, _, _ = llava
    job = Path(__file__).parents[2] / "jobs" / "images.toml"
    code, output = run_here([job, "--model", folder, "--output", tmp_path / "out", "--max-new-tokens", 4])
    assert code == 0, output
    import pyarrow.dataset as ds

    rows = {r["id"]: r for r in ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()}
    assert len(rows) == 6 and all(
        r["error"] is None and r["num_generated_tokens"] == 4 for r in rows.values()
    )
    assert rows["q5"]["num_prompt_tokens"] > rows["q1"]["num_prompt_tokens"] > rows["q6"]["num_prompt_tokens"]
    from click.testing import CliRunner

    from batchjob.cli import main

    args = ["validate", str(job), "--model", str(folder), "--output", str(tmp_path / "new")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "images: all 6 open" in result.output, result.output


def test_example_job_without_a_vlm_is_refused(tiny_model_dir, tmp_path):
    from pathlib import Path

    job = Path(__file__).parents[2] / "jobs" / "images.toml"
    code, output = run_here([job, "--model", tiny_model_dir, "--output", tmp_path / "out"])
    assert code == 2 and "is not a vision-language model" in output, output


def test_image_file_changed_while_running_stops_the_job(llava, tmp_path, monkeypatch):
    """The job recorded imgs/a.png, which is cut short (a fault point) before its row is read: the job stops
    naming the file, and does not write that row from other bytes."""
    folder, _, _ = llava
    _write_inputs(tmp_path)
    target = tmp_path / "imgs" / "a.png"
    from batchjob import faults

    monkeypatch.setattr(faults, "_truncated", set())  # the point cuts once per process: this test's cut
    monkeypatch.setenv("BATCHJOB_FAULT_TRUNCATE", f"loop_started:100:{target}")
    code, output = run_here(_args(tmp_path / "paths.jsonl", tmp_path / "out", folder))
    assert code == 2, output
    assert "image file paths.jsonl: imgs/a.png changed while the job ran" in output
    assert target.stat().st_size == 100


def test_image_file_that_appears_after_the_job_started_is_an_error_in_every_row(llava, tmp_path, monkeypatch):
    """A file missing when the job records its images (a downloader still writing) and there when its rows
    are read: every row naming it is an error in this run, so that no row reads a version the job never
    recorded (a later resume would not have been told it changed)."""
    import importlib

    prepare = importlib.import_module("batchjob.job.prepare")  # (batchjob.job.prepare is also a function)
    folder, _, _ = llava
    (tmp_path / "imgs").mkdir()
    record = prepare.record_images

    def record_then_appear(*args, **kwargs):
        recorded = record(*args, **kwargs)
        make_image(4).save(tmp_path / "imgs" / "late.png")
        return recorded

    monkeypatch.setattr(prepare, "record_images", record_then_appear)
    with open(tmp_path / "in.jsonl", "w") as f:
        for rid in ("r1", "r2"):
            f.write(json.dumps({"rid": rid, "prompt": "What is it?", "image": "imgs/late.png"}) + "\n")
    code, output = run_here(_args(tmp_path / "in.jsonl", tmp_path / "out", folder))
    assert code == 0, output
    errors = [r["error"] for r in read_results(tmp_path / "out")]
    late = "could not be read when the job started and can be now"
    assert len(errors) == 2 and all(late in e for e in errors)


def test_exif_orientation_is_applied_as_transformers_load_image_does(tmp_path):
    """A phone photo is stored unrotated with an EXIF orientation; transformers' load_image (and datasets'
    Image) turn it, so the model sees it upright: so does batchjob."""
    from PIL import Image
    from transformers.image_utils import load_image

    from batchjob.job.images import ImageRef, decode

    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    path = tmp_path / "photo.png"
    make_image(3, (48, 24)).save(path, exif=exif.tobytes())
    ours, error = decode(path.read_bytes(), ImageRef(0, None, "photo.png"), 10**6)
    want = load_image(str(path)).convert("RGB")
    assert error is None and ours is not None
    assert ours.size == want.size == (24, 48) and ours.tobytes() == want.tobytes()


def test_data_urls_are_read_as_transformers_load_image_reads_them(tmp_path):
    """A data: URL of line-wrapped base64 (``base64.encodebytes``' lines of 76) and one marked ';BASE64' were
    refused, in a cell and in an image part; transformers' load_image reads both: the same image now. A
    character outside base64 that is not a line break is still refused."""
    from transformers.image_utils import load_image

    from batchjob.job.images import load
    from batchjob.job.rows.image_parts import image_parts

    raw = png_bytes(5, (40, 40))
    wrapped = "data:image/png;base64," + base64.encodebytes(raw).decode()
    upper = "data:image/png;BASE64," + base64.b64encode(raw).decode()
    assert wrapped.count("\n") > 2
    for url in (wrapped, upper):
        images, error = load([url], "image", tmp_path, 10**6)
        assert error is None and images is not None, error
        assert images[0].tobytes() == load_image(url).tobytes()
        content = [{"type": "image_url", "image_url": {"url": url}}]
        _, refs, error = image_parts([{"role": "user", "content": content}], "")
        assert error is None and refs[0].data == raw, error
    _, error = load(["data:image/png;base64,iVBO#Rw0K"], "image", tmp_path, 10**6)
    assert error is not None and "image 0: the data: URL is not valid base64" in error, error


def test_an_empty_path_says_so(tmp_path):
    """An empty string as an image (or a struct's empty path) said 'cannot be read (Is a directory)': the
    input file's folder was read. It is an empty path."""
    from batchjob.job.images import load

    for cell in ("", [""], {"bytes": None, "path": ""}, "file://"):
        images, error = load(cell, "image", tmp_path, 10**6)
        assert images is None and error is not None
        assert error.startswith("image column 'image': image 0") and ": an empty path: give" in error, error


def _hf_parts(processor, hf, content) -> list[int]:
    """HF generate on the processor's inputs for one user message of content parts (images as Pillow), or
    for a conversation (a list of messages)."""
    messages = content if content and "role" in content[0] else [{"role": "user", "content": content}]
    inputs = processor.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    if "pixel_values" in inputs:
        kwargs["pixel_values"] = inputs["pixel_values"].double()
    with torch.inference_mode():
        out = hf.generate(**kwargs, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_openai_image_parts(llava, tmp_path):
    """--format openai on a VLM: image_url parts (data: URLs, file:// URLs, paths) in place among the text
    parts, exact against HF generate; a remote URL or bad base64 is that request's error."""
    import base64

    folder, processor, hf = llava
    make_image(6).save(tmp_path / "six.png")
    data = "data:image/png;base64," + base64.b64encode(png_bytes(2)).decode()

    def image(url):
        return {"type": "image_url", "image_url": {"url": url}}

    def text(t):
        return {"type": "text", "text": t}

    contents = {
        "c0": [text("What is it?"), image(data)],
        "c1": [image(f"file://{tmp_path / 'six.png'}"), text("And this?"), image("six.png")],
        "c2": "Plain text only",
        "c3": [image("https://example.com/x.png"), text("remote")],
        "c4": [image("data:image/png;base64,###"), text("bad")],
    }
    with open(tmp_path / "requests.jsonl", "w") as f:
        for cid, content in contents.items():
            body = {
                "messages": [{"role": "user", "content": content}],
                "max_tokens": MAX_NEW,
                "temperature": 0,
            }
            f.write(
                json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
            )
            f.write("\n")
    args = ["--input", tmp_path / "requests.jsonl", "--output", tmp_path / "out", "--model", folder]
    code, output = run_here([*args, "--format", "openai", "--dtype", "float64", "--logprobs", "0"])
    assert code == 0, output
    import pyarrow.dataset as ds

    got = {r["custom_id"]: r for r in ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()}
    pictures = {
        data: make_image(2),
        "six.png": make_image(6),
        f"file://{tmp_path / 'six.png'}": make_image(6),
    }
    for cid in ("c0", "c1", "c2"):
        content = contents[cid]
        if isinstance(content, str):
            content = [text(content)]
        parts = [
            {"type": "image", "image": pictures[p["image_url"]["url"]]} if "image_url" in p else p
            for p in content
        ]
        assert got[cid]["error"] is None, got[cid]["error"]
        assert _tokens(got[cid]) == _hf_parts(processor, hf, parts), cid
    assert (
        "requests.jsonl line 4: image 0 (https://example.com/x.png): a remote image: pass --allow-remote-images"
        in got["c3"]["error"]
    )
    assert "line 5: body.messages[0].content[0]: the data: URL is not valid base64" in got["c4"]["error"]
    # the files the parts name are the job's inputs: changed, the resume is refused naming both references
    make_image(1).save(tmp_path / "six.png")
    code, output = run_here([*args, "--format", "openai", "--dtype", "float64", "--logprobs", "0"])
    assert code == 2 and "image files changed" in output, output
    assert "requests.jsonl: six.png: its bytes changed" in output and f"{tmp_path / 'six.png'}: its" in output


def test_messages_column_with_image_parts(llava, tmp_path):
    """--messages-column on a VLM: OpenAI image parts in the messages, exact against HF generate."""
    folder, processor, hf = llava
    make_image(3).save(tmp_path / "three.png")
    image = {"type": "image_url", "image_url": {"url": "three.png"}}
    conversations = {
        "m0": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image]}],
        "m1": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]},
        ],
        "m2": [{"role": "user", "content": "Only text"}],
        "m3": [{"role": "user", "content": 7}],
    }
    with open(tmp_path / "chats.jsonl", "w") as f:
        for rid, messages in conversations.items():
            f.write(json.dumps({"rid": rid, "messages": messages}) + "\n")
    args = ["--input", tmp_path / "chats.jsonl", "--output", tmp_path / "out", "--model", folder]
    args += ["--id-column", "rid", "--max-new-tokens", MAX_NEW, "--dtype", "float64", "--logprobs", "0"]
    code, output = run_here([*args, "--messages-column", "messages"])
    assert code == 0, output
    got = {r["rid"]: r for r in read_results(tmp_path / "out")}
    for rid in ("m0", "m1", "m2"):
        messages = [
            {
                "role": m["role"],
                "content": [{"type": "text", "text": m["content"]}]
                if isinstance(m["content"], str)
                else [
                    {"type": "image", "image": make_image(3)} if "image_url" in p else p for p in m["content"]
                ],
            }
            for m in conversations[rid]
        ]
        assert got[rid]["error"] is None, got[rid]["error"]
        assert _tokens(got[rid]) == _hf_parts(processor, hf, messages), rid
    assert "chats.jsonl line 4: column 'messages': messages[0].content must be text" in got["m3"]["error"]


def test_messages_column_takes_the_image_options(llava, tmp_path):
    """--messages-column on a VLM takes --max-image-pixels, --allow-remote-images and --image-workers: they
    were refused as unused ("a row's images: --image-column"), while a remote image's row said to pass
    --allow-remote-images. The bound makes the larger image's row an error and is the job's identity (a
    resume under another is refused); a 'messages' column the input chooses takes them too, and a 'text'
    column refuses them before any work."""
    folder, _, _ = llava
    make_image(3, (24, 20)).save(tmp_path / "small.png")
    make_image(4, (40, 40)).save(tmp_path / "large.png")
    with open(tmp_path / "chats.jsonl", "w") as f:
        for rid, name in (("small", "small.png"), ("large", "large.png")):
            content = [{"type": "image_url", "image_url": {"url": name}}, {"type": "text", "text": "What?"}]
            f.write(json.dumps({"rid": rid, "messages": [{"role": "user", "content": content}]}) + "\n")
    (tmp_path / "texts.jsonl").write_text(json.dumps({"rid": "t", "text": "hello"}) + "\n")

    def args(name, out, *extra):
        where = ["--input", tmp_path / name, "--output", tmp_path / out, "--model", folder]
        return [*where, "--id-column", "rid", "--max-new-tokens", 2, "--dtype", "float64", *extra]

    images = ["--max-image-pixels", 1000, "--allow-remote-images", "--image-workers", 0]
    code, output = run_here(args("chats.jsonl", "out", "--messages-column", "messages", *images))
    assert code == 0, output
    got = {r["rid"]: r for r in read_results(tmp_path / "out")}
    assert got["small"]["error"] is None, got["small"]["error"]
    assert "(large.png): 40 x 40 = 1600 pixels is over --max-image-pixels 1000" in got["large"]["error"]
    code, output = run_here(
        args("chats.jsonl", "out", "--messages-column", "messages", "--max-image-pixels", 2000)
    )
    assert code == 2 and "prompt.max_image_pixels" in output, output
    code, output = run_here(args("chats.jsonl", "chosen", *images))  # the input's 'messages' column
    assert code == 0, output
    assert [r["error"] for r in read_results(tmp_path / "chosen")] == [r["error"] for r in got.values()]
    code, output = run_here(args("texts.jsonl", "texts", *images))
    unused = "--max-image-pixels, --allow-remote-images, --image-workers (a row's images: --image-column, or"
    assert code == 2 and f"no use for {unused} image parts in --messages-column" in output, output
    assert not (tmp_path / "texts").exists()


def test_two_workers_share_the_image_records(llava, tmp_path):
    """A job split over two workers (--num-shards): each records the image files, together they write
    what one worker writes."""
    folder, _, _ = llava
    _write_inputs(tmp_path)
    code, output = run_here(_args(tmp_path / "paths.jsonl", tmp_path / "one", folder))
    assert code == 0, output
    for k in (0, 1):
        code, output = run_here(
            [
                *_args(tmp_path / "paths.jsonl", tmp_path / "two", folder),
                "--num-shards",
                2,
                "--shard-index",
                k,
            ]
        )
        assert code == 0, output
    assert read_results(tmp_path / "two") == read_results(tmp_path / "one")
    assert (tmp_path / "two" / "_batchjob" / "images.json").exists()


def _chat_and_completion(path) -> None:
    """An OpenAI Batch file of one chat request and one completions request of one text."""
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions"}
        | {"body": {"messages": [{"role": "user", "content": "Paris is"}], "max_tokens": 2}},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions"}
        | {"body": {"prompt": "Paris is", "max_tokens": 2}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_completions_request_on_a_vlm_in_a_job_with_kwargs_is_its_rows_error(llava, tmp_path):
    """As on a text model: a completions request's prompt does not go through the chat template, so the
    --chat-template-kwargs were dropped from it without a word."""
    import shutil

    import pyarrow.dataset as ds

    folder = tmp_path / "llava"
    shutil.copytree(llava[0], folder)
    for name in ("chat_template.jinja", "chat_template.json"):  # the processor's template reads the kwarg
        path = folder / name
        if path.exists() and name.endswith(".jinja"):
            path.write_text("{% if enable_thinking is defined %}{% endif %}" + path.read_text())
        elif path.exists():
            saved = json.loads(path.read_text())
            saved["chat_template"] = "{% if enable_thinking is defined %}{% endif %}" + saved["chat_template"]
            path.write_text(json.dumps(saved))
    _chat_and_completion(tmp_path / "requests.jsonl")
    args = ["--input", tmp_path / "requests.jsonl", "--output", tmp_path / "out", "--model", folder]
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}']
    code, output = run_here([*args, "--format", "openai", *kwargs])
    assert code == 0, output
    got = {r["custom_id"]: r for r in ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()}
    assert got["chat"]["error"] is None, got["chat"]["error"]
    assert "a completions request (a 'prompt') does not go through" in got["completion"]["error"]


def test_a_completions_request_on_a_vlm_with_system_is_its_rows_error(llava, tmp_path):
    """As on a text model: a completions request has no place for --system, which was dropped from its prompt
    without a word (the chat request beside it takes it)."""
    import pyarrow.dataset as ds

    _chat_and_completion(tmp_path / "requests.jsonl")
    args = ["--input", tmp_path / "requests.jsonl", "--output", tmp_path / "out", "--model", llava[0]]
    code, output = run_here([*args, "--format", "openai", "--system", "Be terse."])
    assert code == 0, output
    got = {r["custom_id"]: r for r in ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()}
    assert got["chat"]["error"] is None, got["chat"]["error"]
    assert got["completion"]["error"].endswith(COMPLETIONS_NO_SYSTEM), got["completion"]["error"]
