"""What an image row costs the job layer before the engine sees it: each image decoded by Pillow, then
LLaVA-1.5's preprocessing (CLIP at 336 px: resize, crop, normalise; 576 image tokens) and the chat template,
through the job's own row builder (``batchjob/job/rows/images.py``), one row at a time as the job's
read-ahead does, on one thread. Prints images/s for decoding alone and for the whole row; with ``--workers``,
the rows also go through the job's read-ahead (``batchjob/job/ahead.py``: rows read in order, built on that
many threads, taken back in order, as ``--image-workers`` does; 0: on the main thread), a run per count,
as if the engine took each row at once (the most the read-ahead can give it).

    python measurements/image_rows.py [--images 64] [--size 640x480] [--format jpeg] [--workers 0,1,2]

The pictures are random-textured (a smooth gradient and noise) at the given size, encoded in memory; the
processor is built here (the default model's tokenizer with an ``<image>`` token, CLIP's image processor at
LLaVA-1.5's settings), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import io
import time


def _pictures(n: int, size: tuple[int, int], fmt: str) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    w, h = size
    ramp = np.linspace(0, 200, w)[None, :, None] + np.linspace(0, 55, h)[:, None, None]
    out = []
    for _ in range(n):
        pixels = np.clip(ramp + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(buf, format=fmt.upper(), quality=90)
        out.append(buf.getvalue())
    return out


def _processor():
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    from batchjob.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    template = (
        "{% for m in messages %}USER: {% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n"
        "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %} ASSISTANT:"
    )
    images = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=template,
        num_additional_image_tokens=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", default="640x480", help="WIDTHxHEIGHT of each picture")
    parser.add_argument("--format", default="jpeg", choices=["jpeg", "png"])
    parser.add_argument("--workers", default="", help="comma-separated --image-workers counts, e.g. 0,1,2")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each --workers count (best kept)")
    args = parser.parse_args()
    import torch

    from batchjob.io.readers import Row
    from batchjob.job import images as img
    from batchjob.job.prompts import PromptPlan
    from batchjob.job.rows.images import ImagePrompts
    from batchjob.job.spec import JobSpec

    torch.set_num_threads(1)
    size = tuple(int(x) for x in args.size.split("x"))
    data = _pictures(args.images, size, args.format)  # type: ignore[arg-type]
    spec = JobSpec(input=["in.parquet"], output="out", image_column="image", prompt_column="prompt")
    plan = PromptPlan("column", "prompt", None, (), None, True)
    prompts = ImagePrompts(spec, plan, _processor(), None, [], {})
    rows = [Row(i, "in.parquet", i, {"prompt": "What is in it?", "image": d}) for i, d in enumerate(data)]
    t0 = time.perf_counter()
    for d in data:
        img.decode(d, img.ImageRef(0, d, None), spec.max_image_pixels)
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for row in rows:
        prompt, error = prompts.build(row)
        assert prompt is not None, error
    row_s = time.perf_counter() - t0
    kb = sum(map(len, data)) / len(data) / 1024
    print(f"{args.images} {args.format} pictures of {args.size} ({kb:.0f} KiB each), one thread")
    print(f"decode only:          {args.images / decode_s:8.1f} images/s")
    print(
        f"whole row (decode, CLIP 336 preprocessing, template, tokens; {len(prompt.ids)} prompt tokens): "
        f"{args.images / row_s:8.1f} images/s"
    )
    for workers in [int(w) for w in args.workers.split(",") if w]:
        rate, cores = max(_through_ahead(spec, prompts, rows, workers) for _ in range(args.repeat))
        print(
            f"through the job's read-ahead, --image-workers {workers}: {rate:8.1f} images/s "
            f"(the process's CPU time / wall time: {cores:.2f})"
        )


def _through_ahead(spec, prompts, rows, workers: int) -> tuple[float, float]:
    """images/s of ``rows`` through the job's read-ahead as the loop drives it (each row taken back in input
    order and made into its row's work, ``depth`` rows read beyond it), as if the engine took each row at
    once; and the cores the process kept busy meanwhile (its CPU time over the wall time: above 1 only when
    threads ran at once, the GIL let go)."""
    from batchjob.job.ahead import Ahead
    from batchjob.job.rows import RowMaker

    maker = RowMaker(spec, None, None, spec.sampling_params(0), None, 0, prompts)  # type: ignore[arg-type]
    ahead = Ahead(maker, workers)
    todo = iter(rows)
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        for _ in rows:
            while len(ahead) < ahead.depth + 1 and (row := next(todo, None)) is not None:
                ahead.add(row, row.derived_id, None)
            read = ahead.pop()
            work, error = maker.make(read.row, str(read.row_id), read.built)
            assert work is not None, error
    finally:
        ahead.close()
    wall = time.perf_counter() - t0
    return len(rows) / wall, (time.process_time() - cpu0) / wall


if __name__ == "__main__":
    main()
