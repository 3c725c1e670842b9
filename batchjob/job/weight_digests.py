"""Whole-file digests of a model's large files (its weights), which the identity's per-file digests only
sample (``batchjob.io.identity``: past 16 MiB, about 6 MiB read): a same-size edit between the samples left
the model's identity unchanged, and a resumed job mixed two models' answers.

Reading every weight at every start would double the model's load, so a file's digest is kept in the cache
folder (``models.cache_dir``) under its path, with its size, time stamp, inode and status-change time: a file
whose four are unchanged is the very file that was read (nothing writes to a file or renames it without
moving its status-change time), and any change reads it again. A digest is of content only, so it is the
same on every machine that holds the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from batchjob.io.identity import stat_local

_CHUNK = 8 << 20


def whole_digests(folder: Path, sampled: list[str]) -> dict[str, str]:
    """``{file: "full:<sha256>"}`` of the files of ``folder`` named in ``sampled`` (relative names)."""
    from batchjob.models import cache_dir  # (the cache folder's one definition)

    path = cache_dir() / "weight-digests.json"
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    out, grown = {}, False
    for rel in sampled:
        file = os.path.realpath(folder / rel)  # a hub cache's snapshot links to its blobs
        stamp = list(stat_local(file))
        kept = cache.get(file)
        if not (isinstance(kept, list) and kept[:4] == stamp):
            kept, grown = [*stamp, _sha256(file)], True
            cache[file] = kept
        out[rel] = f"full:{kept[4]}"
    if grown:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (workers of one job may write at once)
        try:  # a cache that can't be written costs a read of the files next time, nothing worse
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(cache), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
    return out


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
