"""The engine against Hugging Face: packed logits, greedy token-for-token equality, seeded sampling."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.errors import ConfigError
from tests.tiny_models import hf_greedy, make_model

pytestmark = pytest.mark.timeout(300)

FAMILIES = ["llama", "qwen2", "gpt2"]


def _hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def _prompts(rng: random.Random, lengths, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_unpacked(tiny_model_dirs, family):
    """One packed forward of several requests' chunks gives each request the logits it gets alone."""
    folder = tiny_model_dirs[family]
    engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu", block_size=4)
    hf = _hf(folder)
    rng = random.Random(1)
    prompts = _prompts(rng, [9, 1, 23, 5], engine.vocab_size)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=4, temperature=0))
    # First a partial chunk of request 2, so its second chunk attends to cached keys.
    reqs = list(engine.scheduler.waiting)
    assert engine.block_manager.allocate(reqs[2], 10)
    engine.runner.execute(SchedulerOutput([reqs[2]], [10]))
    reqs[2].num_computed_tokens = 10
    for r in reqs:
        assert engine.block_manager.allocate(r, r.num_tokens)
    counts = [r.num_tokens - r.num_computed_tokens for r in reqs]
    input_ids, position_ids, meta, sample_rows = engine.runner._prepare(SchedulerOutput(reqs, counts))
    with torch.inference_mode():
        packed = engine.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, batchjob_meta=meta
        ).logits[0]
        offset = 0
        for r, n in zip(reqs, counts, strict=True):
            alone = hf(torch.tensor([r.token_ids])).logits[0, -n:]
            torch.testing.assert_close(packed[offset : offset + n], alone, rtol=1e-9, atol=1e-9)
            offset += n
    assert offset == packed.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("block_size", "budget"), [(4, 7), (16, 64), (16, 512)])
def test_greedy_equals_hf_generate(tiny_model_dirs, family, block_size, budget, decode_path):
    folder = tiny_model_dirs[family]
    engine = Engine.from_pretrained(
        str(folder),
        dtype="float64",
        device="cpu",
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=5,
    )
    assert (engine.runner.attention.name == "cpu_kernel") == (decode_path == "kernel")
    hf = _hf(folder)
    rng = random.Random(block_size * 1000 + budget)
    prompts = _prompts(rng, [1, 2, 7, 16, 17, 33, 120, 300], engine.vocab_size)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for p, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == hf_greedy(hf, p, 12, ignore_eos=True), f"prompt of {len(p)} tokens"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sliding_window_equals_hf_generate(tmp_path, decode_path):
    """Mistral with a 6-token window: prompts and chunks much longer than the window."""
    folder = make_model(tmp_path / "mistral", "mistral")
    engine = Engine.from_pretrained(
        str(folder), dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=9, max_num_seqs=3
    )
    assert (engine.runner.attention.name == "cpu_kernel") == (decode_path == "kernel")
    hf = _hf(folder)
    prompts = _prompts(random.Random(8), [2, 5, 19, 44], engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, p, 10, ignore_eos=True)


def test_greedy_stops_at_eos_like_hf(tiny_model_dir):
    """With EOS active, each request stops where HF generate stops (EOS token included)."""
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu", block_size=4)
    hf = _hf(tiny_model_dir)
    rng = random.Random(7)
    prompts = _prompts(rng, [3, 8, 15, 40, 64, 100], engine.vocab_size)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    # A random model rarely says its real EOS; declare as EOS a token that some answers produce.
    counts: dict[int, int] = {}
    for out in free:
        for t in set(out.token_ids[1:]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (0 < counts[t] < len(prompts), counts[t]))
    engine.eos_token_ids = {eos}
    hf.generation_config.eos_token_id = eos
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0))
    reasons = set()
    for p, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf, p, 30, ignore_eos=False)
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] == eos else "length")
        reasons.add(out.finish_reason)
    assert reasons == {"stop", "length"}


def test_the_eos_ids_fall_back_past_a_generation_config_that_names_none(tiny_model_dir, tmp_path):
    """The EOS ids are the generation config's; where it names none, config.json's, else the tokenizer's.
    transformers' generate stops on the generation config's alone (none: it never stops); batchjob falls back,
    as its docstring and docs/jobs.md now say (they said it was what generate stops on)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    tokenizer_eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    cases = [  # (generation_config.json's eos, or "no file"; config.json's) -> the ids the engine stops on
        ((None, 7), {7}),
        ((None, None), {tokenizer_eos}),
        (([5, 6], 7), {5, 6}),
        (("no file", 7), {7}),
    ]
    for i, ((own, config), want) in enumerate(cases):
        folder = tmp_path / str(i)
        shutil.copytree(tiny_model_dir, folder)
        for name, eos in (("generation_config.json", own), ("config.json", config)):
            path = folder / name
            if eos == "no file":
                path.unlink()
                continue
            values = json.loads(path.read_text()) if path.exists() else {}
            values.pop("eos_token_id", None)
            path.write_text(json.dumps(values | ({} if eos is None else {"eos_token_id": eos})))
        engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
        assert engine.eos_token_ids == want, (own, config)
        generate_stops_on = _hf(folder).generation_config.eos_token_id
        assert (generate_stops_on is None) == (own is None), (own, config)  # generate: its config's alone


def test_preemption_keeps_outputs_exact(tiny_model_dir):
    """A KV pool far too small forces preemptions; outputs stay equal to HF generate."""
    engine = Engine.from_pretrained(
        str(tiny_model_dir),
        dtype="float64",
        device="cpu",
        block_size=4,
        num_blocks=24,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    hf = _hf(tiny_model_dir)
    rng = random.Random(3)
    prompts = _prompts(rng, [20, 30, 25, 12, 40, 18], engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    assert engine.stats.preemptions > 0
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, p, 20, ignore_eos=True)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(c == 0 for c in engine.block_manager.ref_counts)


@pytest.mark.parametrize(
    ("num_blocks", "prompt", "new"),
    [(1, 16, 1), (2, 16, 17), (2, 17, 16), (2, 15, 18)],  # prompt + new = k blocks' worth of tokens and one
)
def test_a_pool_of_exactly_the_blocks_a_request_computes_runs_it(tiny_model_dir, num_blocks, prompt, new):
    """A request's last token is sampled, never computed: prompt + max_new_tokens - 1 tokens of KV. A pool of
    exactly those blocks runs it without preemption, to HF generate's tokens (the admission check counted
    the last token too: a prompt of 16 tokens and 17 new was refused, needing 3 blocks of 16, in a pool of
    2); one token more needs a block more, and is refused."""
    engine = Engine.from_pretrained(
        str(tiny_model_dir), dtype="float64", device="cpu", block_size=16, num_blocks=num_blocks
    )
    ids = _prompts(random.Random(9), [prompt], engine.vocab_size)[0]
    out = engine.generate([ids], SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))[0]
    assert out.error is None
    assert out.token_ids == hf_greedy(_hf(tiny_model_dir), ids, new)
    assert engine.stats.preemptions == 0 and engine.block_manager.peak_used == num_blocks
    more = engine.generate([ids], SamplingParams(max_new_tokens=new + 1, temperature=0, ignore_eos=True))[0]
    want = f"needs {num_blocks + 1} KV blocks of 16 tokens for the {prompt + new} tokens it computes"
    assert more.error is not None and want in more.error


@pytest.mark.parametrize("num_blocks", [None, 40])
def test_shared_prefix_is_computed_once_and_outputs_are_exact(tiny_model_dir, num_blocks):
    rng = random.Random(11)
    hf = _hf(tiny_model_dir)
    results = {}
    for caching in (True, False):
        engine = Engine.from_pretrained(
            str(tiny_model_dir),
            dtype="float64",
            device="cpu",
            block_size=4,
            num_blocks=num_blocks,
            max_num_batched_tokens=48,
            max_num_seqs=4,
            enable_prefix_caching=caching,
        )
        if caching:
            instruction = _prompts(rng, [61], engine.vocab_size)[0]
            prompts = [instruction + p for p in _prompts(rng, [3, 9, 1, 14, 6, 20], engine.vocab_size)]
            prompts.append(instruction[:30])
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
        results[caching] = ([o.token_ids for o in outs], engine.stats)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert all(c == 0 for c in engine.block_manager.ref_counts)
    (cached_out, on), (plain_out, off) = results[True], results[False]
    assert cached_out == plain_out
    for p, toks in zip(prompts, cached_out, strict=True):
        assert toks == hf_greedy(hf, p, 10, ignore_eos=True)
    assert off.cached_prompt_tokens == 0
    assert on.cached_prompt_tokens >= 4 * 60  # later rows found the instruction's 15 full blocks
    assert on.computed_prompt_tokens + on.cached_prompt_tokens >= on.prompt_tokens
    assert on.computed_prompt_tokens < off.computed_prompt_tokens - 200
    if num_blocks is not None:
        assert on.preemptions > 0 or off.preemptions > 0


def test_reset_prefix_cache_makes_a_second_run_compute_its_prompts(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu", block_size=4)
    prompts = _prompts(random.Random(5), [23, 17, 30], engine.vocab_size)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    runs = []
    for reset in (False, False, True):
        if reset:
            engine.reset_prefix_cache()
        computed, cached = engine.stats.computed_prompt_tokens, engine.stats.cached_prompt_tokens
        outs = engine.generate(prompts, params)
        tokens = [o.token_ids for o in outs]
        runs.append(
            (
                engine.stats.computed_prompt_tokens - computed,
                engine.stats.cached_prompt_tokens - cached,
                tokens,
            )
        )
    (first, _, out1), (again, hits, out2), (after_reset, no_hits, out3) = runs
    assert first == 70 and again < 15 and hits >= 56  # the repeat found the prompts' full blocks
    assert after_reset == 70 and no_hits == 0
    assert out1 == out2 == out3
    engine.add_request("busy", prompts[0], params)
    with pytest.raises(ConfigError, match="idle engine"):
        engine.reset_prefix_cache()


def test_static_batching_gives_the_same_outputs(tiny_model_dir):
    prompts = _prompts(random.Random(4), [5, 40, 9, 22, 3], 400)
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (3, 12, 7, 1, 9)]
    outs, steps = {}, {}
    for static in (False, True):
        engine = Engine.from_pretrained(
            str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=2, static_batching=static
        )
        outs[static] = [o.token_ids for o in engine.generate(prompts, params)]
        steps[static] = engine.stats.steps
    assert outs[True] == outs[False]
    assert steps[True] > steps[False]  # the static batch waits for its longest request


def test_seeded_sampling_same_alone_and_in_a_crowd(tiny_model_dir):
    engine = Engine.from_pretrained(
        str(tiny_model_dir), device="cpu", block_size=4, max_num_batched_tokens=16
    )
    rng = random.Random(5)
    target = _prompts(rng, [11], engine.vocab_size)[0]
    crowd = _prompts(rng, [5, 30, 2, 17], engine.vocab_size)
    params = SamplingParams(
        max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=1234, ignore_eos=True
    )
    alone = engine.generate([target], params)[0].token_ids
    mixed = engine.generate(crowd[:2] + [target] + crowd[2:], params)[2].token_ids
    assert alone == mixed
    other_seed = engine.generate([target], params.replace(seed=99))[0].token_ids
    assert other_seed != alone  # the seed matters
    unseeded = {tuple(engine.generate([target], params.replace(seed=None))[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1  # no seed: fresh randomness


def test_finish_reasons_and_stops(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu")
    prompt = _prompts(random.Random(2), [10], engine.vocab_size)[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    # stop_token_ids: stop at the 5th generated token
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = engine.generate(
        [prompt], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # stop strings: the text is cut before the stop string
    text = free.text
    # three characters from the middle on, none of them U+FFFD (a byte of a character left unfinished, which
    # a stop string may not hold: SamplingParams refuses it)
    starts = range(len(text) // 2, len(text) - 2)
    stop = next(
        text[i : i + 3] for i in starts if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip()
    )
    out = engine.generate(
        [prompt], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    # a stop string holding a special token (left out of the text) could never be found: that row's error
    end = engine.tokenizer.eos_token
    params = SamplingParams(max_new_tokens=4, temperature=0, stop=[f"x{end}"])
    refused = engine.generate([prompt], params)[0]
    assert refused.finish_reason == "error" and f"holds the special token {end!r}" in refused.error


def test_bad_requests_fail_alone(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", block_size=4, num_blocks=16)
    good = [5, 6, 7]
    outs = engine.generate(
        [good, [], [5] * 2000, [engine.vocab_size + 5], [5] * 70, good],
        SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
    )
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length"]
    assert "empty" in outs[1].error
    assert "context" in outs[2].error
    assert "vocabulary" in outs[3].error
    assert "KV blocks" in outs[4].error
    assert outs[0].token_ids == outs[5].token_ids


def test_resume_from_output_ids_is_exact(tiny_model_dir):
    """A request re-added with the tokens it had generated ends as an uninterrupted one does."""
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", block_size=4)
    prompt = _prompts(random.Random(9), [13], engine.vocab_size)[0]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    engine.add_request("row-1", prompt, params)
    while engine.has_unfinished():
        done = engine.step()
    full = done[0].token_ids
    engine.add_request("row-1", prompt, params)
    for _ in range(8):
        engine.step()
    (state,) = engine.snapshot()
    partial = state.output_ids
    assert 0 < len(partial) < 20 and full[: len(partial)] == partial
    engine.abort("row-1")
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.add_request("row-1", state.prompt_ids, state.params, output_ids=partial)
    while engine.has_unfinished():
        done = engine.step()
    assert done[0].token_ids == full


@pytest.mark.engine  # the default model, loaded from its cache
def test_default_model_knows_paris():
    engine = Engine.from_pretrained(device="cpu")
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    # chat() renders the question as batchjob run does: the README's example
    chat = engine.chat(["What is the capital of France?"], SamplingParams(max_new_tokens=24, temperature=0))[0]
    assert chat.token_ids == out.token_ids


def test_chat_is_generate_over_the_chat_template(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu")
    tok, params = engine.tokenizer, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    conversations = ["hello there", [{"role": "user", "content": "a b c"}]]
    want = []
    for messages in ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want.append(tok(text, add_special_tokens=False).input_ids)
    got = engine.chat(conversations, params, system="be brief")
    assert [o.token_ids for o in got] == [o.token_ids for o in engine.generate(want, params)]
    assert [o.prompt_ids for o in got] == want


def test_prompts_the_engine_cannot_take_as_given_are_refused_before_any_is_added(tiny_model_dir):
    """A float token id was truncated (``int(1.5)``: a silent other prompt); a conversation that is None,
    or text holding half a UTF-16 pair, raised the tokenizer's TypeError. Each is refused by name, before any
    prompt of the batch is added, so the engine stays idle; numpy and torch integers are token ids."""
    import numpy as np

    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu")
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    refused = {
        "prompt 1: token 0 is 1.5 (float), not an integer token id": lambda: engine.generate(
            [[1, 2], [1.5, 2]], params
        ),
        "prompt 0: token 1 is '2' (str)": lambda: engine.generate([[1, "2"]], params),
        "prompt 0: token 0 is True (bool)": lambda: engine.generate([[True, 3]], params),  # ran as 1
        "prompt 1 is bytes: give a text": lambda: engine.generate([[1], b"hi"], params),  # ran as [104, 105]
        "prompt 0: token 0 is tensor(1.5000) (Tensor)": lambda: engine.generate([torch.tensor([1.5])], params),
        "prompt 1: character 1 (\\udcff) is half a UTF-16 pair": lambda: engine.generate(
            ["fine", "a\udcffb"], params
        ),
        "conversation 1 is NoneType: give a string": lambda: engine.chat(["ok", None], params),
        "conversation 0, message 1: character 0 (\\ud800)": lambda: engine.chat(
            [[{"role": "system", "content": "s"}, {"role": "user", "content": "\ud800"}]], params
        ),
        "request 'r''s prompt: token 0 is 2.0 (float)": lambda: engine.add_request("r", [2.0], params),
    }
    for message, call in refused.items():
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value), str(e.value)
        assert not engine.has_unfinished()
    want = engine.generate([[1, 2, 3]], params)[0].token_ids
    assert engine.generate([np.array([1, 2, 3]), torch.tensor([1, 2, 3])], params)[1].token_ids == want


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return LlamaConfig(**{**base, "num_key_value_heads": 2, "max_position_embeddings": 256, **kw})


def test_the_plan_is_one_copy_of_the_load_time_checks():
    """plan.py, from a config alone (what ``validate`` sees): the context, the KV pool per rank, when the pool
    is checked (asked for, or by default when the engine sizes it), and the check's message."""
    from batchjob.engine.config import EngineConfig
    from batchjob.engine.plan import plan_kv, plan_model

    model_config = _llama_config()
    config = EngineConfig(device="cpu", block_size=4, kv_memory_gb=0.001)
    plan = plan_model(model_config, config)
    assert plan.max_model_len == 256 and not plan.encoder
    one, two = plan_kv(model_config, config, 256), plan_kv(model_config, config, 256, ranks=2)
    assert two.shape.num_kv_heads == 1 and one.num_blocks is not None and one.check
    assert two.num_blocks >= 2 * one.num_blocks  # a rank's block holds half the heads: twice the blocks
    given = EngineConfig(device="cpu", block_size=4, num_blocks=3)
    assert not plan_kv(model_config, given, 256).check  # an explicit pool is the user's: not checked
    asked = EngineConfig(device="cpu", block_size=4, num_blocks=3, check_kv_pool=True)
    kv = plan_kv(model_config, asked, 256)
    with pytest.raises(ConfigError, match="cannot hold one request of the full context"):
        kv.check_pool(asked, kv.num_blocks)
    with pytest.raises(ConfigError, match="exceeds the model's context of 256"):
        plan_model(model_config, EngineConfig(device="cpu", max_model_len=300))
