"""Linear layers with oneDNN-packed weights: same results as the plain layers; float32, and bf16 where the CPU
has native bf16 (AVX512-BF16 or AMX), with the one warning line where it has not."""

from __future__ import annotations

import pytest
import torch

from batchjob import Engine, SamplingParams
from batchjob.engine.cpu import bf16 as cpu_bf16
from batchjob.engine.cpu import kernel as cpu_kernel
from batchjob.engine.cpu import linear as cpu_linear
from tests.engine.test_cpu_kernel import assert_bf16_differs_only_at_near_ties, bf16_prompts

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
needs_native_bf16 = pytest.mark.skipif(
    not cpu_bf16.native_bf16(),
    reason="this CPU has no native bf16 (AVX512-BF16 or AMX): oneDNN packs no bf16 weights here",
)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_equals_plain(bias, rows):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(1, rows, 96)
    want = layer(x)
    model = torch.nn.Sequential(layer)
    assert cpu_linear.prepack_linears(model) == 1
    assert cpu_linear.prepack_linears(model) == 1  # packing twice changes nothing
    with torch.no_grad():
        layer.weight.zero_()  # the forward now reads the packed copy, not the parameter
    got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(x[:, ::2]), want[:, ::2], atol=1e-5, rtol=1e-5)  # strided input


@needs_onednn
def test_packed_layers_hold_their_weights_once():
    """A packed layer's own weight is dropped (the packed copy serves its forward); a weight two modules share
    (an output head tied to the embedding) is kept, and so is the first parameter (the model's device)."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 32)
    head = torch.nn.Linear(32, 50, bias=False)
    head.weight = embed.weight  # tied, as a language model's output head
    own = torch.nn.Linear(32, 32)
    model = torch.nn.ModuleDict({"embed": embed, "own": own, "head": head})
    x = torch.randn(3, 32)
    want_own, want_head = own(x), head(x)
    assert cpu_linear.prepack_linears(model) == 2
    assert own.weight.is_meta and own.weight.shape == (32, 32)
    assert not head.weight.is_meta and head.weight is embed.weight
    torch.testing.assert_close(own(x), want_own, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(x), want_head, atol=1e-5, rtol=1e-5)
    for compute in (
        lambda: torch.nn.functional.linear(x, own.weight),
        lambda: x @ own.weight,
        own.weight.sum,
    ):
        with pytest.raises(RuntimeError, match="packed for the CPU"):  # never a stale or empty copy
            compute()
    assert own.weight.dtype == torch.float32 and own.weight.is_floating_point()  # what transformers reads
    first = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    assert cpu_linear.prepack_linears(first) == 2
    assert not first[0].weight.is_meta and first[1].weight.is_meta


class _Attention(torch.nn.Module):
    """q, k and v of one input, as transformers' attention modules have them."""

    def __init__(self, bias: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(4, 4)  # the model's first parameter stays unpacked
        self.q_proj = torch.nn.Linear(48, 64, bias=bias, dtype=dtype)
        self.k_proj = torch.nn.Linear(48, 16, bias=bias, dtype=dtype)
        self.v_proj = torch.nn.Linear(48, 16, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_q_k_and_v_packed_as_one_gemm_give_each_its_own_columns(bias):
    torch.manual_seed(1)
    model = _Attention(bias)
    x, other = torch.randn(1, 7, 48), torch.randn(1, 5, 48)
    want, want_other = model(x), model(other)
    assert cpu_linear.prepack_linears(model) == 4
    joint = vars(model.q_proj)["_batchjob_joint"]
    assert joint is vars(model.v_proj)["_batchjob_joint"] and joint.columns == [(0, 64), (64, 80), (80, 96)]
    assert all(layer.weight.is_meta for layer in (model.q_proj, model.k_proj, model.v_proj))  # held once
    for got, exp in zip(model(x), want, strict=True):
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    assert joint._input is None and joint._product is None  # nothing held once all three took theirs
    # Another input between two members, a member called twice, one changed in place: never a stale product.
    q = model.q_proj(x)
    torch.testing.assert_close(model.k_proj(other), want_other[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.v_proj(x), want[2], atol=1e-5, rtol=1e-5)
    q += 1.0  # as LoRA adds its update to the fresh output
    torch.testing.assert_close(model.q_proj(x), want[0], atol=1e-5, rtol=1e-5)


@needs_onednn
def test_joint_q_k_v_off_by_switch_or_for_mixed_biases(monkeypatch):
    model = _Attention(bias=True)
    model.k_proj = torch.nn.Linear(48, 16, bias=False)  # Whisper's k: no bias beside q's and v's
    cpu_linear.prepack_linears(model)
    assert not any(hasattr(m, "_batchjob_joint") for m in model.modules())
    assert all(hasattr(m, "_batchjob_packed") for m in (model.q_proj, model.k_proj, model.v_proj))
    monkeypatch.setenv(cpu_linear.JOINT_ENV, "0")
    model = _Attention(bias=False)
    assert cpu_linear.prepack_linears(model) == 4
    assert not any(hasattr(m, "_batchjob_joint") for m in model.modules())


def test_float32_and_native_bf16_on_cpu_only(monkeypatch):
    assert not cpu_linear.available(torch.float64, torch.device("cpu"))
    assert not cpu_linear.available(torch.float16, torch.device("cpu"))
    assert cpu_linear.available(torch.bfloat16, torch.device("cpu")) == cpu_bf16.native_bf16()
    assert not cpu_linear.available(torch.float32, torch.device("meta"))
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    assert not cpu_linear.available(torch.float32, torch.device("cpu"))


@needs_onednn
def test_engine_packs_float32_and_gives_the_same_tokens(tiny_model_dir, monkeypatch):
    prompts = [[5, 9, 13, 200, 17], list(range(3, 60)), [44] * 30]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    packed = Engine.from_pretrained(str(tiny_model_dir), dtype="float32", device="cpu")
    assert packed.runner.packed_linears > 0
    dropped = [
        m for m in packed.runner.model.modules() if isinstance(m, torch.nn.Linear) and m.weight.is_meta
    ]
    assert dropped  # held once: the generation below runs on the packed copies alone
    assert any(hasattr(m, "_batchjob_joint") for m in packed.runner.model.modules())  # q, k, v as one GEMM
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    plain = Engine.from_pretrained(str(tiny_model_dir), dtype="float32", device="cpu")
    assert plain.runner.packed_linears == 0
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in packed.generate(prompts, params)] == want
    f64 = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu")
    assert f64.runner.packed_linears == 0


def test_bf16_weights_packed_exactly_where_the_cpu_has_native_bf16():
    """Here or there: a bf16 layer is packed only with native bf16, and runs (plain) without it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160).to(torch.bfloat16)
    x = torch.randn(1, 7, 96, dtype=torch.bfloat16)
    want = layer(x)
    model = torch.nn.Sequential(layer)
    assert cpu_linear.prepack_linears(model) == int(cpu_bf16.native_bf16())
    got = model(x)
    assert got.dtype == torch.bfloat16
    if not cpu_bf16.native_bf16():
        assert "forward" not in vars(layer) and torch.equal(got, want)  # the plain layer, untouched


def test_slow_bf16_is_said_only_for_bf16_on_a_cpu_without_it():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    line = cpu_bf16.slow_bf16(cpu, torch.bfloat16)
    if cpu_bf16.native_bf16():
        assert line is None
    else:
        assert "AVX512-BF16 or AMX" in line and "slower" in line and "\n" not in line
    assert cpu_bf16.slow_bf16(cpu, torch.float32) is None and cpu_bf16.slow_bf16(cuda, torch.bfloat16) is None


def test_the_bf16_hint_is_for_a_default_float32_on_a_cpu_with_native_bf16(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda: True)
    for amx, speed in (
        (True, "(AMX): --dtype bfloat16 ran 2.5-2.8x"),
        (False, "no AMX): --dtype bfloat16 ran 1.9"),
    ):
        monkeypatch.setattr(cpu_bf16, "has_amx", lambda amx=amx: amx)
        line = cpu_bf16.dtype_hint(cpu, torch.float32, chosen=False)
        assert line is not None and speed in line and "\n" not in line
    assert cpu_bf16.dtype_hint(cpu, torch.float32, chosen=True) is None  # the user's own choice
    assert cpu_bf16.dtype_hint(cpu, torch.bfloat16, chosen=False) is None
    assert cpu_bf16.dtype_hint(cuda, torch.float32, chosen=False) is None
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda: False)
    assert cpu_bf16.dtype_hint(cpu, torch.float32, chosen=False) is None


@needs_onednn
@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_bf16_linear_equals_plain_up_to_bf16_rounding(rows):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(256, 160).to(torch.bfloat16)
    x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
    plain = layer(x)
    exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    model = torch.nn.Sequential(layer)
    assert cpu_linear.prepack_linears(model) == 1
    with torch.no_grad():
        layer.weight.zero_()  # the forward now reads the packed copy, not the parameter
    got = model(x)
    assert got.dtype == torch.bfloat16
    # Each is the float product rounded to bf16 (once, or twice with the bias): within 2^-7 of it.
    for out in (got, plain):
        torch.testing.assert_close(out.float(), exact, rtol=2**-7, atol=1e-3)


@needs_onednn
def test_engine_in_bf16_packs_where_native_and_agrees_with_plain_layers(
    decisive_model_dir, monkeypatch, caplog, capsys
):
    """The engine in bf16: linears packed with native bf16 (tokens as the plain layers' but for near-ties),
    else not packed, the same tokens, and one warning line saying bf16 is slower here."""
    caplog.set_level("WARNING", logger=cpu_bf16.__name__)
    options = dict(dtype="bfloat16", device="cpu", num_blocks=128)
    packed = Engine.from_pretrained(str(decisive_model_dir), **options)
    native = cpu_bf16.native_bf16()
    assert (packed.runner.packed_linears > 0) == native
    warned = [r.getMessage() for r in caplog.records if r.name == cpu_bf16.__name__]
    assert warned == ([] if native else [cpu_bf16.slow_bf16(torch.device("cpu"), torch.bfloat16)])
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    plain = Engine.from_pretrained(str(decisive_model_dir), **options)
    assert plain.runner.packed_linears == 0
    prompts = bf16_prompts(packed.vocab_size)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in packed.generate(prompts, params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    if native:
        assert_bf16_differs_only_at_near_ties(
            decisive_model_dir, prompts, got, want, "packed vs plain", capsys
        )
    else:
        assert got == want and all(len(t) == 24 for t in got)
    caplog.clear()
    Engine.from_pretrained(str(decisive_model_dir), dtype="float32", device="cpu", num_blocks=128)
    assert not [r for r in caplog.records if r.name == cpu_bf16.__name__]


needs_linear_kernel = pytest.mark.skipif(
    not cpu_kernel.linear_takes(),
    reason="no AVX512-BF16 in this CPU's build of the kernel library: bf16 linears stay on oneDNN's kernel",
)


@needs_onednn
@needs_linear_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("rows", "width", "depth"), [(1, 40, 6), (13, 100, 96), (16, 17, 64), (113, 33, 128)]
)
def test_bf16_kernel_is_the_float_product_rounded_as_onednn_rounds_it(rows, width, depth, bias):
    """The kernel's product (rows below, at and past its tiles of 14 and chunks of 112, a width of part of a
    block, 2-D, 3-D and strided input) is the float product rounded to bf16, and oneDNN's own bit for bit
    but where float sums in another order round apart (measured: 20 elements in a million)."""
    torch.manual_seed(rows)
    weight = torch.randn(width, depth, dtype=torch.bfloat16) / depth**0.5
    b = torch.randn(width, dtype=torch.bfloat16) if bias else None
    x = torch.randn(2, rows, depth, dtype=torch.bfloat16)
    ours, theirs = cpu_linear.Blocks(weight, b), cpu_linear.OneDnn(weight, b)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    for inp, want in ((x, exact), (x[1], exact[1]), (x[:, ::2], exact[:, ::2])):
        got = ours(inp)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)  # one rounding of a float sum
        assert (got == theirs(inp)).double().mean() >= 0.99


@needs_linear_kernel
def test_bf16_linears_go_to_the_kernel_without_amx_and_to_onednn_with_it(monkeypatch):
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "has_amx", lambda: False)
    assert isinstance(cpu_linear._pack(weight, None), cpu_linear.Blocks)
    assert isinstance(cpu_linear._pack(weight[:, :63], None), cpu_linear.OneDnn)  # pairs of inputs: even only
    assert isinstance(cpu_linear._pack(weight.float(), None), cpu_linear.OneDnn)
    monkeypatch.setenv(cpu_kernel.LINEAR_ENV, "0")
    assert isinstance(cpu_linear._pack(weight, None), cpu_linear.OneDnn)
    monkeypatch.delenv(cpu_kernel.LINEAR_ENV)
    monkeypatch.setattr(cpu_linear, "has_amx", lambda: True)  # oneDNN's kernel runs on AMX's tiles
    assert isinstance(cpu_linear._pack(weight, None), cpu_linear.OneDnn)


@needs_onednn
@needs_native_bf16
@needs_linear_kernel
def test_engine_on_the_bf16_kernel_agrees_with_onednn(decisive_model_dir, monkeypatch, capsys):
    options = dict(dtype="bfloat16", device="cpu", num_blocks=128)
    monkeypatch.setattr(cpu_linear, "has_amx", lambda: False)
    ours = Engine.from_pretrained(str(decisive_model_dir), **options)
    modules = list(ours.runner.model.modules())
    products = [vars(m)["_batchjob_packed"] for m in modules if "_batchjob_packed" in vars(m)]
    products += [vars(m)["_batchjob_joint"].product for m in modules if "_batchjob_joint" in vars(m)]
    assert products and all(isinstance(p, cpu_linear.Blocks) for p in products)
    monkeypatch.setenv(cpu_kernel.LINEAR_ENV, "0")
    onednn = Engine.from_pretrained(str(decisive_model_dir), **options)
    prompts = bf16_prompts(ours.vocab_size)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in ours.generate(prompts, params)]
    want = [o.token_ids for o in onednn.generate(prompts, params)]
    assert_bf16_differs_only_at_near_ties(decisive_model_dir, prompts, got, want, "kernel vs oneDNN", capsys)
