"""The vision tower's memory for one encode, measured against the estimate the KV plan reserves
(``batchjob/engine/vision/memory.py``): a LLaVA with random weights at a real tower's shape (CLIP ViT-B/16 at
224 px, ViT-L/14 at 336; a tiny language model, which an encode does not run), one tower call through the
engine's LLaVA family over 1 and N images. On the CPU the peak is the process's resident memory above what
it held before the call (sampled every millisecond on a thread); on CUDA, ``max_memory_allocated`` above
the allocated memory before the call. Large blocks are mapped on their own on the CPU (glibc's mmap
threshold), so freed memory leaves the resident set.

    python measurements/vision_memory.py                      # CPU, float32, both towers, 1 and 8 images
    python measurements/vision_memory.py --device cuda --dtype bfloat16 --images 1,16
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

VISION = {  # hidden, intermediate, layers, heads, patch, image size (as measurements/random_vlm.py)
    "b16-224": (768, 3072, 12, 12, 16, 224),
    "l14-336": (1024, 4096, 24, 16, 14, 336),
}


def _model(shape: str, dtype: torch.dtype, device: str):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    hidden, inter, layers, heads, patch, size = VISION[shape]
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        patch_size=patch,
        image_size=size,
    )
    text = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=255)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).to(device, dtype).eval(), size


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _mmap_large_blocks() -> None:
    """glibc: blocks over 64 KiB mapped on their own, so a freed tensor leaves the resident set at once and
    the next call's peak is not hidden in memory the allocator kept."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _cpu_peak(call) -> int:
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    call()
    done.set()
    thread.join()
    return max(peak[0], _rss()) - base


def _cuda_peak(call, device: str) -> int:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure(shape: str, counts: list[int], dtype: torch.dtype, device: str) -> None:
    from batchjob.engine.vision import memory
    from batchjob.engine.vision.llava import Llava

    if not device.startswith("cuda"):
        _mmap_large_blocks()
    model, size = _model(shape, dtype, device)
    family, tower = Llava(model), memory.Tower.of(model.config)
    width = dtype.itemsize
    for n in counts:
        pixels = torch.randn(n, 3, size, size)
        inputs = [{"pixel_values": pixels}]

        def call(inputs=inputs) -> None:
            with torch.inference_mode():
                out = family.encode(inputs, torch.device(device), dtype)
            del out

        call()  # warm-up: kernels, allocator pools
        peak = _cuda_peak(call, device) if device.startswith("cuda") else _cpu_peak(call)
        patches = memory.patches(pixels, tower)
        estimate = tower.encode_bytes(patches, memory.sequence(pixels, tower), width)
        print(
            f"{shape:8} {device:5} {str(dtype).removeprefix('torch.'):8} {n:3} images {patches:6} patches: "
            f"measured {peak / 2**20:8.1f} MiB, estimate {estimate / 2**20:8.1f} MiB "
            f"({estimate / max(peak, 1):.2f}x)"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--images", default="1,8", help="images per call, comma-separated")
    ap.add_argument("--towers", default="b16-224,l14-336", help="tower shapes, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for shape in args.towers.split(","):
        measure(shape, [int(n) for n in args.images.split(",")], getattr(torch, args.dtype), args.device)
