"""One PEFT LoRA folder read into per-module low-rank weights, or refused by name before any work.

The input is PEFT's saved format: ``adapter_config.json`` and ``adapter_model.safetensors`` (read with
safetensors, so the engine needs no peft). What the file holds decides which modules are adapted (PEFT
wrote exactly its ``target_modules`` after ``exclude_modules``, ``layers_to_transform``); each module's rank
is its tensors' shape, checked against ``r``/``rank_pattern``; its scale is ``alpha / r`` (``alpha / sqrt(r)``
with rsLoRA), ``alpha`` from ``lora_alpha``/``alpha_pattern``. ``fan_in_fan_out`` only says how PEFT would
merge into a GPT-2 ``Conv1D`` weight: the update beside the layer is the same either way. Whatever changes
the forward in a way not built here (DoRA, LoRA biases, trainable tokens, embedding or output-head
targets, another base's shapes or name) raises ``ConfigError`` naming it. ``modules_to_save`` is taken only
where the engine names its task head (``heads``: a classifier's ``score`` or ``classifier``): the folder's
full tensors of those modules are the adapter's own head (``Adapter.head``); any other saved module is
refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from batchjob.digest import bytes_part, combine, digest_of, folder_files, local_reader
from batchjob.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Config fields that change the forward in ways not built here: (field, what it is), refused when set.
_NOT_BUILT = (
    ("use_dora", "DoRA (use_dora)"),
    ("lora_bias", "LoRA biases (lora_bias)"),
    ("trainable_token_indices", "trainable_token_indices"),
    ("target_parameters", "target_parameters (LoRA on parameters)"),
    ("layer_replication", "layer_replication"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("use_qalora", "QA-LoRA (use_qalora)"),
    ("use_bdlora", "use_bdlora"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config: it truncates the base weights when loaded)"),
)
# init_lora_weights values with which PEFT rewrites the base weights when it makes the adapter, so that its
# weights are trained against that residual (PEFT 0.22's LoraLayer.update_layer: pissa*, corda, astra, olora,
# loftq, lora_ga; save_pretrained's path_initial_model_for_weight_conversion makes all but loftq plain LoRA).
_REWRITES_BASE = ("pissa", "olora", "corda", "astra", "loftq", "lora_ga")
# A saved tensor's name: PEFT's prefix, the module's name in the model, lora_A or lora_B (an adapter name
# between them in some older files).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoraWeights:
    """One module's update ``(x @ a.T) @ b.T * scale``."""

    a: torch.Tensor  # [r, in_features], on the engine's device and dtype
    b: torch.Tensor  # [out_features, r]
    scale: float


@dataclass
class Adapter:
    """One adapter, resident: its name, where it came from, the identity of the files it was read from and each
    adapted module's weights."""

    name: str
    path: Path
    layers: dict[str, LoraWeights]  # module name in the model -> its update
    head: dict[str, torch.Tensor] = field(default_factory=dict)  # modules_to_save: "score.weight" -> tensor
    # The folder by content as loaded (``read_folder``): a job records this, not the folder as it is later.
    identity: str = ""

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.layers.values())

    @property
    def max_rank(self) -> int:
        return max(w.a.shape[0] for w in self.layers.values())


def resolve_folder(name: str, path: str | Path) -> Path:
    """The local folder of adapter ``name``: ``path`` itself, or a hub id fetched by huggingface_hub."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists() or str(path).startswith((".", "/", "~")):
        raise ConfigError(f"LoRA adapter {name!r}: {path} is not a folder")
    try:
        from huggingface_hub import snapshot_download  # only for a hub id

        return Path(snapshot_download(str(path), allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as e:  # noqa: BLE001 - the hub raises many types; each is the same refusal here
        raise ConfigError(
            f"LoRA adapter {name!r}: {path} is neither a folder nor a hub id we can fetch ({e})"
        ) from e


def read_config(name: str, folder: Path, heads: tuple[str, ...] = ()) -> dict[str, Any]:
    """The adapter's config, refused when it is not a LoRA this engine computes (``modules_to_save``
    only where the engine has a task head, ``heads``)."""
    _check_files(name, folder)
    file = folder / CONFIG_FILE
    try:
        return parse_config(name, file, file.read_bytes(), heads)
    except OSError as e:
        raise ConfigError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from e


def _check_files(name: str, folder: Path) -> None:
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"LoRA adapter {name!r}: {folder} needs {CONFIG_FILE} and {WEIGHTS_FILE} (PEFT's format)"
        )


def read_folder(name: str, folder: Path) -> tuple[bytes, bytes, str]:
    """The bytes of the adapter's config and weights, each file read once, and the folder's identity by
    content: those two files digested from the bytes read here, which are the ones the engine computes with
    (a training run that saves its next checkpoint into the folder later changes nothing loaded), the other
    files as they are now. The same digest, over the same files, as the job layer's ``folder_digest``."""
    _check_files(name, folder)
    read: dict[str, bytes] = {}
    parts: dict[str, str] = {}
    try:
        for rel, path in folder_files(folder):
            if rel in (CONFIG_FILE, WEIGHTS_FILE):
                read[rel] = path.read_bytes()
                parts[rel] = bytes_part(read[rel])
                continue
            read_at, close = local_reader(path)
            try:
                size = path.stat().st_size
                parts[rel] = f"{size}:{digest_of(read_at, size)}"
            finally:
                close()
    except OSError as e:
        raise ConfigError(f"LoRA adapter {name!r}: cannot read {folder}: {e}") from e
    if set(read) != {CONFIG_FILE, WEIGHTS_FILE}:  # one went between the check and the read
        raise ConfigError(f"LoRA adapter {name!r}: {folder} changed while it was read; load it again")
    return read[CONFIG_FILE], read[WEIGHTS_FILE], combine(parts)


def parse_config(name: str, file: Path, data: bytes, heads: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config read from ``file`` (its bytes, ``data``), refused as ``read_config`` says."""
    try:
        config = json.loads(data)
    except ValueError as e:
        raise ConfigError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"LoRA adapter {name!r}: {file} holds no JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"LoRA adapter {name!r}: {file} is a {config.get('peft_type')} adapter, not LoRA")
    for key, what in _NOT_BUILT:
        if config.get(key):
            raise ConfigError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("modules_to_save") and not heads:
        raise ConfigError(
            f"LoRA adapter {name!r}: modules_to_save is not supported here (only a classify engine takes "
            "the adapter's own classification head)"
        )
    init = str(config.get("init_lora_weights", True))
    if init.lower().startswith(_REWRITES_BASE):
        raise ConfigError(
            f"LoRA adapter {name!r}: init_lora_weights={init!r} adapters change the base model's weights (PEFT "
            "trains them against the base minus their initial update), which batchjob does not; save the "
            "adapter converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion) and use that"
        )
    if config.get("bias", "none") != "none":
        raise ConfigError(
            f"LoRA adapter {name!r}: trained base biases (bias={config['bias']!r}) are not supported"
        )
    return config


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """A ``rank_pattern``/``alpha_pattern`` value for ``module``: the first key that matches the end of its
    dotted name as a regular expression (PEFT's rule), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def check_base(name: str, config: dict[str, Any], model_id: str) -> None:
    """Refuse an adapter whose config names another base model than the engine's, compared by name (a
    model's last path component: a local copy of the same hub model passes, and so does the hub cache's
    ``models--org--name/snapshots/<hash>`` folder, or a link to it); the shapes are checked apart."""
    base = str(config.get("base_model_name_or_path") or "")
    if not base or not model_id:
        return
    want = base.rstrip("/").split("/")[-1].lower()
    if want not in _names(str(model_id)):
        raise ConfigError(
            f"LoRA adapter {name!r} was made for base model {base!r} (its adapter_config.json says so), not "
            f"{model_id!r}: give --model that model; a copy of it in a folder of another name is taken by "
            f"name only, so name the folder {want!r}"
        )


def _names(model_id: str) -> set[str]:
    """The names a model goes by: its last path component, that of the folder a link leads to, and the hub
    repository's name where it is a snapshot of the hub cache."""
    names = {model_id.rstrip("/").split("/")[-1].lower()}
    path = Path(model_id)
    if path.exists():
        resolved = path.resolve()
        names.add(resolved.name.lower())
        for part in resolved.parts:
            if part.startswith("models--"):
                names.add(part.split("--")[-1].lower())
    return names


def read_tensors(
    name: str, folder: Path, data: bytes, heads: tuple[str, ...] = ()
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """module name -> {"A": tensor, "B": tensor} of the weights file's bytes ``data``, and the full tensors of
    the modules ``heads`` names (``modules_to_save``: "score.weight" -> tensor); any other tensor is refused
    by name."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise ConfigError(f"LoRA adapter {name!r}: cannot read {folder / WEIGHTS_FILE}: {e}") from e
    for key, tensor in tensors.items():
        m = _TENSOR.match(key)
        if m is not None:
            modules.setdefault(m["module"], {})[m["ab"]] = tensor
            continue
        own = key.removeprefix("base_model.model.")
        if own.split(".")[0] in heads:
            head[own] = tensor
            continue
        what = f"a saved module ({own.rpartition('.')[0]}) that is not the task head ({', '.join(heads)})"
        raise ConfigError(
            f"LoRA adapter {name!r}: tensor {key!r} is "
            f"{what if heads else 'not a LoRA A or B weight'} (not supported)"
        )
    if not modules:
        raise ConfigError(f"LoRA adapter {name!r}: {folder / WEIGHTS_FILE} holds no LoRA weights")
    return modules, head


def module_shape(name: str, module_name: str, model: PreTrainedModel) -> tuple[int, int]:
    """(in_features, out_features) of the layer an adapter targets; refused unless a linear layer of the
    model's body (an embedding or the output head is not built)."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ConfigError(
            f"LoRA adapter {name!r} targets {module_name!r}, which this model does not have"
        ) from None
    if module is model.get_output_embeddings():
        raise ConfigError(
            f"LoRA adapter {name!r}: the output head ({module_name}) as a target is not supported"
        )
    outside = _outside_the_language_model(model, module_name)
    if outside is not None:
        raise ConfigError(
            f"LoRA adapter {name!r} targets {module_name!r}, in the {outside} (not supported: its update would "
            "follow the step's text rows, not each image's own request); target the language model's layers"
        )
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):  # GPT-2's layers: weight [in, out] (PEFT's fan_in_fan_out)
        return int(module.weight.shape[0]), int(module.nf)
    kind = "an embedding" if isinstance(module, torch.nn.Embedding) else type(module).__name__
    raise ConfigError(
        f"LoRA adapter {name!r} targets {module_name!r} ({kind}): only linear layers are supported"
    )


def _outside_the_language_model(model: PreTrainedModel, module_name: str) -> str | None:
    """Where a vision-language model's module lies when not in its language model (the vision tower, the
    projector, by the name of its part), else None (a text model: None)."""
    from batchjob.engine.vision.family import is_vlm  # (the vision package imports this one's neighbours)

    if not is_vlm(model.config):
        return None
    decoder = model.get_decoder()
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    if module_name.startswith(prefix + "."):
        return None
    return module_name.removeprefix("model.").split(".")[0]


def _targets(config: dict[str, Any], module_name: str) -> bool:
    """Whether ``target_modules`` names ``module_name`` (a regex matches the whole name; a list entry the
    name or its dotted end)."""
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        return re.fullmatch(targets, module_name) is not None
    return any(module_name == t or module_name.endswith(f".{t}") for t in targets)


def check_targets(name: str, config: dict[str, Any], model: PreTrainedModel) -> None:
    """Refuse an adapter that targets the input embedding or the output head (not built)."""
    ends = {
        "the output head": model.get_output_embeddings(),
        "the input embedding": model.get_input_embeddings(),
    }
    for module_name, module in model.named_modules():
        for what, end in ends.items():
            if module is end and _targets(config, module_name):
                raise ConfigError(
                    f"LoRA adapter {name!r}: {what} ({module_name}) as a target is not supported"
                )


def load_adapter(
    name: str,
    path: str | Path,
    model: PreTrainedModel,
    model_id: str,
    dtype: torch.dtype,
    device: torch.device,
    heads: tuple[str, ...] = (),
) -> Adapter:
    """Adapter ``name`` from the PEFT folder (or hub id) ``path``, checked against ``model``, resident on
    ``device`` in ``dtype``; ``heads``: the engine's task head modules, which its ``modules_to_save`` may
    replace."""
    folder = resolve_folder(name, path)
    config_bytes, weights_bytes, identity = read_folder(name, folder)  # each file read once: what runs
    config = parse_config(name, folder / CONFIG_FILE, config_bytes, heads)
    check_base(name, config, model_id)
    check_targets(name, config, model)
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    layers: dict[str, LoraWeights] = {}
    modules, head = read_tensors(name, folder, weights_bytes, heads)
    for module_name, pair in modules.items():
        if set(pair) != {"A", "B"}:
            raise ConfigError(
                f"LoRA adapter {name!r}: {module_name} lacks its lora_{'AB'[('A' in pair)]} weight"
            )
        a, b = pair["A"], pair["B"]
        in_f, out_f = module_shape(name, module_name, model)
        rank = int(pattern_value(ranks, module_name, r))
        if a.shape[1:] == (in_f,) and b.shape[:1] == (out_f,) and a.shape[0] == b.shape[1] != rank:
            raise ConfigError(  # the layer's shape fits: the config's rank does not
                f"LoRA adapter {name!r}: {module_name}'s weights are of rank {a.shape[0]}, but its "
                f"adapter_config.json says r {rank}: the config does not describe these weights"
            )
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise ConfigError(
                f"LoRA adapter {name!r}: {module_name} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this "
                f"model's layer is [{in_f} -> {out_f}] at rank {rank}: made for another base model "
                f"({config.get('base_model_name_or_path') or 'unnamed'}, not {model_id or 'this one'})"
            )
        a_pat = float(pattern_value(alphas, module_name, alpha))
        scale = a_pat / math.sqrt(rank) if config.get("use_rslora") else a_pat / rank
        layers[module_name] = LoraWeights(a.to(device, dtype), b.to(device, dtype), scale)
    return Adapter(name, folder, layers, {k: t.to(device, dtype) for k, t in head.items()}, identity)
