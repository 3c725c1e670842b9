"""Paged attention plugged into unmodified Hugging Face models through ``AttentionInterface``.

The model runs one packed sequence of ``T`` tokens (batch dimension 1) holding chunks of several requests.
Each attention layer calls :func:`paged_attention` with the new tokens' query, key and value. We write the new
K/V into the paged cache, then the step's backend lets each request's queries attend to that request's
cached keys, with a bottom-right causal alignment (the first query of a chunk sees every earlier cached key
of its request). A backend that never reads the step's keys back (``reads_cache`` false: an encoder's
whole rows on the torch reference) is spared the writes.

Everything that describes the batch travels in one private keyword argument, ``batchjob_meta``, built once
per step by the model runner and shared by all layers. The registered name has no mask function, so the
model skips building its own mask.

The package, one module per idea:

- ``layout.py``: the step's backend-neutral layout (:class:`StepLayout`) and its one host-to-device copy.
- ``base.py``: the :class:`AttentionBackend` interface (what a backend computes, its block-size rule, its
  devices and dtypes, its metadata and forward) and the :class:`AttentionMetadata` every layer receives.
- ``registry.py``: every backend, and :func:`choose_attention`, the one place that picks one.
- the backends: ``reference.py`` (``torch``, SDPA over gathered keys, every device), ``flex.py`` (FlexAttention
  over the paged cache; its machinery in ``flex_kernel.py``), ``flash.py`` (flash-attn's paged kernel),
  ``varlen.py`` (torch's own FlashAttention-2); the CPU decode kernel's, ``cpu_kernel``, lives with the
  kernel in :mod:`batchjob.engine.cpu.attention`.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

from batchjob.engine.attention.base import AttentionBackend, AttentionMetadata
from batchjob.engine.attention.layout import Packer, StepLayout
from batchjob.errors import ConfigError

__all__ = ["ATTN_NAME", "META_KWARG", "AttentionBackend", "AttentionMetadata", "Packer", "StepLayout"]

ATTN_NAME = "batchjob_paged"
ATTN_NAME_UNCOMPILED = "batchjob_paged_uncompiled"  # the same, kept out of torch.compile's graphs
META_KWARG = "batchjob_meta"


# The metadata of the forwards in progress, innermost last: some models' layers call their attention without
# the keyword arguments they were given (StableLM, whose transformers class says so; Nemotron, whose does not),
# so the step's metadata is also found here.
_in_progress: list[AttentionMetadata] = []


@contextlib.contextmanager
def in_progress(meta: AttentionMetadata):
    """For the length of a forward: ``meta`` for a layer its caller did not pass it to."""
    _in_progress.append(meta)
    try:
        yield
    finally:
        _in_progress.pop()


# Families whose attention modules carry no ``layer_idx`` (the index of the layer's KV cache, read below; every
# other family's modules number themselves): where their layers are under the base model, and each layer's
# attention module, numbered here in layer order.
_UNNUMBERED = {"distilbert": ("transformer", "attention")}


def number_layers(model: torch.nn.Module) -> None:
    """Give the attention modules of a family that does not number them (``_UNNUMBERED``) their layer's
    index, as every other family's carry it."""
    where = _UNNUMBERED.get(getattr(model.config, "model_type", ""))
    if where is None:
        return
    stack, name = where
    base = getattr(model, "base_model", model)
    for i, layer in enumerate(getattr(base, stack).layer):
        getattr(layer, name).layer_idx = i


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata | None = kwargs.get(META_KWARG)
    if meta is None:  # a layer whose caller did not pass it on
        meta = _in_progress[-1]
    softcap, sinks, slopes = kwargs.get("softcap"), kwargs.get("s_aux"), kwargs.get("alibi_slopes")
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    if (
        key.shape[1] != k_cache.shape[2]
        or key.shape[3] != k_cache.shape[3]
        or value.shape[3] != v_cache.shape[3]
    ):
        raise ConfigError(  # the cache is planned from the config; a layer that writes another shape is refused
            f"{type(module).__name__} writes keys of {key.shape[1]} heads x {key.shape[3]} and values of "
            f"{value.shape[3]}, but its config plans a KV cache of {k_cache.shape[2]} x {k_cache.shape[3]}: "
            "this family's attention is not supported"
        )
    backend = meta.backend
    if backend.reads_cache:
        backend.write_kv(key, value, meta.slot_mapping, k_cache, v_cache)
    # Chosen at load so that this never fails: a backend silently ignores what it does not apply.
    for name, given in (("softcap", softcap), ("sinks", sinks), ("alibi", slopes)):
        assert given is None or name in backend.applies(), f"the {backend.name} backend does not apply {name}"
    out = backend.forward(
        meta.data, query[0], key, value, k_cache, v_cache, scaling, sliding_window, softcap, slopes, sinks
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention)
AttentionInterface.register(ATTN_NAME_UNCOMPILED, torch.compiler.disable(paged_attention))
