"""A model's identity by content: a same-size edit of a weight file between the samples its per-file digest
reads (past 16 MiB) is caught by the whole-file digest, which is read once per file and machine."""

from __future__ import annotations

import json
import os

from batchjob.io.identity import FULL_BYTES
from batchjob.job import model_identity, weight_digests


def _identity(folder):
    return model_identity.identity(model_identity.model_files(str(folder)), str(folder))


def test_a_same_size_edit_between_the_sampled_bytes_is_a_change(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    weights = folder / "model.safetensors"
    weights.write_bytes(os.urandom(FULL_BYTES + (8 << 20)))
    reads = []
    sha = weight_digests._sha256
    monkeypatch.setattr(weight_digests, "_sha256", lambda file: reads.append(file) or sha(file))
    before = _identity(folder)
    assert ":sampled:" in before["files"]["model.safetensors"] and len(reads) == 1
    assert _identity(folder) == before and len(reads) == 1  # unchanged: its digest is kept, not read again
    with open(weights, "r+b") as f:  # 4 KiB at 1.5 MiB + 1 KiB: between the first MiB and the next sample
        f.seek((3 << 19) + 1024)
        f.write(os.urandom(4096))
    after = _identity(folder)
    assert after["content"] == before["content"]  # the sampled digest does not see it
    assert (
        model_identity.changes(before, after)
        == "model files: model.safetensors changed (same size and sampled bytes)"
    )
    # a job recorded before the whole digests were: compared as it was
    old = {k: v for k, v in before.items() if k != "whole"}
    assert model_identity.changes(old, after) is None
