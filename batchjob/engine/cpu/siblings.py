"""Sibling projections that read one input, computed by one GEMM: an attention layer's q, k and v.

transformers' attention modules call ``q_proj``, ``k_proj`` and ``v_proj`` one after another on the same hidden
state. On the CPU a decode step multiplies a few rows by each weight, and for the small ones the call costs
more than their bytes (k and v have 128 outputs each at the Qwen2.5-0.5B shape, beside q's 896). Packed as one
weight, their rows one under the other (:mod:`.linear` packs it), the three are one oneDNN call: the first
member called computes every column, and each member returns its own columns of that product, a view. A
step's q, k and v of every layer at 16 rows ran 1.30x faster so at the 0.5B shape in bf16, 1.57x at
SmolLM2-135M's, 1.15x at 1.5B's (``measurements/joint_qkv.py``, BENCHMARKS.md, 2026-12-06); gate and up,
two wide projections, gained nothing measurable (0.99-1.09x) and stay apart.

The product is reused only for the very tensor it was computed from, and only once per member: a call with
another tensor, or a member called a second time (its columns may have been changed in place since, as
LoRA's update is added), computes it again. Slower then, never stale. That the input is not changed in place
between the sibling calls is what transformers' code does and what LoRA's shared ``x @ A`` relies on too
(:mod:`batchjob.engine.lora.layers`; inference tensors carry no version counter to check).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

GROUPS = (("q_proj", "k_proj", "v_proj"),)  # layers of one parent called on one input, in this order


class Joint:
    """One packed weight for layers that read one input, and the last product until each took its columns."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor], widths: Sequence[int]) -> None:
        self.product = product  # x times the members' weights one under the other (packed), plus their biases
        ends = list(itertools.accumulate(widths))
        self.columns = [(end - width, end) for width, end in zip(widths, ends, strict=True)]
        self._input: torch.Tensor | None = None
        self._product: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def take(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or member not in self._waiting:
            self._product = self.product(x)
            self._input, self._waiting = x, set(range(len(self.columns)))
        product = self._product
        assert product is not None
        self._waiting.discard(member)
        if not self._waiting:  # every member served: hold neither the input nor the product any longer
            self._input = self._product = None
        start, end = self.columns[member]
        return product[..., start:end]


def member_forward(joint: Joint, member: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return joint.take(member, x)

    return forward


def groups(
    model: torch.nn.Module, eligible: Callable[[torch.nn.Module], bool]
) -> list[list[torch.nn.Linear]]:
    """Each parent's siblings (in GROUPS' order) that are all ``eligible`` plain linear layers of one input
    size and dtype, with a bias on all or none."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            plain = [layer for layer in layers if type(layer) is torch.nn.Linear and eligible(layer)]
            if len(plain) < len(names):
                continue
            first = plain[0]
            if all(
                layer.in_features == first.in_features
                and layer.weight.dtype == first.weight.dtype
                and (layer.bias is None) == (first.bias is None)
                for layer in plain
            ):
                found.append(plain)
    return found
