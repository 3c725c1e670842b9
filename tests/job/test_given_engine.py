"""``run_job(spec, engine=...)``: the job runs on an engine the caller built only where it is the engine the spec
asks for (the model by content, dtype, adapters, task and the engine options the job's identity records);
a spec without a model takes the engine's. Before, the engine's answers were written under the spec's
identity: another model's, float32 rows recorded as float64, 20 rows where the spec's context of 16 tokens
gives 7 error rows, and `batchjob run` with the spec's options then said "already complete"."""

from __future__ import annotations

import json
import shutil

import pyarrow.dataset as ds
import pytest

from batchjob import Engine
from batchjob.errors import ConfigError
from batchjob.job import make_spec, run_job
from tests.tiers import engine_fixture

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "in.jsonl"
    texts = ["The quick brown fox", "Paris is the capital of France. " * 3, "Batch inference"]
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


@engine_fixture(scope="module")
def llama(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), device="cpu")


def _spec(rows, out, **extra):
    base = dict(input=[str(rows)], output=str(out), prompt_column="text", id_column="id", chat=False)
    return make_spec(**(base | {"max_new_tokens": 4} | extra))


def _texts(out):
    table = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    return {r["id"]: (r["generated_text"], r["error"]) for r in table}


def test_the_spec_s_model_by_content_runs_on_the_engine(rows, tiny_model_dir, llama, tmp_path):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")  # the same model, elsewhere
    given = run_job(_spec(rows, tmp_path / "a", model=str(copy)), engine=llama)
    assert given.status == "complete" and given.errors == 0
    run_job(_spec(rows, tmp_path / "b", model=str(tiny_model_dir)))
    assert _texts(tmp_path / "a") == _texts(tmp_path / "b")


def test_another_model_is_refused_before_any_work(rows, tiny_model_dirs, llama, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ConfigError, match="another model than the spec's.*make_spec\\(model="):
        run_job(_spec(rows, out, model=str(tiny_model_dirs["qwen2"])), engine=llama)
    assert not (out / "_batchjob" / "job.json").exists()


def test_a_spec_without_a_model_records_the_engine_s(rows, tiny_model_dir, llama, tmp_path):
    out = tmp_path / "o"
    assert run_job(_spec(rows, out), engine=llama).status == "complete"
    # the job is the engine's model's: `batchjob run --model` with it finds it done (it was the default's)
    assert run_job(_spec(rows, out, model=str(tiny_model_dir))).status == "already complete"


def test_another_dtype_is_refused(rows, tiny_model_dir, llama, tmp_path):
    with pytest.raises(ConfigError, match="runs in float32, the spec's dtype is 'float64'"):
        run_job(_spec(rows, tmp_path / "a", model=str(tiny_model_dir), dtype="float64"), engine=llama)
    wide = Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float64")
    with pytest.raises(ConfigError, match="runs in float64, the spec's dtype is 'auto' \\(here float32\\)"):
        run_job(_spec(rows, tmp_path / "b", model=str(tiny_model_dir), device="cpu"), engine=wide)


def test_another_context_is_refused_and_the_model_s_own_spelled_out_is_not(
    rows, tiny_model_dir, llama, tmp_path
):
    with pytest.raises(ConfigError, match="sampling.max_model_len: the spec's 16, the engine's None"):
        run_job(_spec(rows, tmp_path / "a", model=str(tiny_model_dir), max_model_len=16), engine=llama)
    own = run_job(_spec(rows, tmp_path / "b", model=str(tiny_model_dir), max_model_len=1024), engine=llama)
    assert own.status == "complete"


def test_a_kv_pool_short_of_one_request_is_refused(rows, tiny_model_dir, tmp_path):
    small = Engine.from_pretrained(str(tiny_model_dir), device="cpu", num_blocks=4)  # 64 of 1024 tokens
    with pytest.raises(ConfigError, match="cannot hold one request of the full context"):
        run_job(_spec(rows, tmp_path / "o", model=str(tiny_model_dir)), engine=small)


@pytest.mark.engine
def test_another_task_or_task_option_is_refused(rows, tmp_path):
    from tests.task_models import make_embedder

    folder = make_embedder(tmp_path / "m", "bert", "cls")
    engine = Engine.from_pretrained(str(folder), device="cpu", task="embed", pooling="mean")
    with pytest.raises(ConfigError, match="task.pooling: the spec's None \\(the default: 'cls'"):
        run_job(
            _spec(rows, tmp_path / "a", model=str(folder), task="embed", max_new_tokens=None), engine=engine
        )
    spec = _spec(rows, tmp_path / "b", model=str(folder), task="embed", pooling="mean", max_new_tokens=None)
    assert run_job(spec, engine=engine).status == "complete"
    with pytest.raises(ConfigError, match="the engine computes task 'embed', the spec asks for 'generate'"):
        run_job(_spec(rows, tmp_path / "c", model=str(folder)), engine=engine)


def test_other_adapters_are_refused(rows, tiny_model_dir, llama, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = peft.LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(base, config).save_pretrained(str(tmp_path / "qv"))
    spec = _spec(rows, tmp_path / "a", model=str(tiny_model_dir), lora=[f"qv={tmp_path / 'qv'}"])
    with pytest.raises(ConfigError, match="LoRA adapters are not the spec's: 'qv' only in the spec"):
        run_job(spec, engine=llama)
    held = Engine.from_pretrained(str(tiny_model_dir), device="cpu", lora={"qv": str(tmp_path / "qv")})
    assert run_job(spec, engine=held).status == "complete"
    with pytest.raises(ConfigError, match="'qv' only in the engine"):
        run_job(_spec(rows, tmp_path / "b", model=str(tiny_model_dir)), engine=held)


def test_an_engine_that_does_not_name_its_model_is_refused(rows, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchjob.engine.config import EngineConfig

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    bare = Engine(hf, AutoTokenizer.from_pretrained(tiny_model_dir), EngineConfig(device="cpu"))
    with pytest.raises(ConfigError, match="does not say where its model came from"):
        run_job(_spec(rows, tmp_path / "o", model=str(tiny_model_dir)), engine=bare)


def test_a_busy_engine_is_refused_and_its_requests_kept(rows, tiny_model_dir, llama, tmp_path):
    from batchjob import SamplingParams

    llama.add_request("mine", llama.tokenize("Paris is"), SamplingParams(max_new_tokens=3, temperature=0))
    with pytest.raises(ConfigError, match="run_job needs an idle engine; it has 1 unfinished requests"):
        run_job(_spec(rows, tmp_path / "o", model=str(tiny_model_dir)), engine=llama)
    outs = []
    while llama.has_unfinished():
        outs += llama.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("mine", "length")]  # the caller's, unharmed


def test_an_adapter_folder_rewritten_after_the_engine_loaded_it_is_refused(rows, tiny_model_dir, tmp_path):
    """A training run saves its next checkpoint into the folder the engine loaded adapter 'a' from: the job was
    accepted and wrote rows computed with the old weights under the identity of the new files, and a
    `batchjob run --append` (a fresh engine: the new weights) was accepted too, one prompt with two answers
    under 'a'. The engine's adapter is known by the bytes it read: refused, naming it."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from batchjob.job.lora import lora_identity

    for seed, name in ((1, "one"), (2, "two")):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        config = peft.LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj", "v_proj"])
        peft.get_peft_model(base, config).save_pretrained(str(tmp_path / name))
    folder = shutil.copytree(tmp_path / "one", tmp_path / "a")
    held = Engine.from_pretrained(str(tiny_model_dir), device="cpu", lora={"a": str(folder)})
    assert held.lora is not None and held.lora.adapters[0].identity == lora_identity({"a": str(folder)})["a"]
    for file in ("adapter_config.json", "adapter_model.safetensors"):  # checkpoint 2, into the same folder
        shutil.copy(tmp_path / "two" / file, folder / file)
    spec = _spec(rows, tmp_path / "o", model=str(tiny_model_dir), lora=[f"a={folder}"])
    with pytest.raises(
        ConfigError, match="'a' is another adapter \\(other files\\) \\(the engine's as it loaded"
    ):
        run_job(spec, engine=held)
    assert not (tmp_path / "o" / "_batchjob" / "job.json").exists()
    # The folder as the engine read it is the spec's adapter again: the job runs.
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(tmp_path / "one" / file, folder / file)
    assert run_job(spec, engine=held).status == "complete"
