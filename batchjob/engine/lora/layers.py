"""The low-rank updates beside each target layer, for the rows of each adapter in one step.

The runner hands :class:`LoraStep` the step's per-row adapter index (0: the base model) before each
forward; it groups the rows by adapter once. Each target layer keeps its own ``forward`` (the plain one,
or the CPU fast path's packed GEMM) and adds, per adapter present in the step, ``(x[rows] @ A.T) @ B.T *
scale`` to those rows of its output: gathered matmuls over the rows of one adapter, never merged into the
base weight, so base rows and rows of any number of adapters share one forward. Padding rows of a decode
buffer (graphs.py) are past every group and get no update.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np
import torch

from batchjob.engine.lora.peft_folder import LoraWeights


class LoraStep:
    """The current step's rows of each adapter: ``groups`` [(adapter index, row indices on the device, or
    None when the adapter has every row of the step)]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set(self, adapter_of_row: np.ndarray | None) -> None:
        """Group the step's rows ([T] adapter index per packed row) by adapter; base rows are left out."""
        self.groups = []
        if adapter_of_row is None or not adapter_of_row.any():
            return
        for index in np.unique(adapter_of_row[adapter_of_row > 0]).tolist():
            rows = np.flatnonzero(adapter_of_row == index)
            whole = len(rows) == len(adapter_of_row)  # no gather: (a decode buffer's padding rows too)
            self.groups.append((int(index), None if whole else torch.from_numpy(rows).to(self.device)))


def _lora_forward(
    base: Callable[[torch.Tensor], torch.Tensor], step: LoraStep, weights: dict[int, LoraWeights]
) -> Callable[..., torch.Tensor]:
    """A layer's forward: its own, plus the update of each adapter of the step that targets it."""

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = base(x)
        if not step.groups:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        out = out if out.is_contiguous() else out.contiguous()
        flat = out.view(-1, out.shape[-1])  # the layer's fresh output: updated in place
        for index, rows in step.groups:
            w = weights.get(index)
            if w is None:
                continue
            # PEFT's order of operations (lora_B(lora_A(x)) * scaling, then added), so float64 agrees.
            if rows is None:
                flat.add_((flat_x @ w.a.T) @ w.b.T * w.scale)
            else:
                flat.index_add_(0, rows, (flat_x.index_select(0, rows) @ w.a.T) @ w.b.T * w.scale)
        return out

    return forward


def install(model: torch.nn.Module, step: LoraStep, per_module: dict[str, dict[int, LoraWeights]]) -> None:
    """Wrap the ``forward`` of every module an adapter targets (the model's code is not edited)."""
    for name, weights in per_module.items():
        module = model.get_submodule(name)
        # A model wrapped before (another engine on the same model object): wrap its own forward again.
        base = getattr(module, "_batchjob_lora_base", None) or module.forward
        setattr(module, "_batchjob_lora_base", base)  # noqa: B010 - not a parameter or submodule
        wrapped = types.MethodType(_lora_forward(base, step, weights), module)
        module.forward = wrapped  # type: ignore[method-assign]
