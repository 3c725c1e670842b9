"""Linear layers on the CPU with weights packed once for oneDNN, instead of on every call.

A decode step multiplies a few dozen rows by every weight matrix of the model. At that size the default
CPU path (MKL sgemm) spends much of each call preparing the weight matrix; oneDNN with a weight already in
its own blocked layout skips that. Measured on the default model (2 cores, fp32): a plain oneDNN copy
made decode steps of ~44 requests about 12% faster than MKL; the blocked layout a further 1.1-1.3x (steps of
64 down to 4 rows), large prefill steps the same (BENCHMARKS.md).

Only the layers' ``forward`` changes: the modules and the model's code stay as they are. A packed layer's
own ``weight`` is then dropped for a :class:`DroppedWeight` of the same shape and dtype (no memory), and what
stays unpacked gets its own memory where it was a view of the checkpoint file's mapping, so the
weights are held once, not twice (Qwen2.5-0.5B's shape in float32: peak RSS at load 6,239 -> 5,042 MiB);
code that computes with such a weight fails with a message instead of reading a stale or empty copy. A weight another module shares
(an output head tied to the input embedding) is kept. float32 everywhere, bfloat16 where the CPU has native
bf16 (:func:`~.bf16.native_bf16`: AVX512-BF16 or AMX; the same two oneDNN ops, as torch's inductor packs bf16
linears on the CPU); not float64: oneDNN has no float64 path, and the exactness tests run in float64 through
the plain layers. ``BATCHJOB_CPU_PREPACK=0`` turns it off.

On a CPU with AVX512-BF16 and no AMX, bf16 weights go to the CPU library's own kernel instead (:class:`Blocks`,
``csrc/linear_bf16.cpp``): at a decode step's 16 rows it ran a Qwen2.5-0.5B layer's linears 1.3-1.9x faster
than oneDNN's kernel (weights read from memory), prompt-sized calls 0.97-1.07x, summing in oneDNN's order: its
outputs but for ~20 elements in a million (BENCHMARKS.md, 2026-12-07). Where AMX is there, oneDNN's kernel uses it; ``BATCHJOB_CPU_LINEAR=0`` keeps oneDNN everywhere.
"""

from __future__ import annotations

import types

import torch

from batchjob import env
from batchjob.engine.cpu import kernel, siblings
from batchjob.engine.cpu.bf16 import has_amx, native_bf16
from batchjob.engine.cpu.pages import FilePages

DISABLE_ENV = "BATCHJOB_CPU_PREPACK"
JOINT_ENV = "BATCHJOB_CPU_JOINT"  # 0: q, k and v packed each on its own, not as one GEMM (siblings.py)


def packs(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are packed on this CPU: float32, and bf16 where the CPU has native bf16."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def available(dtype: torch.dtype, device: torch.device) -> bool:
    if not env.flag(DISABLE_ENV):  # on unless turned off
        return False
    return device.type == "cpu" and packs(dtype) and torch.backends.mkldnn.is_available()


class DroppedWeight(torch.Tensor):
    """The ``weight`` left on a packed layer: its shape, dtype and device are there (transformers reads them),
    no storage (a ``meta`` tensor), and any computation with it raises. A plain meta tensor would not do:
    torch lets ``meta + cpu`` through and returns a CPU tensor of uninitialised memory."""

    _METADATA = frozenset(
        ("__get__", "__set__", "__repr__", "__format__", "size", "dim", "numel", "nelement", "stride")
        + ("element_size", "is_floating_point", "is_complex", "is_contiguous", "detach", "requires_grad_")
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in cls._METADATA:
            return super().__torch_function__(func, types, args, kwargs or {})
        raise RuntimeError(
            f"{name} on the weight of a linear layer packed for the CPU (oneDNN or the bf16 kernel): the packed "
            f"copy is the only one (set {DISABLE_ENV}=0 to keep the plain weights)"
        )


def _drop(weight: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty_like(weight, device="meta").as_subclass(DroppedWeight), False)


PACK_ROWS_HINT = 64  # rows per call oneDNN lays the weight out for (a decode step's size; any size works)


class OneDnn:
    """A weight in oneDNN's blocked layout for its matmul kernel, and the layer's bias: ``self(x)`` is the layer's
    product. A plain ``to_mkldnn()`` copy keeps the row-major layout, which oneDNN re-blocks on every call; the
    blocked one makes calls of a few dozen rows 1.1-1.6x faster in microbenchmarks, large calls the same."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        self.weight = weight.to_mkldnn() if reorder is None else reorder(weight, PACK_ROWS_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Blocks:
    """A bf16 weight in the layout of the CPU library's linear kernel (:func:`.kernel.pack_bf16`), the bias in
    float32 as the kernel adds it, both copied at load (nothing changes a loaded layer's bias; LoRA adapters that
    train one are refused): ``self(x)`` is the layer's product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.width = weight.shape[0]
        self.weight = kernel.pack_bf16(weight)
        self.bias = None if bias is None else bias.detach().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernel.linear_bf16(x, self.weight, self.bias, self.width)


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> OneDnn | Blocks:
    if (
        weight.dtype == torch.bfloat16
        and weight.shape[1] % 2 == 0
        and not has_amx()
        and kernel.linear_takes()
    ):
        return Blocks(weight, bias)
    return OneDnn(weight, bias)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return self._batchjob_packed(x)


@torch.no_grad()
def prepack_linears(model: torch.nn.Module) -> int:
    """Give every float32 ``nn.Linear`` of the model (and bf16 one, on a CPU with native bf16) a packed weight
    and the forward that uses it. Returns how many layers were packed (0 where oneDNN refuses the weight)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    first = next(model.parameters(), None)
    if first is not None:
        uses[id(first)] = 0  # transformers takes the model's device from its first parameter: never meta
    count, pages = 0, FilePages()

    def alone(layer: torch.nn.Module) -> bool:  # packable, its weight its own, not packed yet
        return packs(layer.weight.dtype) and uses.get(id(layer.weight), 0) == 1 and not _packed(layer)

    for layers in siblings.groups(model, alone) if env.flag(JOINT_ENV) else []:
        _pack_joint(layers, pages)
    for module in model.modules():
        if type(module) is not torch.nn.Linear or not packs(module.weight.dtype):
            continue
        if _packed(module):
            count += 1
            continue
        try:
            module._batchjob_packed = _pack(module.weight.detach(), module.bias)
        except RuntimeError:
            continue
        module.forward = types.MethodType(_packed_forward, module)
        if uses.get(id(module.weight), 0) == 1:  # not tied to another module: the packed copy is the one
            plain, module.weight = module.weight, _drop(module.weight)
            pages.release(plain.detach())  # its pages of the checkpoint file's mapping (pages.py)
        count += 1
    if count:
        _own_storage(model)
    return count


def _packed(layer: torch.nn.Module) -> bool:
    return hasattr(layer, "_batchjob_packed") or hasattr(layer, "_batchjob_joint")


def _pack_joint(layers: list[torch.nn.Linear], pages: FilePages) -> None:
    """Pack sibling layers' weights as one (siblings.py); each layer's forward then takes its columns."""
    weights = [layer.weight.detach() for layer in layers]
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    try:
        product = _pack(torch.cat(weights), bias)
    except RuntimeError:
        return  # each is tried on its own
    joint = siblings.Joint(product, [w.shape[0] for w in weights])
    for i, layer in enumerate(layers):
        layer._batchjob_joint = joint
        layer.forward = siblings.member_forward(joint, i)
        plain, layer.weight = layer.weight, _drop(layer.weight)
        pages.release(plain.detach())


def _own_storage(model: torch.nn.Module) -> None:
    """Give each tensor the model keeps unpacked (embeddings, norms, biases) memory of its own: transformers
    may load a checkpoint's tensors as views of one mapping of the file (each its own storage, so nothing
    here can tell), and a single view left (the embedding) keeps the whole file mapped beside the packed
    copies. Measured on SmolLM2-135M in float32: 513 MiB of the file stayed resident after packing."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not (isinstance(tensor, DroppedWeight) or tensor.is_meta or tensor.is_mkldnn):
            tensor.data = tensor.data.clone()
