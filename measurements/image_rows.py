"""What an image row costs the job layer before the engine sees it: each image decoded by Pillow, then
LLaVA-1.5's preprocessing (CLIP at 336 px: resize, crop, normalise; 576 image tokens) and the chat template,
through the job's own row builder (``batchjob/job/rows/images.py``), one row at a time as the job's
read-ahead does, on one thread. Prints images/s for decoding alone and for the whole row.

    python measurements/image_rows.py [--images 64] [--size 640x480] [--format jpeg]

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


if __name__ == "__main__":
    main()
