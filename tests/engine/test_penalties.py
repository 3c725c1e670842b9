"""A model's generation config: its repetition penalty applied as transformers' generate applies it, the
processors batchjob does not build refused by name."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from batchjob.engine import Engine
from batchjob.engine.penalties import config_penalty
from batchjob.errors import ConfigError
from batchjob.sampling import SamplingParams
from tests.tiny_models import hf_greedy, random_prompts

NEW = 24


@pytest.fixture(scope="module")
def penalised(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation config asking for a repetition penalty of 1.3."""
    folder = tmp_path_factory.mktemp("penalised") / "m"
    shutil.copytree(tiny_model_dir, folder)
    config = (
        GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").exists() else None
    )
    config = config or GenerationConfig()
    config.repetition_penalty = 1.3
    config.save_pretrained(folder)
    return folder


def _hf(folder, prompt, penalty):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, repetition_penalty=penalty
    )
    return out[0, len(prompt) :].tolist()


def test_the_models_repetition_penalty_is_applied_as_generate_applies_it(penalised):
    hf = AutoModelForCausalLM.from_pretrained(penalised, dtype=torch.float64)
    prompts = random_prompts([5, 9, 13, 40], hf.config.vocab_size, seed=3)
    want = [_hf(penalised, p, 1.3) for p in prompts]
    plain = [hf_greedy(hf, p, NEW) for p in prompts]  # (hf_greedy passes no penalty: the model's applies)
    without = [_hf(penalised, p, 1.0) for p in prompts]
    assert want == plain and want != without  # the penalty changes these answers
    # chunked prefill, drafts asked for (off for penalised rows) and a small pool that preempts
    engine = Engine.from_pretrained(
        str(penalised), dtype="float64", max_num_batched_tokens=8, num_blocks=20, block_size=4
    )
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    assert [list(o.token_ids) for o in engine.generate(prompts, greedy)] == want
    assert engine.stats.preemptions > 0
    # a request's own value wins: 1 is none
    off = greedy.replace(repetition_penalty=1.0)
    assert [list(o.token_ids) for o in engine.generate(prompts, off)] == without
    # the log-probabilities reported are the model's own, whatever the penalty
    lp = engine.generate(prompts[:1], greedy.replace(logprobs=1, repetition_penalty=1.0))[0].logprobs
    lp_pen = engine.generate(prompts[:1], greedy.replace(logprobs=1))[0].logprobs
    assert lp[0] == lp_pen[0]


def test_generation_config_processors_not_built_are_refused(tiny_model_dir, tmp_path):
    refused = [("no_repeat_ngram_size", 3), ("suppress_tokens", [5]), ("min_new_tokens", 4), ("num_beams", 4)]
    for setting, value in [*refused, ("encoder_repetition_penalty", 1.3)]:
        folder = tmp_path / setting
        shutil.copytree(tiny_model_dir, folder)
        path = folder / "generation_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(config | {setting: value}))
        with pytest.raises(ConfigError, match=f"generation_config.json sets {setting} = "):
            Engine.from_pretrained(str(folder), dtype="float64")
        Engine.from_pretrained(str(folder), dtype="float64", task="embed")  # a task draws nothing: runs


def _with(tiny_model_dir, folder, file, setting, value):
    """A copy of the tiny model whose ``file`` (a JSON file of the folder) also sets ``setting``."""
    shutil.copytree(tiny_model_dir, folder)
    path = folder / file
    path.write_text(json.dumps((json.loads(path.read_text()) if path.exists() else {}) | {setting: value}))
    return folder


def test_validate_refuses_the_generation_config_the_load_refuses(tiny_model_dir, tmp_path):
    """validate said ok for a model whose generation_config.json sets no_repeat_ngram_size, and run refused
    it: both read the config by one rule, validate without the weights. Each names the file the setting is
    in: a folder without generation_config.json was told to edit that file, its setting in config.json."""
    from click.testing import CliRunner

    from batchjob.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    no_file = _with(tiny_model_dir, tmp_path / "no_file", "config.json", "no_repeat_ngram_size", 2)
    (no_file / "generation_config.json").unlink(missing_ok=True)  # transformers makes one of config.json
    own = "generation_config.json"
    cases = [
        ("no_repeat_ngram_size", 3, _with(tiny_model_dir, tmp_path / "a", own, "no_repeat_ngram_size", 3)),
        ("min_length", 9, _with(tiny_model_dir, tmp_path / "b", own, "min_length", 9)),
        ("no_repeat_ngram_size", 2, no_file),
    ]
    for setting, value, folder in cases:
        with pytest.raises(ConfigError) as loaded:
            Engine.from_pretrained(str(folder), dtype="float64")
        said = str(loaded.value)
        if folder == no_file:
            assert said.startswith("the model's config.json (it has no generation_config.json") and (
                f"sets {setting} = {value}" in said
                and said.endswith("remove the setting from its config.json")
            ), said
        else:
            assert said.startswith(f"the model's generation_config.json sets {setting} = {value}"), said
        args = ["validate", "--input", str(data), "--output", str(tmp_path / "o"), "--model", str(folder)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and str(loaded.value) in " ".join(result.output.split()), result.output
        embed = CliRunner().invoke(main, [*args, "--task", "embed"])  # a task draws nothing: no refusal
        assert "generation_config" not in embed.output, embed.output


def test_a_forced_bos_token_id_is_refused_at_load_and_by_validate(tiny_model_dir, tmp_path):
    """A generation_config.json setting forced_bos_token_id was run without a word: transformers' generate
    forces that token as the first answer token of a one-token prompt (a decoder-only model's too), and
    batchjob answered every such prompt otherwise."""
    from click.testing import CliRunner

    from batchjob.cli import main

    folder = _with(tiny_model_dir, tmp_path / "m", "generation_config.json", "forced_bos_token_id", 5)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    assert hf_greedy(hf, [7], 3)[0] == 5 and hf_greedy(plain, [7], 3)[0] != 5  # generate forces it
    assert hf_greedy(hf, [7, 8], 3) == hf_greedy(plain, [7, 8], 3)  # a longer prompt: not forced
    with pytest.raises(ConfigError, match="generation_config.json sets forced_bos_token_id = 5"):
        Engine.from_pretrained(str(folder), dtype="float64")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["validate", "--input", str(data), "--output", str(tmp_path / "o"), "--model", str(folder)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "sets forced_bos_token_id = 5" in result.output, result.output


def test_stop_strings_and_token_healing_are_refused_by_name(tiny_model_dir, tmp_path):
    """A generation_config.json's stop_strings were run without a word: generate, given the tokenizer (as a
    pipeline gives it), stops at the string, and batchjob wrote on past it. The refusal says how to go on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    prompt = random_prompts([9], plain.config.vocab_size, seed=5)[0]
    text = tokenizer.decode(hf_greedy(plain, prompt, NEW))
    stop = text.strip()[len(text.strip()) // 2]  # a character halfway through the answer
    folder = _with(tiny_model_dir, tmp_path / "s", "generation_config.json", "stop_strings", [stop])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, tokenizer=tokenizer)
    assert len(out[0]) - len(prompt) < NEW  # generate stops at the string
    with pytest.raises(ConfigError, match=re.escape(f"sets stop_strings = {[stop]!r}")) as refused:
        Engine.from_pretrained(str(folder), dtype="float64")
    assert "give each as --stop" in str(refused.value)
    healing = _with(tiny_model_dir, tmp_path / "h", "generation_config.json", "token_healing", True)
    with pytest.raises(ConfigError, match="generation_config.json sets token_healing = True"):
        Engine.from_pretrained(str(healing), dtype="float64")


def test_the_file_a_generation_config_is_read_from(tmp_path):
    """generation_config.json where the folder has one, else config.json (transformers makes it of that);
    not known for no model or a hub model not in the cache: the refusal then names neither alone."""
    from batchjob.models import generation_config_file

    (tmp_path / "config.json").write_text("{}")
    assert generation_config_file(str(tmp_path)) == "config.json"
    (tmp_path / "generation_config.json").write_text("{}")
    assert generation_config_file(str(tmp_path)) == "generation_config.json"
    assert generation_config_file("") is None
    assert generation_config_file("nobody-here/no-such-model-in-the-cache") is None
    with pytest.raises(ConfigError) as refused:
        config_penalty(GenerationConfig(no_repeat_ngram_size=2), "generate", None)
    said = str(refused.value)
    assert said.startswith("the model's generation config sets no_repeat_ngram_size = 2"), said
    assert said.endswith("from its generation_config.json (or config.json if it has none)"), said
