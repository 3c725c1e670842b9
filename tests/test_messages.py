"""Messages that say what is true: ``validate`` refuses what ``run`` refuses, with the same words; a file read
twice through a symlink, a bad row, a resumed job's changed setting each say which file, row or value."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchjob.cli import main

pytestmark = pytest.mark.timeout(120)


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def _rows(path, n=2):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"hello {i}"}) + "\n")
    return path


def test_validate_refuses_embed_dimensions_beyond_the_width(tiny_model_dir, tmp_path):
    data = _rows(tmp_path / "in.jsonl")
    common = ("--model", tiny_model_dir, "--input", data, "--output", tmp_path / "out", "--task", "embed")
    code, text = invoke("validate", *common, "--dimensions", "65")  # the tiny llama is 64 wide
    assert code == 2 and "dimensions 65 exceeds the model's width of 64" in text, text
    code, text = invoke("validate", *common, "--dimensions", "64")
    assert code == 0 and "ok:" in text, text


def test_a_file_reached_twice_through_a_symlink_is_read_once(tmp_path):
    from batchjob.io.sources import discover

    (tmp_path / "in" / "a").mkdir(parents=True)
    _rows(tmp_path / "in" / "a" / "f.jsonl")
    (tmp_path / "in" / "link").symlink_to("a")  # a sibling folder, not a loop
    skipped: list = []
    found = discover([str(tmp_path / "in"), str(tmp_path / "in" / "a" / "f.jsonl")], skipped=skipped)
    assert [s.name for s in found] == ["a/f.jsonl"]
    same = [str(s) for s in skipped]
    assert len(same) == 2 and all(f"the same file as {tmp_path}/in/a/f.jsonl" in s for s in same), same


def test_a_file_behind_a_symlinked_subfolder_is_taken_by_the_input_folder(tmp_path):
    """``export --to`` is refused where the next run would read the file (owned.py asks ``takes``): the real
    path behind a symbolic link to a folder outside the input folder counts, as the walk follows it."""
    from batchjob.io.sources import takes

    (tmp_path / "in").mkdir()
    (tmp_path / "other" / "deep").mkdir(parents=True)
    (tmp_path / "in" / "link").symlink_to(tmp_path / "other", target_is_directory=True)
    (tmp_path / "in" / "_hidden").symlink_to(tmp_path / "other", target_is_directory=True)
    target = (tmp_path / "other" / "deep" / "x.jsonl").resolve()
    assert takes(str(tmp_path / "in"), target)
    assert takes(str(tmp_path / "in" / "**" / "*.jsonl"), target)
    assert not takes(str(tmp_path / "in"), target.with_suffix(".txt"))  # not a format it reads
    assert not takes(str(tmp_path / "in" / "*.jsonl"), target)  # the glob does not reach into link/
    (tmp_path / "in" / "link").unlink()
    assert not takes(str(tmp_path / "in"), target)  # only through a hidden name: not read


def test_bad_rows_name_their_file_and_line_and_keep_their_id(tiny_model_dir, tmp_path):
    import pyarrow.dataset as ds

    data = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": ""}).encode(),
        json.dumps({"id": "b", "prompt": "word " * 1200}).encode(),  # beyond the tiny model's 1024 tokens
        b'{"id": "c", "prompt": "ok \xff"}',
        b'{"id": "\xfe", "prompt": "x"}',  # an id with a bad byte: not written as if read
        json.dumps({"id": "d", "prompt": "fine"}).encode(),
    ]
    data.write_bytes(b"\n".join(lines) + b"\n")
    for task in ("embed", "generate"):
        out = tmp_path / task
        more = ("--max-new-tokens", "1") if task == "generate" else ()
        args = ("--model", tiny_model_dir, "--input", data, "--output", out, "--task", task, "--id-column", "id")
        code, text = invoke("run", *args, *more)
        assert code == 0, text
        rows = ds.dataset(out, format="parquet").to_table(columns=["id", "prompt", "error"]).to_pylist()
        errors = [(r["id"], r["prompt"], (r["error"] or "").split(": ")[0]) for r in rows]
        assert errors == [
            ("a", "", "in.jsonl line 1"),
            ("b", "word " * 1200, "in.jsonl line 2"),
            ("c", None, "in.jsonl line 3"),  # the id kept, the damaged values not
            (None, None, "in.jsonl line 4"),
            ("d", "fine", ""),
        ], task
        assert "invalid UTF-8" in rows[2]["error"] and "empty" in rows[0]["error"]
