#!/usr/bin/env bash
# Before a GPU call: the GPU machine's own torch and transformers (older than ours: torch 2.11.0,
# transformers 5.17.0 on the H200 of 2026-12-04; its `versions` step prints them) in a venv here, and in it
# the CPU rehearsal plus, for real on the CPU, the engine, flex, GPU-file and family tests. The rehearsal
# alone hides missing packages, not older ones: the first H200 call failed on three calls that torch 2.11 and
# transformers 5.17 lack, all of which this finds. Takes a few minutes (torch 2.11 comes from this disk).
#   bash measurements/gpu/versions_venv.sh [VENV]    (env: TORCH, TRANSFORMERS: the versions; VENV default /tmp/gpu-versions)
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash measurements/gpu/versions_venv.sh [VENV]   (env: TORCH=2.11.0 TRANSFORMERS=5.17.0)"
  exit 0
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-/tmp/gpu-versions}
torch_v=${TORCH:-2.11.0}
transformers_v=${TRANSFORMERS:-5.17.0}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q "torch==$torch_v" "transformers==$transformers_v"
"$venv/bin/pip" install -q -e "$root[test]" "torch==$torch_v" "transformers==$transformers_v"
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
cd "$root"
PYTHON="$venv/bin/python" OUT="$(mktemp -d)" bash measurements/gpu/check.sh --rehearse
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/engine/test_engine.py tests/engine/test_flex.py \
    tests/engine/test_gpu.py tests/engine/test_families.py -k "not default_model"
