#!/usr/bin/env bash
# The prepared GPU check (about 10 minutes on one H200), run from the repository root on a CUDA machine:
#   sampler throughput (Qwen2.5-0.5B shape, bf16, 64 prompts x G=8, 256 tokens; eager vs compiled decode),
#   ours vs trl on the trainer benchmark (16 prompts x G=8, 256 tokens, bf16), and the CUDA-only tests.
# trl and datasets travel as wheels in .whl/ when the machine lacks them (see the device README).
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 240 python3 bench/sampler.py --device cuda --repeats 3 2>&1 | tee "$OUT/sampler.txt"
timeout 300 python3 bench/trainer.py --device cuda --shape qwen2.5-0.5b --steps 3 --repeats 1 2>&1 | tee "$OUT/trainer.txt"
