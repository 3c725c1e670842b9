"""Image rows built ahead of the engine on worker threads (--image-workers, ``batchjob/job/ahead.py``): the
results equal building each row on the job's own thread, error rows (a corrupt image, a duplicate id) in
their places; the builds do run on the workers; Pillow's own pixel limit is left as found by decodes on
several threads, and ours is the check."""

from __future__ import annotations

import json
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import pyarrow.dataset as ds
import pytest

from tests.jobproc import run_here
from tests.tiers import engine_fixture
from tests.vision_models import make_llava, png_bytes

pytestmark = pytest.mark.timeout(600)


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


def _inputs(root) -> None:
    """16 rows: images of several sizes, text-only rows, a corrupt image and a duplicate id in the middle."""
    (root / "imgs").mkdir()
    with open(root / "in.jsonl", "w") as f:
        for i in range(16):
            rid = "r05" if i == 9 else f"r{i:02d}"  # row 9 reuses row 5's id
            image = None if i % 5 == 4 else f"imgs/{i}.png"
            if image is not None:
                data = png_bytes(i, (20 + 3 * i, 18 + i))
                (root / image).write_bytes(data[:50] if i == 7 else data)  # row 7's image is cut short
            f.write(json.dumps({"rid": rid, "prompt": f"Item {i} is", "image": image}) + "\n")


def _run(folder, root, out, workers, monkeypatch) -> tuple[list[dict], set[str]]:
    """The job's result rows in the order its parts hold them, and the threads that built its image rows."""
    from batchjob.job.rows import RowMaker

    threads: set[str] = set()
    real = RowMaker.image_prompt

    def image_prompt(self, row, images):
        threads.add(threading.current_thread().name)
        return real(self, row, images)

    monkeypatch.setattr(RowMaker, "image_prompt", image_prompt)
    args = ["--input", root / "in.jsonl", "--output", root / out, "--model", folder, "--image-column", "image"]
    args += ["--id-column", "rid", "--max-new-tokens", 6, "--device", "cpu", "--dtype", "float64"]
    args += ["--max-num-seqs", 2, "--temperature", 0.9, "--seed", 5, "--logprobs", "0"]
    code, output = run_here([*args, "--image-workers", workers])
    monkeypatch.undo()
    assert code == 0, output
    return ds.dataset(root / out, format="parquet").to_table().to_pylist(), threads


def test_workers_write_what_the_main_thread_writes(llava, tmp_path, monkeypatch):
    _inputs(tmp_path)
    main, on_main = _run(llava, tmp_path, "w0", 0, monkeypatch)
    assert on_main == {"MainThread"}
    errors = {i: r["error"] for i, r in enumerate(main) if r["error"] is not None}
    assert set(errors) == {7, 9}, errors
    assert "in.jsonl line 8: image column 'image': image 0 (imgs/7.png)" in errors[7]
    assert "duplicate id 'r05'" in errors[9]
    assert all(r["num_generated_tokens"] == 6 for i, r in enumerate(main) if i not in errors)
    for workers in (1, 3):
        got, built_on = _run(llava, tmp_path, f"w{workers}", workers, monkeypatch)
        assert built_on and all(name.startswith("batchjob-images") for name in built_on), built_on
        assert len(built_on) <= workers
        assert got == main, workers


def _png_header(width: int, height: int) -> bytes:
    """A PNG that states its size and holds almost no pixels (what a decompression bomb's header says)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_decodes_on_threads_keep_pillow_limit_and_check_ours():
    """Pillow's limit is off while any decode runs (ours is the check, on the header) and back after: an
    image over twice Pillow's limit is refused by ours, by its size, from whichever thread."""
    from PIL import Image

    from batchjob.job.images import ImageRef, decode

    limit = Image.MAX_IMAGE_PIXELS
    assert limit is not None
    good = png_bytes(1, (64, 48))
    huge = _png_header(20_000, 20_000)  # 400M pixels: over 2x Pillow's 89M, where Pillow itself raises

    def one(k: int) -> str | None:
        data = huge if k % 7 == 0 else good
        image, error = decode(data, ImageRef(0, data, None), 200_000_000 if k % 2 else limit)
        assert (image is None) == (k % 7 == 0)
        return error

    with ThreadPoolExecutor(4) as pool:
        errors = [e for e in pool.map(one, range(200)) if e is not None]
    assert Image.MAX_IMAGE_PIXELS == limit  # noqa: SIM300 - the setting, as it was
    assert len(errors) == len(range(0, 200, 7))
    assert all("20000 x 20000 = 400000000 pixels is over --max-image-pixels" in e for e in errors), errors[:2]
