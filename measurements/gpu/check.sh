#!/usr/bin/env bash
# The prepared first run on a machine with a CUDA GPU and no package registry or network: the GPU tests, the
# family matrix in bf16 against HF generate, the engine tests, `batchjob bench --device cuda` (with its
# roofline line) on a random-weight model at Qwen2.5-0.5B's shape built there, torch's varlen attention,
# and tensor parallelism with two or more GPUs. Each step writes ${OUT:-gpu-results}/<step>.txt; the
# timeouts add up to at most 540 s, so the whole fits one 10-minute call. Nothing is installed: the project
# runs from this checkout on PYTHONPATH; the wheels the machine lacks come from .whl/ (bash
# measurements/gpu/wheels.sh, here, once; carry .whl/ with the command). The steps are in check.py.
#   bash measurements/gpu/check.sh              (on the GPU machine)
#   bash measurements/gpu/check.sh --rehearse   (here, on the CPU: the same steps, the CUDA ones skipped)
#   bash measurements/gpu/check.sh --pack [...] (results as $OUT/gpu-results.tar.gz + summary.txt: for a tool
#                                                that brings back at most a few files, such as 8)
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash measurements/gpu/check.sh [--pack] [--rehearse] [--only STEPS]   (env: OUT, the results folder, default gpu-results)"
  exit 0
fi
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
pack=()
if [ "${1:-}" = "--pack" ]; then  # every file in one: $OUT/gpu-results.tar.gz, and summary.txt beside it
  shift
  pack=(--pack "$out/gpu-results.tar.gz")
  keep=$out
  out=$(mktemp -d)/gpu-results
fi
mkdir -p "$out"
if [ "${1:-}" != "--rehearse" ]; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
fi
"${PYTHON:-python}" measurements/gpu/check.py --out "$out" "${pack[@]}" "$@"
rc=$?
tail -n 12 "$out"/*.txt
if [ ${#pack[@]} -gt 0 ]; then
  cp "$out/summary.txt" "$keep/"
fi
exit $rc
