"""The low-rank updates beside each target layer: every adapter of a step in two GEMMs a layer.

Each target layer keeps its own ``forward`` (the plain one, or the CPU fast path's packed GEMM) and adds its
rows' updates to its fresh output. The adapters of a layer are stacked once, at load: ``a`` [R, in] is every
adapter's A one under the other (R: the sum of their ranks) and ``bt`` [R, out] every adapter's B transposed,
its scale folded in. A step then costs, per layer, ``h = x @ a.T`` (every row against every adapter's rank
columns), ``h *= mask`` (a row keeps only its own adapter's columns; a base row none) and ``out += h @ bt``:
three calls however many adapters the step mixes, no gather, no scatter, no loop over adapters. The step's
mask is built once per distinct column layout (:class:`LoraStep`), shared by every layer of that layout;
with one adapter on every row it is skipped. Layers that read the same input (``q_proj``, ``k_proj``,
``v_proj``; ``gate_proj``, ``up_proj``) share one ``x @ a.T`` over their stacked A's: the first computes it,
the others find the same input tensor and take their columns. A base-only step costs one test a layer.

Where a step holds only some of a layer's adapters, the layer computes the columns from its first to its
last present adapter (a slice: no copy). Padding rows of a decode buffer (graphs.py) past the step's rows
get no update (their mask is 0), or any update where one adapter has every row: they are never read.
Per row the arithmetic is PEFT's ``lora_B(lora_A(x)) * scaling`` but for the scale's place and the zero
products of other adapters' columns, so float64 agrees with PEFT's tokens.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from batchjob.engine.lora.peft_folder import LoraWeights

# Sibling layers known to read one input tensor (their parent's forward passes the same object to each):
# they share ``x @ a.T``. Where a model passes them different tensors each computes its own (correct, slower).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))

# A step computes every present adapter's columns for every row (the mask) while rows x (adapters - 1) is at
# most this; past it (prompt chunks of several adapters) each adapter's rows are gathered instead, so the
# wasted products of other adapters' columns never outgrow the saved calls (measured at 135M: 16 adapters
# over a 1,024-row prefill cost 1.6 s more masked than gathered).
DENSE_LIMIT = 512

Layout = tuple[tuple[int, int], ...]  # (adapter index, rank) of each stacked block of rank columns, in order


class LoraStep:
    """The current step's adapter index per packed row, and the masks built from it (once a layout)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.present: frozenset[int] = frozenset()  # adapters with a row in the step (empty: base only)
        self.whole = 0  # the adapter that has every row of the step (0: none does)
        self.generation = 0  # bumped by every set(): what a layer computed for an earlier step is stale
        # Every step gathered (a prefill-only engine sets it): a row's update is then computed from its own
        # adapter's weights alone, so its floats do not depend on the step's mix of adapters.
        self.gathered = False
        self._index: torch.Tensor | None = None  # [T] int64 on the device
        self.rows: dict[int, torch.Tensor] | None = None  # adapter -> its rows, when gathered (not masked)
        self._masks: dict[tuple[Layout, int], torch.Tensor] = {}
        self._owners: dict[Layout, torch.Tensor] = {}

    def set(self, adapter_of_row: np.ndarray | None) -> None:
        """Take the step's rows ([T] adapter index per packed row, 0: the base model)."""
        self.generation += 1
        self._masks.clear()
        if adapter_of_row is None or not adapter_of_row.any():
            self.present, self.whole, self._index, self.rows = frozenset(), 0, None, None
            return
        self.present = frozenset(np.unique(adapter_of_row[adapter_of_row > 0]).tolist())
        first = int(adapter_of_row[0])
        self.whole = first if len(self.present) == 1 and bool((adapter_of_row == first).all()) else 0
        self._index = torch.from_numpy(adapter_of_row).to(self.device)
        self.rows = None
        if self.gathered or len(adapter_of_row) * (len(self.present) - 1) > DENSE_LIMIT:
            self.rows = {
                i: torch.from_numpy(np.flatnonzero(adapter_of_row == i)).to(self.device) for i in self.present
            }

    def mask(self, layout: Layout, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, R] 1 where a row's adapter owns the rank column, else 0 (rows past the step's: 0)."""
        key = (layout, rows)
        mask = self._masks.get(key)
        if mask is None:
            assert self._index is not None
            owners = self._owners.get(layout)
            if owners is None:
                owners = torch.tensor([i for i, r in layout for _ in range(r)], device=self.device)
                self._owners[layout] = owners
            index = self._index
            if rows > len(index):  # a padded decode buffer: its extra rows are nobody's
                index = torch.cat([index, index.new_zeros(rows - len(index))])
            mask = (index[:rows, None] == owners[None, :]).to(dtype)
            self._masks[key] = mask
        return mask


@dataclass
class Target:
    """One adapted layer's stacked adapters: views into its group's ``a`` and its own ``bt``."""

    layout: Layout
    a: torch.Tensor  # [R, in]: the adapters' A, stacked in layout order
    bt: torch.Tensor  # [R, out]: (B * scale).T, stacked alike
    offset: int  # its first column in the group's shared ``x @ a.T``
    starts: dict[int, int] = field(default_factory=dict)  # adapter index -> its first column here

    @property
    def adapters(self) -> frozenset[int]:
        return frozenset(i for i, _ in self.layout)

    def span(self, present: frozenset[int]) -> tuple[int, int, Layout]:
        """Columns from the first to the last present adapter, and their layout."""
        blocks = [k for k, (i, _) in enumerate(self.layout) if i in present]
        lo, hi = blocks[0], blocks[-1] + 1
        start = self.starts[self.layout[lo][0]]
        end = self.starts[self.layout[hi - 1][0]] + self.layout[hi - 1][1]
        return start, end, self.layout[lo:hi]


class Group:
    """Sibling layers that read one input: their A's stacked, and this step's ``x @ a.T`` over them."""

    def __init__(self, a: torch.Tensor, layout: Layout, adapters: frozenset[int], size: int) -> None:
        self.a = a  # [sum of the members' R, in]
        self.layout = layout
        self.adapters = adapters
        self.size = size  # members
        self._key: tuple[int, int, int] | None = None  # (step generation, id of x, its data)
        self._x: torch.Tensor | None = None  # held so that its id is not reused while cached
        self._h: torch.Tensor | None = None

    def h(self, x: torch.Tensor, flat_x: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """``flat_x @ a.T`` masked to each row's adapter, computed once for the members that read ``x`` (the
        layer's input as the model passed it: ``flat_x``, its rows, is a fresh view in every member)."""
        key = (step.generation, id(x), x.data_ptr())
        if self._key != key or self._h is None:
            h = flat_x @ self.a.T
            if not step.whole:
                h.mul_(step.mask(self.layout, flat_x.shape[0], h.dtype))
            self._key, self._x, self._h = key, x, h
        return self._h


def _update(x: torch.Tensor, flat: torch.Tensor, target: Target, group: Group, step: LoraStep) -> None:
    """Add the step's updates of ``target`` on its input ``x`` to ``flat`` [rows, out] in place."""
    flat_x = x.reshape(-1, x.shape[-1])
    if step.rows is not None:  # many rows of several adapters: each adapter's rows gathered
        for i, r in target.layout:
            rows = step.rows.get(i)
            if rows is not None:
                start = target.starts[i]
                h = flat_x.index_select(0, rows) @ target.a[start : start + r].T
                flat.index_add_(0, rows, h @ target.bt[start : start + r])
        return
    if group.size > 1 and group.adapters <= step.present:
        h = group.h(x, flat_x, step)[:, target.offset : target.offset + target.a.shape[0]]
        flat.addmm_(h, target.bt)
        return
    start, end, layout = target.span(step.present)
    h = flat_x @ target.a[start:end].T
    if not step.whole:
        h.mul_(step.mask(layout, flat_x.shape[0], h.dtype))
    flat.addmm_(h, target.bt[start:end])


def _lora_forward(
    base: Callable[[torch.Tensor], torch.Tensor], step: LoraStep, target: Target, group: Group
) -> Callable[..., torch.Tensor]:
    """A layer's forward: its own, plus the update of the step's adapters that target it."""
    mine = target.adapters

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = base(x)
        if not step.present or mine.isdisjoint(step.present):
            return out
        out = out if out.is_contiguous() else out.contiguous()
        _update(x, out.view(-1, out.shape[-1]), target, group, step)
        return out

    return forward


def _stack(weights: dict[int, LoraWeights]) -> tuple[Layout, torch.Tensor, torch.Tensor]:
    """A layer's adapters in index order: layout, stacked A [R, in], stacked (B * scale).T [R, out]."""
    order = sorted(weights)
    layout = tuple((i, weights[i].a.shape[0]) for i in order)
    a = torch.cat([weights[i].a for i in order])
    bt = torch.cat([(weights[i].b * weights[i].scale).T for i in order]).contiguous()
    return layout, a, bt


def _groups(names: list[str]) -> list[list[str]]:
    """The target names partitioned into sibling groups (SIBLINGS under one parent), else alone."""
    left, out = set(names), []
    for name in names:
        if name not in left:
            continue
        parent, _, leaf = name.rpartition(".")
        family = next((s for s in SIBLINGS if leaf in s), (leaf,))
        members = [m for m in (f"{parent}.{s}" if parent else s for s in family) if m in left]
        left.difference_update(members)
        out.append(members)
    return out


def install(model: torch.nn.Module, step: LoraStep, per_module: dict[str, dict[int, LoraWeights]]) -> None:
    """Stack each target's adapters and wrap its ``forward`` (the model's code is not edited). The adapters'
    own weights become views of the stacks (held once; their B with the scale folded in, scale 1)."""
    for members in _groups(list(per_module)):
        stacks = {m: _stack(per_module[m]) for m in members}
        if len({s[1].shape[1] for s in stacks.values()}) > 1:  # not one input width: no sharing
            for m in members:
                _wrap(model, step, {m: stacks[m]}, per_module)
            continue
        _wrap(model, step, stacks, per_module)


def _wrap(
    model: torch.nn.Module,
    step: LoraStep,
    stacks: dict[str, tuple[Layout, torch.Tensor, torch.Tensor]],
    per_module: dict[str, dict[int, LoraWeights]],
) -> None:
    """Wrap the members of one group (``stacks``: member -> its stack)."""
    group_a = torch.cat([a for _, a, _ in stacks.values()])
    layout = tuple(block for lay, _, _ in stacks.values() for block in lay)
    adapters = frozenset(i for i, _ in layout)
    group = Group(group_a, layout, adapters, len(stacks))
    offset = 0
    for name, (lay, a, bt) in stacks.items():
        rows = a.shape[0]
        target = Target(lay, group_a[offset : offset + rows], bt, offset)
        col = 0
        for i, r in lay:
            target.starts[i] = col
            w = per_module[name][i]
            w.a, w.b, w.scale = target.a[col : col + r], bt[col : col + r].T, 1.0
            col += r
        offset += rows
        module = model.get_submodule(name)
        # A model wrapped before (another engine on the same model object): wrap its own forward again.
        base = getattr(module, "_batchjob_lora_base", None) or module.forward
        setattr(module, "_batchjob_lora_base", base)  # noqa: B010 - not a parameter or submodule
        module.forward = types.MethodType(_lora_forward(base, step, target, group), module)  # type: ignore[method-assign]
