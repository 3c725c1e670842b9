"""What a sentence-transformers model folder says about making an embedding, read as the installed
sentence-transformers' ``encode`` reads it (checked against 5.x and 6.x): how a text becomes the model's
input (a prompt before it, or a chat message rendered through the chat template) and how the last hidden
states become the embedding (pooling, which tokens it takes, normalisation). A setting batchjob cannot
follow is refused by name, with the file and key, never silently left out.

The files: ``modules.json`` (the pipeline: Transformer, Pooling, Normalize; anything else is refused),
``sentence_bert_config.json`` (the Transformer's: 5.x ``max_seq_length`` and ``do_lower_case``, 6.x
``transformer_task`` and ``modality_config``; a folder without ``modality_config``, as 5.x saved it, takes
text alone; the tokenizer's, the config's and the model's loading arguments),
``config_sentence_transformers.json`` (``prompts``, ``default_prompt_name``) and the pooling module's
``config.json`` (its mode and ``include_prompt``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError

_POOLING_NAMES = {  # 6.x writes "pooling_mode": "mean"; earlier versions a flag per mode
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "cls": "cls",
    "mean": "mean",
    "lasttoken": "last",
}
_HIDDEN_STATES = {"method": "forward", "method_output_name": "last_hidden_state"}


@dataclass(frozen=True)
class Pooling:
    """How an embedding is made from the last hidden states, and how a text becomes the model's input."""

    mode: str  # "cls" | "mean" | "last"
    normalize: bool
    dimensions: int | None  # keep the first N (Matryoshka); None: all
    max_seq_length: int | None  # the sentence-transformers limit, when its files name one
    prompt: str = ""  # put before each text (config_sentence_transformers.json's prompts); "" for none
    chat: str | None = None  # "flat" | "structured": each text is a chat message (modality_config message)
    include_prompt: bool = True  # False: the prompt's tokens are left out of the pooling (text inputs)
    truncation_side: str | None = None  # "left" | "right", as the folder sets the tokenizer's; None: its own
    # the first ``dimensions`` are cut from the normalised vector and not renormalised: the folder's
    # truncate_dim, as encode cuts it after every module (--dimensions cuts before normalising)
    cut_last: bool = False


def st_file(model_dir: str | None, name: str, unknown_is_absent: bool = False) -> Any:
    """A sentence-transformers JSON file of the model folder (local, or a hub model's: cached, else asked
    of the hub); None if there is none (or, with ``unknown_is_absent``, if neither the cache nor the hub
    can say)."""
    if not model_dir:
        return None
    path = Path(model_dir) / name
    if Path(model_dir).is_dir():
        if not path.is_file():
            return None
    else:
        found = _hub_file(model_dir, name, unknown_is_absent)
        if found is None:
            return None
        path = Path(found)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the sentence-transformers file {path}: {e}") from e


def _hub_file(repo: str, name: str, unknown_is_absent: bool = False) -> str | None:
    """A hub model's file: the cached copy, else downloaded (transformers fetches the model's own files, not
    these); None when the hub says it has none. Where neither the cache nor the hub can say, refused: taken
    for absent, a folder's pooling, prompt or chat rendering would be silently left out."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache  # heavy: only for a hub id
    from huggingface_hub.errors import HFValidationError, RemoteEntryNotFoundError  # (as heavy)

    try:
        cached = try_to_load_from_cache(repo, name)
    except HFValidationError:  # not a hub id: nothing to ask
        return None
    if isinstance(cached, str):
        return cached
    if cached is not None:  # the cache records that the hub has no such file
        return None
    try:
        return hf_hub_download(repo, name)
    except RemoteEntryNotFoundError:
        return None
    except (OSError, ValueError) as e:  # offline, not cached, the hub unreachable
        if unknown_is_absent:
            return None
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"cannot tell whether model {repo!r} has the sentence-transformers file {name} (it is not in the "
            f"Hugging Face cache and the hub can't be asked: {why}); run once with the hub reachable (what it "
            "says, a file or that there is none, is cached for offline runs)"
        ) from e


def _pooling_mode(model_dir: str | None, module: dict, given: str | None) -> tuple[str | None, bool]:
    """(the pooling module's mode, or None where ``given`` overrides one batchjob does not compute;
    its include_prompt)."""
    path = f"{module.get('path', '1_Pooling')}/config.json"
    config = st_file(model_dir, path) or {}
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if isinstance(config.get("pooling_mode"), str):
        modes = [config["pooling_mode"]]
    include = config.get("include_prompt", True) is not False
    if len(modes) == 1 and modes[0] in _POOLING_NAMES:
        return _POOLING_NAMES[modes[0]], include
    if given is None:
        raise ConfigError(
            f"the model's sentence-transformers pooling ({', '.join(modes) or 'none'}, in {model_dir}/{path}) "
            "is not one batchjob computes; give pooling=cls, mean or last (--pooling) to override it"
        )
    return None, include


def _pipeline(model_dir: str | None, pooling: str | None, normalize: bool | None) -> tuple[str | None, bool, bool]:
    """modules.json read: (its pooling mode, whether it normalises, the pooling's include_prompt)."""
    modules = st_file(model_dir, "modules.json") or []
    mode, st_normalize, include = None, False, True
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            st_normalize = True
        elif kind == "Pooling":
            mode, include = _pooling_mode(model_dir, module, pooling)
        elif pooling is None or normalize is None:
            raise ConfigError(
                f"the model's sentence-transformers pipeline (modules.json in {model_dir}) has a {kind} module, "
                "which batchjob does not run; give both pooling and normalize (--pooling, --normalize) to "
                "embed with the transformer's hidden states alone"
            )
    return mode, st_normalize, include


def _input_format(model_dir: str | None, config: dict) -> str | None:
    """How the Transformer module takes a text (sentence_bert_config.json): None as it is, else the chat
    message format ("flat" or "structured") it renders each text through the chat template in."""
    where = f"{model_dir}/sentence_bert_config.json"
    if config.get("do_lower_case") is True:
        raise ConfigError(
            f"{where} sets do_lower_case, which batchjob does not apply; lower-case the texts yourself and "
            "set do_lower_case to false"
        )
    task = config.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ConfigError(f"{where} has transformer_task {task!r}; --task embed reads feature-extraction models")
    modalities = config.get("modality_config")
    if modalities is None:  # saved by sentence-transformers 5 or earlier: text alone
        return None
    unknown = sorted(set(config.get("processing_kwargs") or {}))
    if unknown:
        raise ConfigError(
            f"{where} sets processing_kwargs ({', '.join(unknown)}), which batchjob does not apply; remove them "
            "to embed as batchjob does"
        )
    message = modalities.get("message")
    if message is None:
        if modalities.get("text") is None:
            raise ConfigError(f"{where}: its modality_config has neither text nor message; batchjob embeds text")
        _check_method(where, "text", modalities["text"])
        return None
    _check_method(where, "message", message)
    fmt = message.get("format", "auto")
    if fmt not in ("flat", "structured"):
        raise ConfigError(
            f"{where}: modality_config message has format {fmt!r}; batchjob renders flat or structured "
            "messages: set one of them"
        )
    return str(fmt)


def _check_method(where: str, modality: str, params: Any) -> None:
    if not isinstance(params, dict) or any(params.get(k) != v for k, v in _HIDDEN_STATES.items()):
        raise ConfigError(
            f"{where}: modality_config {modality} is {params!r}; batchjob embeds the forward's last_hidden_state"
        )


# Keys of the Transformer module's loading arguments that sentence-transformers itself replaces (with the
# caller's hub arguments) or drops (trust_remote_code): a folder's value changes nothing.
_HUB_KEYS = {"subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code"}
# (the file's name for the tokenizer's and the config's loading arguments, 6.x's first; 5.x's wins, as
# sentence-transformers 6 takes it, where both are there)
_TOKENIZER_KEYS, _CONFIG_KEYS = ("processor_kwargs", "tokenizer_args"), ("config_kwargs", "config_args")
_MODEL_KEYS = ("model_kwargs", "model_args")
# Keys of the model's loading arguments that change how fast it loads or runs, or where, not the numbers
# it computes (add_pooling_layer: BERT's pooler, which the last hidden states never pass through).
_HARMLESS_MODEL_KEYS = {"attn_implementation", "device_map", "low_cpu_mem_usage", "add_pooling_layer"}
# The dtype names transformers takes (torch's attributes) for those batchjob computes in.
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64"}
_DTYPE_NAMES |= {"float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


def _loading_args(where: str, config: dict, names: tuple[str, str]) -> tuple[str, dict]:
    """(the key, its dict) of the loading arguments ``names`` in sentence_bert_config.json, without the keys
    sentence-transformers replaces itself; ("", {}) when there are none."""
    name = names[1] if names[1] in config else names[0]
    args = config.get(name) or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}: {name} is {args!r}, not a JSON object of keyword arguments")
    return name, {k: v for k, v in args.items() if k not in _HUB_KEYS}


def _check_model_args(where: str, config: dict, dtype: str | None) -> None:
    """sentence_bert_config.json's model arguments (``model_kwargs``, 5.x ``model_args``), which
    sentence-transformers loads the model with: a dtype other than the engine's ``dtype`` (its name, e.g.
    "float32"; None: not checked) and any key that may change the numbers are refused by name; "auto" (the
    config's dtype, as without the key) and keys that change only speed or placement are taken."""
    name, args = _loading_args(where, config, _MODEL_KEYS)
    given = args.get("dtype", args.get("torch_dtype"))  # transformers takes dtype over torch_dtype
    others = sorted(set(args) - _HARMLESS_MODEL_KEYS - {"dtype", "torch_dtype"})
    if others:
        raise ConfigError(
            f"{where} sets {name} ({', '.join(others)}), which sentence-transformers loads the model with and "
            "batchjob does not (it takes attn_implementation, device_map and a dtype); remove them from "
            "the file to embed without them"
        )
    if given is None or given == "auto":
        return
    folder = _DTYPE_NAMES.get(given) if isinstance(given, str) else None
    if folder is None:
        raise ConfigError(
            f"{where}: {name} dtype is {given!r}, not one batchjob computes in (float32, float64, bfloat16, "
            "float16); remove it from the file to embed in --dtype"
        )
    if dtype is not None and folder != dtype:
        raise ConfigError(
            f"{where}: {name} loads the model in {given} (sentence-transformers computes its embeddings in "
            f"{folder}), but this engine computes in {dtype}; give --dtype {folder} to embed as it does, or "
            f"remove the key from the file to embed in {dtype}"
        )


def _tokenizer_limits(where: str, config: dict) -> tuple[int | None, str | None]:
    """What sentence_bert_config.json's tokenizer arguments (``processor_kwargs``, 5.x ``tokenizer_args``:
    sentence-transformers loads the tokenizer with them) set that batchjob applies: (``model_max_length``,
    which replaces ``max_seq_length`` as encode's limit; ``truncation_side``). Any other key, and the config's
    arguments (``config_kwargs``, ``config_args``: they change the model itself), are refused by name."""
    name, args = _loading_args(where, config, _CONFIG_KEYS)
    args.pop("use_cache", None)  # the KV cache of transformers' forward: no bearing on its outputs
    if args:
        raise ConfigError(
            f"{where} sets {name} ({', '.join(sorted(args))}), which sentence-transformers applies to the "
            "model's config and batchjob does not; put them in the model's config.json to embed with them"
        )
    name, args = _loading_args(where, config, _TOKENIZER_KEYS)
    limit, side = args.pop("model_max_length", None), args.pop("truncation_side", None)
    if args:
        raise ConfigError(
            f"{where} sets {name} ({', '.join(sorted(args))}), which sentence-transformers passes to the "
            "tokenizer and batchjob does not (it applies model_max_length and truncation_side); put them in "
            "the tokenizer's tokenizer_config.json to embed with them"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{where}: {name} model_max_length is {limit!r}, not a positive number of tokens")
    if side not in (None, "left", "right"):
        raise ConfigError(f"{where}: {name} truncation_side is {side!r}; it is 'left' or 'right'")
    return limit, side


def prompt_text(model_dir: str | None, prompt_name: str | None) -> str:
    """The prompt before each text: ``prompt_name``'s, else the folder's default_prompt_name's, else none;
    ``prompt_name`` "" asks for none."""
    config = st_file(model_dir, "config_sentence_transformers.json") or {}
    # sentence-transformers gives every model a "query" and a "document" prompt, empty unless saved
    prompts = {"query": "", "document": ""} | (config.get("prompts") or {})
    name = config.get("default_prompt_name") if prompt_name is None else prompt_name
    if not name:
        return ""
    if name not in prompts:
        where = f"{model_dir}/config_sentence_transformers.json"
        known = ", ".join(repr(k) for k in prompts) or "none"
        raise ConfigError(
            f"prompt name {name!r} is not one of the model's prompts ({known}, in {where}); give "
            "--prompt-name with one of them, or --prompt-name '' for none"
        )
    return str(prompts[name] or "")


def resolve_pooling(
    model_dir: str | None,
    pooling: str | None,
    normalize: bool | None,
    dimensions: int | None,
    width: int,
    prompt_name: str | None = None,
    dtype: str | None = None,
) -> Pooling:
    """The embedding recipe: the options given, else the folder's sentence-transformers files, else mean
    pooling without normalisation and the text alone. Raises ``ConfigError`` for what batchjob does not
    follow (a Dense module, max pooling, a prompt name the folder lacks, a dtype other than ``dtype``, the
    engine's, e.g. "float32"; None: not checked, ...)."""
    mode, st_normalize, include = _pipeline(model_dir, pooling, normalize)
    if dimensions is not None and dimensions > width:
        raise ConfigError(f"dimensions {dimensions} exceeds the model's width of {width}")
    folder_dim = _truncate_dim(model_dir, width) if dimensions is None else None
    st_config = st_file(model_dir, "sentence_bert_config.json") or {}
    # the tokenizer's model_max_length among its loading arguments replaces max_seq_length, as
    # sentence-transformers 6 takes it (it sets the tokenizer's limit from max_seq_length only without one)
    limit, side = _tokenizer_limits(f"{model_dir}/sentence_bert_config.json", st_config)
    _check_model_args(f"{model_dir}/sentence_bert_config.json", st_config, dtype)
    if limit is None:
        limit = st_config.get("max_seq_length")
    prompt = prompt_text(model_dir, prompt_name)
    return Pooling(
        mode=pooling or mode or "mean",
        normalize=st_normalize if normalize is None else normalize,
        dimensions=dimensions if folder_dim is None else folder_dim,
        max_seq_length=limit if isinstance(limit, int) and limit > 0 else None,
        prompt=prompt,
        chat=_input_format(model_dir, st_config),
        include_prompt=include,
        truncation_side=side,
        # an explicit normalize scales what is kept, as encode(normalize_embeddings=True) does after its cut
        cut_last=folder_dim is not None and normalize is None,
    )


def _truncate_dim(model_dir: str | None, width: int) -> int | None:
    """config_sentence_transformers.json's truncate_dim: encode keeps the first N of each embedding
    (``width`` 0: not checked against the model's width)."""
    config = st_file(model_dir, "config_sentence_transformers.json") or {}
    dim = config.get("truncate_dim")
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or (width and dim > width):
        raise ConfigError(
            f"{model_dir}/config_sentence_transformers.json has truncate_dim {dim!r}, not a number of "
            f"dimensions from 1 to the model's width of {width}"
        )
    return dim


def _message(role: str, text: str, fmt: str) -> dict[str, Any]:
    return {"role": role, "content": text if fmt == "flat" else [{"type": "text", "text": text}]}


def _render(tokenizer: Any, pooling: Pooling, text: str) -> list[int]:
    """A text as one chat message (after the prompt as a system message), rendered as encode renders it."""
    assert pooling.chat is not None
    messages = [_message("system", pooling.prompt, pooling.chat)] if pooling.prompt else []
    messages.append(_message("user", text, pooling.chat))
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def input_ids(tokenizer: Any, text: str, pooling: Pooling, limit: int | None) -> list[int]:
    """A text's token ids as sentence-transformers' ``encode`` makes them for this folder: the prompt before
    it, or both rendered through the chat template; cut to ``limit`` tokens when given (a chat render then
    ends with the template's own tail again, written over the last tokens, as encode writes it back)."""
    if pooling.chat is None:
        cut = limit is not None
        return tokenizer(pooling.prompt + text, truncation=cut, max_length=limit).input_ids
    ids = _render(tokenizer, pooling, text)
    if limit is None or len(ids) <= limit:
        return ids
    if getattr(tokenizer, "truncation_side", "right") == "left":  # the render's start goes, as encode cuts it
        return ids[-limit:]
    # The tail is the tokens two renders with different texts share at their end: the template's, never
    # the text's.
    first, second = _render(tokenizer, pooling, "0"), _render(tokenizer, pooling, "1 2 3 4")
    same = 0
    for a, b in zip(reversed(first), reversed(second), strict=False):
        if a != b:
            break
        same += 1
    ids = ids[:limit]
    if 0 < same < min(len(first), len(second)):
        keep = min(same, limit)
        ids[limit - keep :] = first[len(first) - keep :]
    return ids


def prompt_length(tokenizer: Any, pooling: Pooling) -> int:
    """How many leading tokens pooling leaves out (``include_prompt`` false, text inputs): the prompt's
    tokens alone, less a special token the tokenizer ends it with, as encode counts them. 0: none."""
    if pooling.include_prompt or not pooling.prompt or pooling.chat is not None:
        return 0  # encode keeps a chat render's prompt in the pooling
    ids = tokenizer(pooling.prompt).input_ids
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    return len(ids) - 1 if ids and ids[-1] in special else len(ids)


def refuse_cross_encoder(model_dir: str | None, model_config: Any) -> None:
    """--task classify: a sentence-transformers CrossEncoder folder is refused, by name. ``predict`` reads a
    (query, document) pair, the second text in a segment of its own, and puts the head's outputs through
    the folder's activation; classify reads one text and writes the raw outputs, so its scores would differ
    without a word. (A hub model's config_sentence_transformers.json is asked of the hub where not cached,
    and taken for absent where neither can say: an offline classifier must still run. A folder saved by
    sentence-transformers 5, or before 4.0, says it in its config.json, which is always read.)"""
    config = st_file(model_dir, "config_sentence_transformers.json", unknown_is_absent=True) or {}
    legacy = getattr(model_config, "sentence_transformers", None)  # 5.x CrossEncoder.save wrote it here
    if config.get("model_type") == "CrossEncoder":
        where = "config_sentence_transformers.json has model_type 'CrossEncoder'"
        activation = config.get("activation_fn")
    elif isinstance(legacy, dict) and "activation_fn" in legacy:
        where, activation = "config.json has sentence_transformers.activation_fn", legacy["activation_fn"]
    elif getattr(model_config, "sbert_ce_default_activation_function", None) is not None:  # before 4.0
        activation = model_config.sbert_ce_default_activation_function
        where = "config.json has sbert_ce_default_activation_function"
    else:
        return
    raise ConfigError(
        f"{model_dir}/{where}: a sentence-transformers CrossEncoder, whose predict reads a (query, document) "
        f"pair (the second text in a segment of its own) and puts the head's outputs through "
        f"{activation or 'its activation'}; --task classify reads one text and writes the raw outputs, so "
        "its scores would differ: run it with sentence-transformers' CrossEncoder.predict"
    )
