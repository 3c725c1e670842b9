"""llama.cpp as a baseline of ``batchjob bench``: the same workload through the tool CPU users pick today.

The programs come from ``examples/peers/llama_cpp.sh`` (built once from the llama.cpp that the
``llama-cpp-python`` source distribution vendors); the bench's model is converted to GGUF at the bench's
precision with llama.cpp's own converter and cached. Two ways to run a workload:

- ``llama-server`` (any workload): continuous batching over ``--parallel`` slots; every request is sent at once
  as token ids with its own ``n_predict``, greedy, EOS ignored, prompt cache off, and timed from the first
  submission to the last answer, like ours. Its tokens come back, so agreement is counted.
- ``llama-batched-bench`` (equal lengths only: a fixed ``--prompt-len`` and ``--output-len``): llama.cpp's own
  batched benchmark at ``-npp P -ntg G -npl N``; its reported time is used (it prints no tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from batchjob.bench.engines import Result
from batchjob.bench.workload import Workload
from batchjob.errors import ConfigError
from batchjob.models import cache_dir

BIN_ENV = "BATCHJOB_LLAMA_CPP"  # a folder holding llama-batched-bench, llama-server and llama-convert
BUILD_HINT = (
    "llama.cpp not found: build it once with `bash examples/peers/llama_cpp.sh` (a few minutes), or set "
    f"${BIN_ENV} to a folder holding llama-batched-bench, llama-server and llama-convert"
)
_GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # torch dtype -> GGUF and KV type


def bin_dir() -> Path | None:
    """Where the built programs are, or None (then the bench prints :data:`BUILD_HINT`)."""
    env = os.environ.get(BIN_ENV)
    folder = Path(env) if env else cache_dir() / "peers" / "llama.cpp" / "bin"
    needed = ("llama-batched-bench", "llama-server", "llama-convert")
    return folder if all(os.access(folder / n, os.X_OK) for n in needed) else None


def gguf_type(dtype: str) -> str:
    try:
        return _GGUF_TYPES[dtype]
    except KeyError:
        raise ConfigError(
            f"llama.cpp runs the bench at the same precision as ours: --dtype {dtype} has no GGUF twin "
            f"(use one of {', '.join(_GGUF_TYPES)})"
        ) from None


def _folder_key(folder: Path) -> str:
    """A cheap identity of a model folder: names, sizes and modification times of its files."""
    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def convert(model_dir: Path, dtype: str, bins: Path, progress: Any) -> Path:
    """The model as a GGUF file at ``dtype`` (converted once, then taken from the cache)."""
    outtype = gguf_type(dtype)
    target = (
        cache_dir()
        / "peers"
        / "llama.cpp"
        / "gguf"
        / f"{model_dir.name}-{_folder_key(model_dir)}-{outtype}.gguf"
    )
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        progress(f"converting {model_dir} to GGUF {outtype} with llama.cpp's converter ...")
        tmp = target.with_suffix(".partial")
        done = subprocess.run(
            [str(bins / "llama-convert"), str(model_dir), outtype, str(tmp)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable},  # its torch, numpy and transformers are ours
        )
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise ConfigError(f"llama.cpp's converter could not convert {model_dir} to GGUF:\n{tail}")
        tmp.rename(target)
    return target


def equal_shape(work: Workload) -> tuple[int, int] | None:
    """(prompt length, output length) when every request has the same ones, else None."""
    plens = {len(p) for p in work.prompts}
    olens = set(work.max_new_tokens)
    return (plens.pop(), olens.pop()) if len(plens) == 1 and len(olens) == 1 else None


def _ctx_for(slots: int, longest: int) -> int:
    return slots * (-(-longest // 256) * 256)  # every slot room for the longest request, in 256-token steps


def _reap(proc: subprocess.Popen, kill_after: float | None = None) -> float | None:
    """Wait for ``proc`` (killing it after ``kill_after`` seconds) and return its peak resident memory in MiB,
    which only the reaping wait reports (Linux and macOS; elsewhere None, as when it was reaped already)."""
    if proc.returncode is not None:
        return None
    if not hasattr(os, "wait4"):
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None
    deadline = None if kill_after is None else time.monotonic() + kill_after
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid == proc.pid:
            break
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            deadline = None
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB elsewhere


def _memory(peak_rss_mib: float | None, ctx: int, kv_token_bytes: int | None) -> dict[str, Any]:
    """The memory figures of a run: llama.cpp's own peak RSS, and its KV cache (``ctx`` tokens of
    ``kv_token_bytes``: every layer's K and V at the cache type)."""
    out: dict[str, Any] = {"peak_rss_mib": round(peak_rss_mib, 1) if peak_rss_mib else None}
    out["kv_mib"] = round(ctx * kv_token_bytes / 2**20, 1) if kv_token_bytes else None
    return out


def run_batched_bench(
    bins: Path, gguf: Path, work: Workload, dtype: str, threads: int, kv_token_bytes: int | None = None
) -> Result:
    """``kv_token_bytes``: the KV cache's bytes per token at ``dtype`` (for the memory figures)."""
    shape = equal_shape(work)
    assert shape is not None, "llama-batched-bench runs equal-length requests only"
    plen, olen = shape
    n = len(work.prompts)
    kv = gguf_type(dtype)
    ctx = _ctx_for(n, plen + olen)
    cmd = [
        str(bins / "llama-batched-bench"),
        *("-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512"),
        *("-npp", str(plen), "-ntg", str(olen), "-npl", str(n), "-t", str(threads), "-tb", str(threads)),
        *("-ctk", kv, "-ctv", kv, "--output-format", "jsonl"),
    ]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        peak = _reap(proc)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    settings = {"program": "batched-bench", "kv": kv}
    if proc.returncode != 0 or not rows:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        return Result("llama.cpp", settings, 0.0, work.prompt_tokens, work.output_tokens, [], error=tail)
    row = rows[-1]
    extra = {
        "prompt_seconds": row["t_pp"],
        "decode_seconds": row["t_tg"],
        **_memory(peak, ctx, kv_token_bytes),
    }
    return Result("llama.cpp", settings, float(row["t"]), work.prompt_tokens, work.output_tokens, [], extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_server(
    bins: Path,
    gguf: Path,
    work: Workload,
    dtype: str,
    threads: int,
    slots: int,
    kv_token_bytes: int | None = None,
) -> Result:
    """The workload through ``llama-server`` on loopback: every request submitted at once, timed to the last.
    ``kv_token_bytes``: the KV cache's bytes per token at ``dtype`` (for the memory figures)."""
    kv = gguf_type(dtype)
    slots = max(1, min(slots, len(work.prompts)))
    longest = max(len(p) + n for p, n in zip(work.prompts, work.max_new_tokens, strict=True))
    port = _free_port()
    ctx = _ctx_for(slots, longest)
    cmd = [
        str(bins / "llama-server"),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-kvu"),
        *("-c", str(ctx), "-b", "2048", "-ub", "512"),
        *("-t", str(threads), "-tb", str(threads), "-ctk", kv, "-ctv", kv, "--no-webui", "--no-cache-prompt"),
    ]
    settings = {"program": "server", "slots": slots, "kv": kv}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            tail = _wait_ready(proc, base, log)
            if tail is not None:
                return Result(
                    "llama.cpp", settings, 0.0, work.prompt_tokens, work.output_tokens, [], error=tail
                )
            outputs, wall = _timed_requests(base, work)
        finally:
            proc.terminate()
            peak = _reap(proc, kill_after=30)
    extra = _memory(peak, ctx, kv_token_bytes)
    return Result("llama.cpp", settings, wall, work.prompt_tokens, work.output_tokens, outputs, extra)


def _wait_ready(proc: subprocess.Popen, base: str, log: Any) -> str | None:
    """Wait for the server at ``base`` to be ready (None), or the last lines of its ``log`` if it exited;
    raises ConfigError after 300 s."""
    deadline = time.monotonic() + 300
    while True:  # the server answers /health with 503 while it loads the model
        if proc.poll() is not None:
            log.seek(0)
            return " | ".join(log.read().decode(errors="replace").strip().splitlines()[-3:])
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise ConfigError("llama-server did not become ready within 300 s")
        time.sleep(0.2)


def _complete(base: str, prompt: list[int], n: int) -> list[int]:
    """One request's ``n`` greedy tokens, EOS ignored, no prompt cache."""
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
    }
    return list(_post(base + "/completion", body, timeout=3600)["tokens"])


def _timed_requests(base: str, work: Workload) -> tuple[list[list[int]], float]:
    """A short warm-up, then every request of ``work`` at once: their tokens and the wall time to the last."""

    def one(prompt: list[int], n: int) -> list[int]:
        return _complete(base, prompt, n)

    warm = [list(range(1, 17)), list(range(2, 19))]
    with ThreadPoolExecutor(len(warm)) as pool:
        list(pool.map(one, warm, [4, 4]))
    with ThreadPoolExecutor(min(64, len(work.prompts))) as pool:
        start = time.perf_counter()
        outputs = list(pool.map(one, work.prompts, work.max_new_tokens))
        wall = time.perf_counter() - start
    return outputs, wall
