"""``validate`` on an image job: the row naming the most images, built as a run builds it (the model's
processor), and what it needs: its image tokens, the patches the vision tower sees, the memory of encoding
them at once and of their features held until the row finishes; and the bound on one tower call with the
memory the engine keeps free for it beside the KV cache (``engine/vision/memory.py``). No weights are read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from batchjob.job import images as img

if TYPE_CHECKING:
    from batchjob.io.readers import Row
    from batchjob.job.prepare import Prepared


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _most_images(prep: Prepared) -> tuple[Row | None, int]:
    """The first row naming the most images, and how many."""
    from batchjob.io.readers import iter_rows

    column = prep.spec.image_column
    assert column is not None
    best, most = None, 0
    for row in iter_rows(prep.sources):
        found = img.refs(row.values.get(column), column)[0] if row.values is not None else None
        if found and len(found) > most:
            best, most = row, len(found)
    return best, most


def _sizes(prep: Prepared, row: Row) -> str:
    """The row's images' sizes, ``W x H`` each (empty when they can't be read: the row's error says why)."""
    spec, column = prep.spec, prep.spec.image_column
    assert row.values is not None and column is not None
    source = {s.name: s for s in prep.sources}[row.source]
    fetch = None if prep.remote is None else prep.remote.get
    pictures, _ = img.load(
        row.values.get(column), column, img.source_folder(source), spec.max_image_pixels, fetch=fetch
    )
    return ", ".join(f"{p.width} x {p.height}" for p in pictures or [])


def memory_lines(prep: Prepared, model_config: Any) -> list[str]:
    """What a row of this job's images needs, in words (a line or two)."""
    from batchjob.engine.config import EngineConfig
    from batchjob.engine.vision import memory
    from batchjob.job.rows.images import ImagePrompts, load_processor
    from batchjob.models import resolve_model

    spec = prep.spec
    row, count = _most_images(prep)
    if row is None:
        return ["images: no row names an image"]
    processor = load_processor(resolve_model(spec.model), spec.trust_remote_code)
    has_template = bool(getattr(processor, "chat_template", None))
    plan = prep.plan.for_tokenizer(spec, has_template)
    chat = has_template if spec.chat is None else spec.chat
    prompts = ImagePrompts(spec, replace(plan, chat=chat), processor, None, prep.sources, None)
    prompts.remote = prep.remote
    prompt, error = prompts.build(row)
    if prompt is None or prompt.images is None:
        return [f"images: the row with the most images can't be built ({error})"]
    config = EngineConfig(**spec.engine.as_keywords())
    width, budget = config.dtype.itemsize, int(config.max_num_batched_tokens or 1)
    tower = memory.Tower.of(model_config)
    pixels = prompt.images["pixel_values"]
    patches = memory.patches(pixels, tower)
    encode = tower.encode_bytes(patches, memory.sequence(pixels, tower), width)
    tokens = prompt.ids.count(int(model_config.image_token_id))
    features = tokens * int(model_config.get_text_config().hidden_size) * width
    bound = memory.max_patches(budget)
    dtype = str(config.dtype).removeprefix("torch.")
    lines = [
        f"images: the row with the most, {row.place}, has {count} ({_sizes(prep, row)}): {tokens} image tokens "
        f"of its {len(prompt.ids)}, {patches} patches to the vision tower; encoding them takes about "
        f"{_mib(encode)} at once ({dtype}), their features {_mib(features)} until the row finishes",
        f"vision tower: at most {bound} patches a call (--max-num-batched-tokens, at least "
        f"{memory.TOWER_CALL_PATCHES}); "
        f"{_mib(memory.reserve_bytes(model_config, budget, width))} kept free for one call beside the KV "
        "cache where the pool is sized by profiling (CUDA)",
    ]
    if patches > bound:
        lines.append(
            f"  (that row's {patches} patches are over the bound: its images are encoded in one call alone)"
        )
    return lines
