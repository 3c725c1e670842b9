"""Shard-only loading (engine/parallel/load.py): a tensor-parallel rank reads only its share of the checkpoint,
and what it builds is exactly what a full load + :func:`shard_model` keeps. In this process, one rank at a
time: the group is a stand-in holding the rank's number, device and a no-op all-reduce (the sums are
test_parallel.py's, with real rank processes)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import safetensors
import safetensors.torch
import torch

from batchjob.engine.config import EngineConfig
from batchjob.engine.parallel import load as load_module
from batchjob.engine.parallel import load_model
from batchjob.engine.parallel.shard import bytes_per_rank, shard_model
from batchjob.models import load_config, load_model_and_tokenizer
from tests.tiers import engine_fixture
from tests.tiny_models import make_model

pytestmark = pytest.mark.timeout(600)

N = 2
CONFIG = EngineConfig(device="cpu", dtype="float64")


@engine_fixture(scope="module")
def dirs(tiny_model_dirs, tmp_path_factory):
    """Tiny llama (untied head), qwen2 (tied head, q/k/v biases, 2 KV heads) and mixtral (fused experts)."""
    root = tmp_path_factory.mktemp("tp_load")
    return {
        "llama": tiny_model_dirs["llama"],
        "qwen2": make_model(root / "qwen2", "qwen2", num_key_value_heads=2, tie_word_embeddings=True),
        "mixtral": make_model(root / "mixtral", "mixtral"),
    }


def _group(rank: int) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, size=N, device=torch.device("cpu"), all_reduce=lambda t: None)


class _Slice:
    def __init__(self, part, key, reads):
        self._part, self._key, self._reads = part, key, reads

    def get_shape(self):
        return self._part.get_shape()

    def __getitem__(self, index):
        t = self._part[index]
        self._reads.append((self._key, tuple(t.shape), t.numel() * t.element_size()))
        return t


def _counting(monkeypatch) -> list[tuple[str, tuple[int, ...], int]]:
    """Make the loader's safe_open record (key, shape, bytes) of every tensor, or slice of one, it reads."""
    reads: list[tuple[str, tuple[int, ...], int]] = []

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self._f = safetensors.safe_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, key):
            t = self._f.get_tensor(key)
            reads.append((key, tuple(t.shape), t.numel() * t.element_size()))
            return t

        def get_slice(self, key):
            return _Slice(self._f.get_slice(key), key, reads)

    monkeypatch.setattr(load_module, "safe_open", CountingOpen)
    return reads


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rank", range(N))
def test_a_rank_reads_only_its_share(dirs, family, rank, monkeypatch):
    from transformers import AutoModelForCausalLM

    reads = _counting(monkeypatch)
    model, _, _ = load_model(str(dirs[family]), CONFIG, False, _group(rank))
    checkpoint = safetensors.torch.load_file(str(dirs[family] / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in checkpoint.values())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(checkpoint.values())).dtype)
    split, whole = bytes_per_rank(skeleton, N)  # (one rank's share of the split tensors, the whole ones)
    assert split > 0 and whole > 0
    got = sum(size for _, _, size in reads)
    # Neither family's rowwise layers have a bias, so every rank reads the same: its share of the split
    # tensors plus the whole ones. A full read would be N * split + whole.
    assert got == split + whole, f"rank {rank} read {got} bytes of a {total}-byte checkpoint"
    assert N * split + whole == total and got < total
    read_shapes = {key: shape for key, shape, _ in reads}
    assert set(read_shapes) == set(checkpoint)  # each tensor read once, whole or by its share
    q = "model.layers.0.self_attn.q_proj.weight"
    assert read_shapes[q] == (checkpoint[q].shape[0] // N, checkpoint[q].shape[1])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert read_shapes[o] == (checkpoint[o].shape[0], checkpoint[o].shape[1] // N)
    assert model._batchjob_tp_shard == (rank, N)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rank", range(N))
def test_the_shard_equals_full_load_and_slice(dirs, family, rank):
    shard, tokenizer, resolved = load_model(str(dirs[family]), CONFIG, False, _group(rank))
    full, _, _ = load_model_and_tokenizer(str(dirs[family]), torch.float64, "cpu")
    shard_model(full, rank, N, lambda t: None)
    assert resolved == str(dirs[family]) and tokenizer is not None
    got, want = (
        dict(shard.named_parameters(remove_duplicate=False)),
        dict(full.named_parameters(remove_duplicate=False)),
    )
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype == torch.float64, name
        assert torch.equal(got[name], want[name]), name
    got, want = dict(shard.named_buffers()), dict(full.named_buffers())
    assert got.keys() == want.keys() and want  # rotary inv_freq at least
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].device == want[name].device, name
        assert torch.equal(got[name], want[name]), name
    tied = full.config.tie_word_embeddings
    assert tied == (family == "qwen2")
    assert (shard.lm_head.weight is shard.model.embed_tokens.weight) == tied
    for (path, a), (_, b) in zip(shard.named_modules(), full.named_modules(), strict=True):
        if isinstance(b, torch.nn.Linear):
            assert (a.in_features, a.out_features) == (b.in_features, b.out_features), path
    assert shard.generation_config.eos_token_id == full.generation_config.eos_token_id
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(shard(ids).logits, full(ids).logits)


def test_checkpoints_that_need_conversion_fall_back_with_the_reason(dirs, tmp_path, monkeypatch):
    reads = _counting(monkeypatch)
    config, resolved = load_config(str(dirs["mixtral"]))
    model, why = load_module.load_shard(resolved, config, CONFIG, 0, N, torch.device("cpu"), lambda t: None)
    assert model is None and "experts" in why and "not the model's parameters" in why
    assert reads == []  # refused from the keys alone, before any tensor was read
    # ... and load_model still gives the rank its shard, by full load + slice.
    model, _, _ = load_model(str(dirs["mixtral"]), CONFIG, False, _group(1))
    assert model._batchjob_tp_shard == (1, N)

    bin_dir = tmp_path / "bin"
    shutil.copytree(dirs["llama"], bin_dir)
    weights = safetensors.torch.load_file(str(bin_dir / "model.safetensors"))
    (bin_dir / "model.safetensors").unlink()
    torch.save(weights, bin_dir / "pytorch_model.bin")
    config, resolved = load_config(str(bin_dir))
    model, why = load_module.load_shard(resolved, config, CONFIG, 0, N, torch.device("cpu"), lambda t: None)
    assert model is None and "not safetensors" in why
    model, _, _ = load_model(str(bin_dir), CONFIG, False, _group(0))
    assert model.model.layers[0].self_attn.q_proj.out_features == model.config.hidden_size // N


def test_validate_sizes_each_ranks_kv_pool_for_its_share_of_the_heads(dirs):
    """A rank caches 1/N of the KV heads, so the same memory holds N times the tokens: what the engine
    allocates is what ``validate`` says (it said the one-process figure)."""
    from batchjob.job.runner import check_engine
    from batchjob.job.spec import make_spec

    def line(tp: int) -> str:
        spec = make_spec(model=str(dirs["qwen2"]), device="cpu", kv_memory_gb=0.002, tensor_parallel_size=tp)
        return check_engine(spec)

    one, two = line(1), line(2)
    blocks = [int(text.split("KV pool ")[1].split(" blocks")[0]) for text in (one, two)]
    assert blocks[1] == 2 * blocks[0] and "on each of 2 ranks" in two and "ranks" not in one, (one, two)


def test_a_shard_takes_the_generation_config_of_config_json_as_a_full_load_does(dirs, tmp_path):
    """A folder without generation_config.json: from_pretrained makes the generation config of config.json
    (its repetition_penalty 1.3 applies, its no_repeat_ngram_size is refused); a tensor-parallel shard kept
    the blank one its class builds, so its ranks ran without the penalty, and without the refusal."""
    import json

    folder = tmp_path / "m"
    shutil.copytree(dirs["llama"], folder)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"repetition_penalty": 1.3}))
    shard, _, _ = load_model(str(folder), CONFIG, False, _group(0))
    full, _, _ = load_model_and_tokenizer(str(folder), torch.float64, "cpu")
    assert full.generation_config.repetition_penalty == 1.3
    assert shard.generation_config.to_dict() == full.generation_config.to_dict()
