"""TOML job files: read one, normalize its keys and resolve its paths against its folder.

This module knows a job file's keys only as the set of names the caller passes (``spec.py`` passes every
option of a job), so it imports nothing of the spec. Relative ``input``, ``output`` and ``json_schema`` paths
are relative to the job file's folder, so a job file works from any working directory. A relative ``model``
is a folder next to the job file when one exists there (or it starts with ``./`` or ``../``), else a folder
in the working directory when one exists there, else a hub id.
The command line's values go on top (``overlay``), its member of a group of exclusive fields replacing the
file's.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A job file given where an input was meant: the refusal says so (the command's one argument is a job file).
_INPUT_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow", ".csv")


def read_job_file(path: str | Path, known: Collection[str]) -> dict[str, Any]:
    """The fields of the TOML job file at ``path``, keys normalized to underscores (each one of ``known``),
    paths made relative to its folder."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a leading BOM (Windows editors) dropped
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        hint = ""
        if path.suffix.lower() in _INPUT_SUFFIXES or path.name.lower().endswith((".jsonl.gz", ".jsonl.zst")):
            hint = f" (an input file? give it as --input {path})"
        raise ConfigError(f"job file {path} is not valid TOML{hint}: {e}") from e
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}  # field name -> the key that gave it
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"job file {path}: unknown field {key!r} (known: {', '.join(sorted(known))})")
        if name in keys:
            raise ConfigError(
                f"job file {path}: {keys[name]!r} and {key!r} are the same field; keep only one of them"
            )
        keys[name] = key
        out[name] = value
    out = _resolve_paths(out, path.parent)
    if isinstance(out.get("lora"), dict):
        _check_lora_table(out["lora"], path, known)
    return out


def _check_lora_table(lora: dict[str, Any], path: Path, known: Collection[str]) -> None:
    """Refuse a ``[lora]`` entry named as a job field whose value is no adapter (not a folder with an
    adapter_config.json, nor a hub id ``org/name``): TOML puts every key after the table's header into the
    table, so ``max-new-tokens = 3`` written below ``[lora]`` became an adapter, and the job lost the field.
    An adapter named ``chat`` that is one stays one."""
    for name, value in lora.items():
        if name.replace("-", "_") not in known or (isinstance(value, str) and _may_be_adapter(value)):
            continue
        raise ConfigError(
            f"job file {path}: [lora] names an adapter {name!r} = {value!r}, which is no adapter folder or hub "
            f"id, and {name!r} is a job field: TOML puts every key after the [lora] header into that table, "
            "so move it above the header"
        )


def _may_be_adapter(value: str) -> bool:
    """Whether ``value`` (made relative to the job file's folder) may name a LoRA adapter: a folder with an
    adapter_config.json (PEFT's), or a hub id ``org/name``."""
    if _is_folder(value):
        return (Path(value).expanduser() / "adapter_config.json").is_file()
    return re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", value) is not None and ".." not in value


def _resolve_paths(out: dict[str, Any], base: Path) -> dict[str, Any]:
    """``out`` with its relative paths made relative to ``base``, the job file's folder."""

    def rel(p: Any) -> Any:
        if isinstance(p, str) and "://" not in p and not Path(p).expanduser().is_absolute():
            return str(base / p)
        return p

    if "input" in out:
        out["input"] = [rel(p) for p in out["input"]] if isinstance(out["input"], list) else rel(out["input"])
    if "output" in out:
        out["output"] = rel(out["output"])
    if "json_schema" in out:
        out["json_schema"] = rel(out["json_schema"])

    def adapter(v: Any) -> Any:  # a folder next to the job file (else: the working directory's, or a hub id)
        return rel(v) if str(v).startswith(("./", "../")) or _is_folder(rel(v)) else v

    lora = out.get("lora")
    if isinstance(lora, dict):  # [lora]
        out["lora"] = {k: adapter(v) for k, v in lora.items()}
    elif isinstance(lora, list):  # lora = ["NAME=PATH", ...], as the command line gives them
        out["lora"] = [
            f"{item.split('=', 1)[0]}={adapter(item.split('=', 1)[1])}"
            if isinstance(item, str) and "=" in item
            else item
            for item in lora
        ]
    model = out.get("model")
    # a folder next to the job file (else: the working directory's, or a hub id)
    if isinstance(model, str) and model and (model.startswith(("./", "../")) or _is_folder(rel(model))):
        out["model"] = rel(model)
    return out


def _is_folder(path: Any) -> bool:
    try:
        return isinstance(path, str) and "://" not in path and Path(path).expanduser().is_dir()
    except OSError:  # a name too long for a path, say: not a folder
        return False


def overlay(
    path: str | Path | None,
    fields: dict[str, Any],
    given: dict[str, Any],
    groups: Collection[tuple[str, ...]],
) -> dict[str, Any]:
    """A job file's ``fields`` with the command line's ``given`` values on top. The command line wins, as
    for every field, also within a group of fields that exclude each other: giving one member there replaces
    the file's member (a file's ``template`` and ``--prompt-column``), where a field-by-field merge would hold
    both and be refused. Two members given at the same level, both in the file or both on the command line,
    stay refused, saying where each came from."""
    out = dict(fields)
    for group in groups:
        ours = [n for n in group if given.get(n) is not None]
        theirs = [n for n in group if fields.get(n) is not None]
        for names, where in ((ours, "on the command line"), (theirs, f"in the job file {path}")):
            if len(names) > 1:
                both = " and ".join(_flag(n) for n in names)
                raise ConfigError(f"{both} exclude each other; both were given {where}: keep one of them")
        if ours:
            for name in theirs:  # the command line's choice replaces the file's
                out.pop(name)
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
