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
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash measurements/gpu/check.sh [--rehearse]   (env: OUT, the results folder, default gpu-results)"
  exit 0
fi
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
if [ "${1:-}" != "--rehearse" ]; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
fi
"${PYTHON:-python}" measurements/gpu/check.py --out "$out" "$@"
rc=$?
tail -n 12 "$out"/*.txt
exit $rc
