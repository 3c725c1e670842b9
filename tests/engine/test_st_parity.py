"""Embeddings equal the installed sentence-transformers' ``encode`` for every folder shape it saves or loads:
6.x folders (``modality_config``: with a chat template each text is rendered as a chat message, the prompt
as a system message), 5.x folders (no ``modality_config``: the text alone, even with a chat template), each
pooling, prompts (``default_prompt_name``, ``prompt_name``, none), ``include_prompt`` off, and cut texts
(a chat render's tail written back). float64, to 1e-12. What batchjob can't follow is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.errors import ConfigError
from tests.task_models import MAX_LEN, make_embedder
from tests.tiers import engine_fixture

pytestmark = pytest.mark.timeout(600)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "0 1 2",
    "!",
    "Batch inference over a large dataset of prompts writes answers to Parquet files.",
]
PROMPTS = {"query": "Query: ", "doc": "Represent this document for retrieval: "}

# (name, family, pooling, chat template, include_prompt)
FOLDERS = [
    ("bert-mean", "bert", "mean", False, True),
    ("bert-mean-chat", "bert", "mean", True, True),
    ("bert-cls-noprompt", "bert", "cls", False, False),
    ("bert-mean-noprompt", "bert", "mean", False, False),
    ("distilbert-mean", "distilbert", "mean", False, True),  # its attention numbered by batchjob
    ("qwen3-last", "qwen3", "lasttoken", False, True),
    ("qwen3-last-chat", "qwen3", "lasttoken", True, True),
    ("qwen3-mean-chat-noprompt", "qwen3", "mean", True, False),  # encode keeps a chat render's prompt
]


def _as_saved_by_5x(folder):
    """The folder as sentence-transformers 5 saved it: no modality_config, a flag per pooling mode."""
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    assert "modality_config" in config  # 6.x wrote it
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_LEN, "do_lower_case": False})
    )
    pooling = json.loads((folder / "1_Pooling/config.json").read_text())
    flags = {
        f"pooling_mode_{m}": pooling["pooling_mode"] == k
        for k, m in [("cls", "cls_token"), ("mean", "mean_tokens"), ("lasttoken", "lasttoken")]
    }
    flags |= {"pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    (folder / "1_Pooling/config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": pooling["embedding_dimension"],
                **flags,
                "include_prompt": pooling["include_prompt"],
            }
        )
    )
    return folder


@engine_fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    out = {}
    for name, family, pooling, chat, include in FOLDERS:
        out[name] = make_embedder(
            root / name,
            family,
            pooling,
            chat=chat,
            include_prompt=include,
            prompts=PROMPTS,
            default_prompt_name="query",
        )
    out["qwen3-last-chat-5x"] = _as_saved_by_5x(
        make_embedder(
            root / "5x", "qwen3", "lasttoken", chat=True, prompts=PROMPTS, default_prompt_name="query"
        )
    )
    out["bert-mean-noprompt-5x"] = _as_saved_by_5x(
        make_embedder(
            root / "5x-mean",
            "bert",
            "mean",
            include_prompt=False,
            prompts=PROMPTS,
            default_prompt_name="query",
        )
    )
    return out


def _st(folder):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return st.to(torch.float64)


def _encode(st, texts, prompt_name):
    kw = {"prompt": ""} if prompt_name == "" else {} if prompt_name is None else {"prompt_name": prompt_name}
    return st.encode(texts, convert_to_numpy=True, **kw)


@pytest.mark.parametrize("name", [f[0] for f in FOLDERS] + ["qwen3-last-chat-5x", "bert-mean-noprompt-5x"])
def test_embed_equals_encode_with_each_prompt(folders, name):
    st = _st(folders[name])
    chat = "message" in json.loads((folders[name] / "sentence_bert_config.json").read_text()).get(
        "modality_config", {}
    )
    assert chat == ("chat" in name and "5x" not in name)  # 5.x folders take the text alone
    for prompt_name in (None, "doc", "", "document"):
        ref = _encode(st, TEXTS, prompt_name)
        eng = Engine.from_pretrained(
            str(folders[name]), task="embed", device="cpu", dtype="float64", prompt_name=prompt_name
        )
        outs = eng.embed(TEXTS)
        # "!" after a prompt tokenizes into the prompt's last token: with include_prompt off nothing of
        # the text is left to pool (encode pools nothing: a zero vector), and batchjob says so instead
        empty = "noprompt" in name and "chat" not in name and prompt_name not in ("", "document")
        errors = [o.error for o in outs]
        assert errors == [None] * len(TEXTS) if not empty else errors[3].startswith("nothing to pool")
        ok = [i for i, o in enumerate(outs) if o.error is None]
        err = float(np.abs(np.stack([outs[i].embedding for i in ok]) - ref[ok]).max())
        print(f"{name} prompt_name={prompt_name!r}: max |ours - encode| = {err:.3g}")
        assert err <= 1e-12


def test_a_chat_render_cut_ends_with_the_template_tail_as_encode_writes_it(folders):
    folder = folders["qwen3-last-chat"]
    long = ["word " * 200, "Paris is the capital of France. " * 30, "short"]
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64", truncate=True)
    ids = eng.tokenize(long[0])
    tail = eng.tokenize("x")[-2:]  # "<|im_end|>\n"
    assert len(ids) == MAX_LEN and ids[-2:] == tail
    got = np.stack([o.embedding for o in eng.embed(long)])
    assert float(np.abs(got - _encode(_st(folder), long, None)).max()) <= 1e-12
    # without truncate such a text is an error row, as any text over the limit
    plain = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64")
    assert "longer than the model's limit" in plain.embed(long[:1])[0].error


def test_what_batchjob_cannot_follow_is_refused_by_name(folders, tmp_path):
    import shutil

    base = folders["bert-mean-chat"]
    with pytest.raises(ConfigError, match="prompt name 'passage' is not one of the model's prompts"):
        Engine.from_pretrained(str(base), task="embed", device="cpu", prompt_name="passage")
    edits = {
        "do_lower_case": (lambda c: c | {"do_lower_case": True}, "sets do_lower_case"),
        "processing_kwargs": (
            lambda c: c | {"processing_kwargs": {"text": {"padding": "max_length"}}},
            "processing_kwargs \\(text\\)",
        ),
        "format": (
            lambda c: (
                c
                | {
                    "modality_config": {
                        "message": {"method": "forward", "method_output_name": "last_hidden_state"}
                    }
                }
            ),
            "format 'auto'",
        ),
        "task": (lambda c: c | {"transformer_task": "fill-mask"}, "transformer_task 'fill-mask'"),
        # what sentence-transformers loads the model's config and tokenizer with (a hub key, which it
        # replaces with its own, is no refusal)
        "config_kwargs": (
            lambda c: c | {"config_kwargs": {"layer_norm_eps": 0.5, "revision": "main"}},
            "sets config_kwargs \\(layer_norm_eps\\), which sentence-transformers applies to the model's",
        ),
        "config_args": (
            lambda c: c | {"config_args": {"hidden_act": "relu"}},
            "sets config_args \\(hidden_act\\)",
        ),
        "tokenizer_args": (
            lambda c: c | {"tokenizer_args": {"add_prefix_space": True, "model_max_length": 8}},
            "sets tokenizer_args \\(add_prefix_space\\), which sentence-transformers passes to the tokenizer",
        ),
    }
    for key, (edit, message) in edits.items():
        folder = tmp_path / key
        shutil.copytree(base, folder)
        config = json.loads((folder / "sentence_bert_config.json").read_text())
        (folder / "sentence_bert_config.json").write_text(json.dumps(edit(config)))
        with pytest.raises(ConfigError, match=message):
            Engine.from_pretrained(str(folder), task="embed", device="cpu")


@pytest.mark.parametrize("name", ["bert-mean-noprompt", "qwen3-last-chat"])
def test_embed_takes_a_prompt_name_per_call(folders, name):
    st = _st(folders[name])
    eng = Engine.from_pretrained(str(folders[name]), task="embed", device="cpu", dtype="float64")
    texts = TEXTS[:3]
    for prompt_name in ("doc", "", None):  # None: the engine's own again (the folder's default, query)
        got = np.stack([o.embedding for o in eng.embed(texts, prompt_name=prompt_name)])
        assert float(np.abs(got - _encode(st, texts, prompt_name)).max()) <= 1e-12


def test_a_hub_models_files_are_asked_of_the_hub_when_not_cached(tmp_path, monkeypatch):
    """transformers fetches a model's own files, not modules.json and the rest: taken for absent, a hub
    model's pooling and prompts would be silently left out."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    from batchjob.engine.tasks.st_folder import st_file

    saved = tmp_path / "modules.json"
    saved.write_text('[{"type": "Pooling", "path": "1_Pooling"}]')
    answers = {"cached": str(saved), "unknown": None}
    monkeypatch.setattr(
        huggingface_hub, "try_to_load_from_cache", lambda repo, name: answers[repo.split("/")[1]]
    )
    asked = []

    def download(repo, name):
        asked.append((repo, name))
        if repo == "org/unknown" and name == "modules.json":
            return str(saved)
        if name == "offline.json":
            raise LocalEntryNotFoundError("offline mode is on")
        missing = RemoteEntryNotFoundError.__new__(
            RemoteEntryNotFoundError
        )  # (its __init__ wants a response)
        Exception.__init__(missing, "404: no such file")
        raise missing

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert st_file("org/cached", "modules.json") == [{"type": "Pooling", "path": "1_Pooling"}] and not asked
    assert st_file("org/unknown", "modules.json")[0]["type"] == "Pooling"
    assert st_file("org/unknown", "sentence_bert_config.json") is None  # the hub has none
    with pytest.raises(ConfigError, match="cannot tell whether model 'org/unknown' has .* offline.json"):
        st_file("org/unknown", "offline.json")
    assert st_file(str(tmp_path), "absent.json") is None  # a local folder: absent is absent


def test_a_folders_limit_and_truncation_side_are_encodes(folders, tmp_path):
    """A 5.x folder's max_seq_length past the tokenizer's own limit is the limit (encode takes it over the
    tokenizer's); a chat folder whose tokenizer truncates on the left loses the render's start, as encode."""
    import shutil

    longer = tmp_path / "longer"
    shutil.copytree(folders["bert-mean-noprompt-5x"], longer)
    (longer / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LEN + 24}))
    left = tmp_path / "left"
    shutil.copytree(folders["qwen3-last-chat"], left)
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps(config | {"truncation_side": "left"}))
    texts = ["word " * (MAX_LEN + 14), "word " * 300, "short"]
    for folder, limit in ((longer, MAX_LEN + 24), (left, MAX_LEN)):
        eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64", truncate=True)
        assert eng.prefill_limit == limit
        got = np.stack([o.embedding for o in eng.embed(texts)])
        assert float(np.abs(got - _encode(_st(folder), texts, None)).max()) <= 1e-12, folder.name


@pytest.mark.parametrize(
    ("name", "config", "limit"),
    [
        # 5.x names: the tokenizer's model_max_length replaces max_seq_length, as sentence-transformers 6
        # takes it
        (
            "bert-mean-noprompt-5x",
            {"max_seq_length": MAX_LEN, "tokenizer_args": {"model_max_length": 12}},
            12,
        ),
        ("bert-mean-noprompt-5x", {"max_seq_length": 12, "tokenizer_args": {"truncation_side": "left"}}, 12),
        ("bert-mean", {"processor_kwargs": {"model_max_length": 12, "truncation_side": "left"}}, 12),  # 6.x
    ],
)
def test_a_folders_tokenizer_arguments_are_encodes(folders, tmp_path, name, config, limit):
    """sentence_bert_config.json's tokenizer arguments (tokenizer_args, 6.x processor_kwargs) set the limit
    and the side a text is cut on, as encode cuts it (batchjob read neither: a text embedded whole past
    the folder's limit of 12 tokens, 0.12 away from encode's)."""
    import shutil

    folder = tmp_path / "f"
    shutil.copytree(folders[name], folder)
    saved = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps(saved | config))
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "short"]
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64", truncate=True)
    assert eng.prefill_limit == limit
    got = np.stack([o.embedding for o in eng.embed(texts)])
    assert float(np.abs(got - _encode(_st(folder), texts, None)).max()) <= 1e-12


def test_a_folders_model_arguments_are_encodes_or_refused(folders, tmp_path):
    """sentence_bert_config.json's model arguments (model_kwargs, 5.x model_args), which
    sentence-transformers loads the model with: its dtype is the one encode computes in, so an engine in
    another is refused by name (batchjob read none of them: a folder loading in bfloat16 embedded in
    float32, 0.0028 away from encode's); in its dtype, with a key that changes only speed, it is encode's."""
    import shutil

    cases = {
        "f64": ({"model_kwargs": {"torch_dtype": "float64", "attn_implementation": "eager"}}, None),
        "auto": ({"model_args": {"dtype": "auto", "revision": "main"}}, None),  # as without them
        "bf16": (
            {"model_args": {"torch_dtype": "bfloat16"}},
            "model_args loads the model in bfloat16 .* this engine computes in float32; give --dtype bfloat16",
        ),
        "dtype-wins": (  # transformers takes dtype over torch_dtype
            {"model_kwargs": {"torch_dtype": "float32", "dtype": "half"}},
            "model_kwargs loads the model in half .* computes its embeddings in float16",
        ),
        "int8": ({"model_kwargs": {"dtype": "int8"}}, "model_kwargs dtype is 'int8', not one batchjob"),
        "quantized": (
            {"model_kwargs": {"quantization_config": {"load_in_8bit": True}, "device_map": "cpu"}},
            "sets model_kwargs \\(quantization_config\\), which sentence-transformers loads the model with",
        ),
    }
    texts = TEXTS[:3]
    for name, (edit, refusal) in cases.items():
        folder = tmp_path / name
        shutil.copytree(folders["bert-mean"], folder)
        config = json.loads((folder / "sentence_bert_config.json").read_text())
        (folder / "sentence_bert_config.json").write_text(json.dumps(config | edit))
        if refusal is not None:
            with pytest.raises(ConfigError, match=refusal):
                Engine.from_pretrained(str(folder), task="embed", device="cpu")
            continue
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(folder), device="cpu")  # in the folder's own dtype
        dtype = str(st.dtype).removeprefix("torch.")
        eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype=dtype)
        got = np.stack([o.embedding for o in eng.embed(texts)])
        tolerance = 1e-12 if dtype == "float64" else 1e-6
        assert float(np.abs(got - _encode(st, texts, None)).max()) <= tolerance, name
    # a bfloat16 folder embeds in --dtype bfloat16
    Engine.from_pretrained(str(tmp_path / "bf16"), task="embed", device="cpu", dtype="bfloat16")


@pytest.mark.engine
def test_a_folders_truncate_dim_is_cut_as_encode_cuts_it(tmp_path):
    """config_sentence_transformers.json's truncate_dim: encode keeps the first N of the normalised vector,
    not renormalised (batchjob wrote all 64 dimensions); --dimensions N cuts before normalising, as
    encode(truncate_dim=N, normalize_embeddings=True) does; a truncate_dim past the width is refused."""
    folder = make_embedder(tmp_path / "m", "bert", "mean", truncate_dim=16)
    st = _st(folder)
    want = _encode(st, TEXTS, None)
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64")
    got = np.stack([o.embedding for o in eng.embed(TEXTS)])
    assert got.shape == want.shape == (len(TEXTS), 16)
    assert float(np.abs(got - want).max()) <= 1e-12
    assert float(np.linalg.norm(got, axis=1).max()) < 0.99  # a part of a unit vector
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64", dimensions=8)
    got = np.stack([o.embedding for o in eng.embed(TEXTS)])
    want = st.encode(TEXTS, convert_to_numpy=True, truncate_dim=8, normalize_embeddings=True)
    assert float(np.abs(got - want).max()) <= 1e-12
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config | {"truncate_dim": 65}))
    with pytest.raises(ConfigError, match="config_sentence_transformers.json has truncate_dim 65"):
        Engine.from_pretrained(str(folder), task="embed", device="cpu")


def test_token_ids_on_a_folder_that_pools_without_its_prompt_are_refused(folders):
    """Token ids are taken as the whole input, no prompt added; pooling would still leave out the prompt's
    count of tokens from their start: refused, unless the call takes no prompt."""
    eng = Engine.from_pretrained(
        str(folders["bert-mean-noprompt"]), task="embed", device="cpu", dtype="float64"
    )
    ids = eng.tokenize(TEXTS[0])
    with pytest.raises(ConfigError, match="token id lists take no prompt, but this model pools without"):
        eng.embed([ids])
    want = _encode(_st(folders["bert-mean-noprompt"]), TEXTS[:1], "")
    plain = Engine.from_pretrained(
        str(folders["bert-mean-noprompt"]), task="embed", device="cpu", dtype="float64", prompt_name=""
    )
    same = plain.embed([plain.tokenize(TEXTS[0])])[0].embedding
    assert float(np.abs(same - want[0]).max()) <= 1e-12
