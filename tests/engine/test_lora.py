"""LoRA adapters per request against PEFT: a mixed batch of adapters and base rows equals
``PeftModel.from_pretrained(base, adapter)`` generate token for token (float64), with chunked prefill,
preemption and the prefix cache on; the CPU fast path's update beside the packed GEMM; refusals by name."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from batchjob.engine.cpu import kernel as cpu_kernel
from batchjob.engine.cpu import linear as cpu_linear
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.errors import ConfigError
from tests.tiny_models import hf_greedy, make_model

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(600)

# Three adapters that exercise what PEFT's config carries: rank and alpha, per-module patterns, rsLoRA,
# attention and MLP targets, a layer subset.
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6},
        alpha_pattern={"up_proj": 3.0},
    ),
    "rs": dict(
        r=3, lora_alpha=5, use_rslora=True, target_modules=["o_proj", "down_proj"], layers_to_transform=[1]
    ),
}


def _hf(folder, dtype=torch.float64):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def make_adapter(base_folder: Path, out: Path, seed: int, **config) -> Path:
    """A PEFT LoRA folder for the model in ``base_folder``, with random (non-zero) A and B."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(_hf(base_folder), peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapter_sets(tiny_model_dirs, tmp_path_factory):
    """family -> (base folder, {name: adapter folder})."""
    root = tmp_path_factory.mktemp("lora")
    sets = {}
    for family in ("llama", "qwen2"):
        base = tiny_model_dirs[family]
        folders = {
            name: make_adapter(base, root / family / name, i + 1, **cfg)
            for i, (name, cfg) in enumerate(ADAPTERS.items())
        }
        sets[family] = (base, folders)
    return sets


def _peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    model = _hf(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    return hf_greedy(model, prompt, n, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("gathered", [False, True])
def test_mixed_batch_equals_peft_generate(adapter_sets, family, gathered, monkeypatch):
    """Rows of three adapters and base rows in one batch, chunked prefill, preemption and a shared prefix:
    each row's greedy tokens equal PEFT's generate with its adapter; each adapter changes the output. Both
    ways a step adds the updates: masked (every row against every adapter), and each adapter's rows gathered."""
    if gathered:
        monkeypatch.setattr("batchjob.engine.lora.layers.DENSE_LIMIT", 0)
    base, folders = adapter_sets[family]
    engine = Engine.from_pretrained(
        str(base),
        dtype="float64",
        device="cpu",
        block_size=4,
        num_blocks=40,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        enable_prefix_caching=True,
        lora={k: str(v) for k, v in folders.items()},
    )
    rng = random.Random(5)
    shared = [rng.randrange(3, engine.vocab_size) for _ in range(21)]
    prompts, names = [], []
    for i, name in enumerate([None, "qv", "all", "rs"] * 2):
        tail = [rng.randrange(3, engine.vocab_size) for _ in range(3 + 5 * i)]
        prompts.append(shared + tail if i % 2 == 0 else tail)
        names.append(name)
    # The same prompt under every adapter: the prefix cache must not serve one adapter's blocks to another.
    prompts += [shared + [7, 8, 9]] * 4
    names += [None, "qv", "all", "rs"]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params, adapters=names)
    assert engine.stats.preemptions > 0
    assert engine.stats.cached_prompt_tokens > 0
    refs = [
        _peft_greedy(base, None if n is None else folders[n], p, 10)
        for p, n in zip(prompts, names, strict=True)
    ]
    for out, ref, name in zip(outs, refs, names, strict=True):
        assert out.error is None
        assert out.token_ids == ref, f"adapter {name}"
    same_prompt = refs[-4:]
    assert len({tuple(r) for r in same_prompt}) == 4, "each adapter changes the output"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # A row alone equals the same row in the mixed batch.
    for i in (2, 9, 11):
        alone = engine.generate([prompts[i]], params, adapters=[names[i]])[0]
        assert alone.token_ids == outs[i].token_ids


def test_chat_takes_adapters_as_generate_does(adapter_sets):
    """chat() took no adapters= (generate() did): each conversation now runs under its adapter, as generate
    runs its rendered prompt under it."""
    base, folders = adapter_sets["llama"]
    engine = Engine.from_pretrained(str(base), dtype="float64", device="cpu", lora={"qv": str(folders["qv"])})
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    got = engine.chat(["Hello there", "Hello there"], params, adapters=["qv", None])
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    want = engine.generate([prompt, prompt], params, adapters=["qv", None])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].token_ids != got[1].token_ids
    with pytest.raises(ConfigError, match="unknown LoRA adapter 'nope'"):
        engine.chat(["Hello there"], params, adapters=["nope"])
    assert not engine.has_unfinished()


def test_decode_buffers_and_resume_keep_the_adapter(adapter_sets):
    """The padded decode buffers (cuda_graphs on a CPU engine) and a resumed request (its snapshot names the
    adapter) give PEFT's tokens."""
    base, folders = adapter_sets["llama"]
    engine = Engine.from_pretrained(
        str(base),
        dtype="float64",
        device="cpu",
        block_size=4,
        cuda_graphs=True,
        lora={"all": str(folders["all"])},
    )
    prompt = list(range(5, 25))
    ref = _peft_greedy(base, folders["all"], prompt, 12)
    engine.add_request(
        "r", prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True), adapter="all"
    )
    engine.add_request("b", prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    states = {s.request_id: s for s in engine.snapshot()}
    assert states["r"].adapter == "all" and states["b"].adapter is None
    fresh = Engine.from_pretrained(
        str(base), dtype="float64", device="cpu", lora={"all": str(folders["all"])}
    )
    s = states["r"]
    fresh.add_request("r", s.prompt_ids, s.params, output_ids=s.output_ids, adapter=s.adapter)
    while fresh.has_unfinished():
        for out in fresh.step():
            assert out.token_ids == ref


@pytest.mark.parametrize("gathered", [False, True])
def test_cpu_fast_path_update_beside_the_packed_gemm(adapter_sets, gathered, monkeypatch):
    """float32 with packed linears (q/k/v with biases): a step's logits under an adapter equal PEFT's (float32
    tolerance), in a step of four adapters (masked, or each adapter's rows gathered), of one adapter on every
    row, and of base rows only."""
    if gathered:
        monkeypatch.setattr("batchjob.engine.lora.layers.DENSE_LIMIT", 0)
    base, folders = adapter_sets["qwen2"]
    engine = Engine.from_pretrained(
        str(base), dtype="float32", device="cpu", block_size=4, lora={k: str(v) for k, v in folders.items()}
    )
    if not engine.runner.packed_linears:
        pytest.skip("no oneDNN packing on this CPU")
    attention = engine.model.get_submodule("model.layers.0.self_attn")
    assert hasattr(attention.q_proj, "_batchjob_joint")  # q, k, v one GEMM (cpu/siblings.py), LoRA beside it
    assert hasattr(attention.o_proj, "_batchjob_packed")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (9, 4, 13, 6, 7, 5)]
    names = [None, "qv", "all", "rs", "all", None]
    refs = []
    for p, name in zip(prompts, names, strict=True):
        model = _hf(base, torch.float32)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, str(folders[name])).eval()
        with torch.inference_mode():
            refs.append(model(torch.tensor([p])).logits[0, -1])
    for rows in ([0, 1, 2, 3], [2, 4], [5, 0]):  # four adapters; one on every row; base rows only
        for i in rows:
            engine.add_request(f"{rows}{i}", prompts[i], SamplingParams(max_new_tokens=1), adapter=names[i])
        reqs = list(engine.scheduler.waiting)[-len(rows) :]
        for r in reqs:
            assert engine.block_manager.allocate(r, r.num_tokens)
        logits, _ = engine.runner.execute(SchedulerOutput(reqs, [r.num_tokens for r in reqs]))
        for row, i in enumerate(rows):
            torch.testing.assert_close(logits[row], refs[i], rtol=1e-4, atol=1e-4)
        for r in reqs:
            engine.block_manager.free(r)


def test_siblings_compute_x_at_a_once(adapter_sets, monkeypatch):
    """q/k/v (and gate/up) read one input: a step computes their stacked ``x @ A.T`` once, not per member
    (the model hands each the same 3-d tensor; the rows each member flattens from it are fresh views)."""
    from batchjob.engine.lora import layers

    base, folders = adapter_sets["llama"]
    lora = {k: str(v) for k, v in folders.items()}
    engine = Engine.from_pretrained(str(base), dtype="float64", device="cpu", lora=lora)
    computed: list[int] = []
    original = layers.Group.h

    def counted(self, x, flat_x, step):
        before = self._h
        h = original(self, x, flat_x, step)
        if h is not before:
            computed.append(id(self))
        return h

    monkeypatch.setattr(layers.Group, "h", counted)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0), adapters=["qv", "all", "rs"])
    steps = engine.stats.steps
    assert steps >= 2 and set(collections.Counter(computed).values()) == {steps}  # once a group and step


def _edited(folder: Path, tmp_path: Path, name: str, **changes) -> Path:
    out = tmp_path / name
    out.mkdir()
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "LoRA biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "base biases"),
        ({"base_model_name_or_path": "someone/Other-Model"}, "made for base model 'someone/Other-Model'"),
        ({"r": 5}, "weights are of rank 4, but its adapter_config.json says r 5"),
        # PEFT rewrites the base weights to the residual these were trained against (answers moved by ~1 logit)
        (
            {"init_lora_weights": "pissa"},
            "init_lora_weights='pissa' adapters change the base model's weights",
        ),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
        # PEFT 0.22's Astra and LoRA-GA rewrite the base weights too; they loaded and ran on the plain base
        ({"init_lora_weights": "astra"}, "init_lora_weights='astra' adapters change the base model's"),
        ({"init_lora_weights": "lora_ga"}, "init_lora_weights='lora_ga' adapters change the base model's"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
        ({"kasa_config": {"beta": 0.0001, "gamma": 0.001}}, "KaSA \\(kasa_config"),  # was refused by a tensor
    ],
)
def test_refused_by_name(adapter_sets, tmp_path, changes, message):
    base, folders = adapter_sets["llama"]
    bad = _edited(folders["qv"], tmp_path, "bad", **changes)
    with pytest.raises(ConfigError, match=message):
        Engine.from_pretrained(str(base), dtype="float64", device="cpu", lora={"bad": str(bad)})


def test_an_adapter_s_identity_at_load_is_the_job_s_digest_of_its_folder(tmp_path):
    """The engine digests the adapter files it reads as it reads them (``read_folder``); a job records and
    compares that, so it is the job layer's digest of the same files, a weights file past 16 MiB sampled as
    there (a job made before keeps its identity), and the other files of the folder count too."""
    import os

    from batchjob.engine.lora.peft_folder import read_folder
    from batchjob.job.lora import lora_identity

    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(os.urandom(17 << 20))
    (tmp_path / "README.md").write_text("card")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "training_args.bin").write_bytes(b"x" * 100)
    (tmp_path / ".hidden").write_text("not the adapter's")
    config, weights, identity = read_folder("a", tmp_path)
    assert config == b'{"r": 4}' and len(weights) == 17 << 20
    assert identity == lora_identity({"a": str(tmp_path)})["a"]


def test_the_base_model_is_known_by_its_hub_name_in_the_cache_and_through_a_link(tmp_path):
    from batchjob.engine.lora.peft_folder import check_base

    snapshot = tmp_path / "hub" / "models--org--Tiny-Llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    link = tmp_path / "mine"
    link.symlink_to(snapshot)
    config = {"base_model_name_or_path": "org/Tiny-Llama"}
    check_base("a", config, str(snapshot))  # the hub cache's own folder
    check_base("a", config, str(link))
    check_base("a", config, "org/Tiny-Llama")
    with pytest.raises(ConfigError, match="name the folder 'tiny-llama'"):  # a copy under another name
        check_base("a", config, str(tmp_path / "copy"))


def test_refused_targets_bases_and_settings(adapter_sets, tiny_model_dirs, tmp_path):
    base, folders = adapter_sets["llama"]
    head = make_adapter(base, tmp_path / "head", 9, r=2, target_modules=["lm_head"])
    with pytest.raises(ConfigError, match="output head"):
        Engine.from_pretrained(str(base), dtype="float64", device="cpu", lora={"head": str(head)})
    emb = make_adapter(base, tmp_path / "emb", 9, r=2, target_modules=["embed_tokens"])
    with pytest.raises(ConfigError, match="input embedding"):
        Engine.from_pretrained(str(base), dtype="float64", device="cpu", lora={"emb": str(emb)})
    other = make_model(tmp_path / "wide" / "llama", "llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ConfigError, match="made for another base model"):
        Engine.from_pretrained(str(other), dtype="float64", device="cpu", lora={"qv": str(folders["qv"])})
    with pytest.raises(ConfigError, match="which this model does not have"):  # embed loads the body alone
        Engine.from_pretrained(str(base), device="cpu", task="embed", lora={"qv": str(folders["qv"])})
    with pytest.raises(ConfigError, match="needs adapter_config.json"):
        Engine.from_pretrained(str(base), device="cpu", lora={"x": str(tmp_path)})
    engine = Engine.from_pretrained(str(base), dtype="float64", device="cpu", lora={"qv": str(folders["qv"])})
    with pytest.raises(ConfigError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("a", [5, 6], adapter="nope")


def test_choices_and_samples_run_under_their_adapter(adapter_sets, tmp_path):
    """Choice scores (their helper requests) and n samples run under the row's adapter: the same in a
    mixed batch as alone, as the adapter merged into the weights gives them, and not the base model's."""
    from transformers import AutoTokenizer

    base, folders = adapter_sets["llama"]
    merged = peft.PeftModel.from_pretrained(_hf(base), str(folders["all"])).merge_and_unload()
    merged.save_pretrained(str(tmp_path / "merged"))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(tmp_path / "merged"))
    engine = Engine.from_pretrained(
        str(base), dtype="float64", device="cpu", block_size=4, lora={"all": str(folders["all"])}
    )
    prompt = list(range(5, 30))
    choice = SamplingParams(max_new_tokens=4, temperature=0, choices=["ab", "cd e", "f"])
    mixed = engine.generate([prompt, prompt], choice, adapters=["all", None])
    alone = engine.generate([prompt], choice, adapters=["all"])[0]
    assert mixed[0].choice_logprobs == alone.choice_logprobs
    assert mixed[0].choice_logprobs != mixed[1].choice_logprobs
    reference = Engine.from_pretrained(str(tmp_path / "merged"), dtype="float64", device="cpu", block_size=4)
    want = reference.generate([prompt], choice)[0].choice_logprobs
    assert want is not None and mixed[0].choice_logprobs is not None
    for label, value in want.items():
        assert mixed[0].choice_logprobs[label] == pytest.approx(value, rel=1e-9, abs=1e-9)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=3)
    with_adapter = engine.generate([prompt], sampled, adapters=["all"])
    again = engine.generate([prompt, prompt], sampled, adapters=[None, "all"])[3:]
    assert [o.token_ids for o in with_adapter] == [o.token_ids for o in again]


def test_bf16_adapters_beside_the_cpu_bf16_kernel(adapter_sets):
    """bf16 on a CPU where the linears run on batchjob's bf16 kernel (cpu/linear.Blocks): a step under each
    adapter lands within bf16's rounding of PEFT's float32 logits, nearer them than to the base model's."""
    if not cpu_kernel.linear_takes() or cpu_linear.has_amx():
        pytest.skip("bf16 linears run on oneDNN here (no AVX512-BF16 in the kernel library, or AMX)")
    base, folders = adapter_sets["qwen2"]
    engine = Engine.from_pretrained(
        str(base), dtype="bfloat16", device="cpu", block_size=4, lora={k: str(v) for k, v in folders.items()}
    )
    attention = engine.model.get_submodule("model.layers.0.self_attn")
    assert isinstance(vars(attention.o_proj)["_batchjob_packed"], cpu_linear.Blocks)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (9, 4, 13)]
    names = ["qv", "all", "rs"]
    plain = _hf(base, torch.float32)
    for i, (p, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=1), adapter=name)
    reqs = list(engine.scheduler.waiting)
    for r in reqs:
        assert engine.block_manager.allocate(r, r.num_tokens)
    logits, _ = engine.runner.execute(SchedulerOutput(reqs, [r.num_tokens for r in reqs]))
    for row, (p, name) in enumerate(zip(prompts, names, strict=True)):
        model = peft.PeftModel.from_pretrained(_hf(base, torch.float32), str(folders[name])).eval()
        with torch.inference_mode():
            want, without = model(torch.tensor([p])).logits[0, -1], plain(torch.tensor([p])).logits[0, -1]
        err, gap = (logits[row].float() - want).abs().max(), (without - want).abs().max()
        assert err < 0.05 < gap / 4, (
            name,
            err,
            gap,
        )  # measured: 0.003-0.005 off, the adapters move 0.54-0.71


@pytest.mark.engine
def test_a_vision_language_models_adapter_is_refused_outside_its_language_model(tmp_path):
    """PEFT's usual q_proj/v_proj reach LLaVA's vision tower too; the tower runs inside a text step, so its
    update would follow the step's text rows (a base row beside an adapter row changed its answer): refused,
    naming the part; an adapter on the language model alone runs."""
    from transformers import AutoModelForImageTextToText

    from tests.vision_models import make_llava

    base = make_llava(tmp_path / "llava")
    for name, targets in (("both", ["q_proj", "v_proj"]), ("text", r".*language_model.*\.(q_proj|v_proj)")):
        torch.manual_seed(3)
        hf = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float64)
        config = peft.LoraConfig(init_lora_weights=False, r=2, target_modules=targets)
        peft.get_peft_model(hf, config).save_pretrained(str(tmp_path / name))
    with pytest.raises(ConfigError, match="targets 'model.vision_tower.*', in the vision_tower"):
        Engine.from_pretrained(
            str(base), dtype="float64", device="cpu", lora={"both": str(tmp_path / "both")}
        )
    engine = Engine.from_pretrained(
        str(base), dtype="float64", device="cpu", lora={"t": str(tmp_path / "text")}
    )
    assert engine.lora is not None
