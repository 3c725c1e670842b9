"""Which LoRA adapter a row runs under: ``--adapter-column``'s value (null or empty: the base model), the
only ``--lora`` adapter when there is no column, or with ``--format openai`` the adapter ``body.model``
names (the base model's name, or none, is the base). A name the job did not load makes the row an error row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchjob.io.readers import Row
    from batchjob.job.spec import JobSpec


def row_adapter(spec: JobSpec, row: Row) -> tuple[str | None, str | None]:
    """The row's adapter name (None: the base model) and the row's error (None when it has none)."""
    names = spec.lora_paths
    if not names:
        return None, None
    assert row.values is not None
    where = f"{row.source} line {row.line}: " if row.line is not None else ""
    if spec.adapter_column is not None:
        value = row.values.get(spec.adapter_column)
        what = f"adapter column {spec.adapter_column!r}"
    elif spec.format == "openai":
        body = row.values.get("body")
        value = body.get("model") if isinstance(body, dict) else None
        return (value if value in names else None), None  # another name: the base (as without adapters)
    else:
        return next(iter(names)), None  # one adapter and no column: every row (spec.py refuses more)
    if value is None or value == "":
        return None, None
    if not isinstance(value, str):
        return None, f"{where}{what} is not text (got {type(value).__name__})"
    if value not in names:
        return None, f"{where}{what}: unknown LoRA adapter {value!r} (adapters: {', '.join(names)})"
    return value, None
