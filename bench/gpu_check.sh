#!/usr/bin/env bash
# The prepared GPU check (about 8 minutes on one H200), run from the repository root on a CUDA machine.
# In order of priority, each part under its own time limit so one failure leaves the others' figures:
#   1. ours vs trl on the trainer benchmark: the qwen2.5-0.5b shape, bf16, 16 prompts x G=8, 256 new tokens,
#      micro-batch 32, beta 0.04; ours with --kernels auto (the compiled, CUDA-graph decode step), completions
#      at the budget and at realistic lengths (--lengths full,realistic), with each step's real-token floor, and
#      one more step of each of our runs profiled (--profile: where the reference and update passes' time goes);
#   2. the CUDA-only tests (tests/test_gpu.py: compiled decode == eager greedy tokens, a bf16 training step);
#   2a. behaviour vs recomputed log-probs (bench/mismatch.py): the compiled bf16 decode's per-token log-probs
#      against the update's passes for the same tokens and weights, plain and auto kernels;
#   2b. ours without the shared-prompt passes (ours-unshared) at realistic lengths, profiled: what running each
#      group's prompt once buys in the reference and update passes;
#   2c. ours at realistic lengths with 8x the default log-prob chunk (1536 rows), profiled too: whether the
#      reference pass's distance from its floor is the chunks' count (each chunk is ~10 kernels over (c, V) values);
#   3. sampler throughput (16 prompts x G=8, 256 tokens): model.generate, ours plain, the kernel eager and compiled;
#   4. the FSDP2 path at world size one against the unwrapped one (bench/distributed.py: step time, memory);
#   5. memory and step time of the full fine-tune, 8-bit AdamW and LoRA r=16 at the 0.5B shape (bench/memory.py;
#      peft and bitsandbytes travel as wheels in .whl/ too);
#   6. vLLM against our compiled sampler (bench/vllm_bench.py): the qwen2.5-0.5b shape, bf16, 16 prompts x G=8 x 256 tokens,
#      tokens/s; then a vLLM server of that model on the trainer's GPU (--vllm-mode server): one weight push's seconds
#      through vLLM's CUDA IPC engine (NCCL cannot put the trainer and the server on one GPU), tokens/s over HTTP
#      against the colocated engine, and a push of moved weights that the server's log-probs must then follow
#      (PASS/FAIL); with a second GPU, the same with NCCL (trl's) and the server on GPU 1; needs vLLM for CUDA on the
#      machine (its wheel is too large to travel in .whl/): skipped, saying so, where `import vllm` fails.
# trl, datasets and their missing dependencies travel as wheels in .whl/ when the machine lacks them (see the
# device README; transformers travels too, so both sides run the version the CPU tests use): `bash
# bench/gpu_wheels.sh` here writes them, and the device call carries `.whl`.
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))  # the whole check; each part gets its own limit or what is left
left() { local rest=$((DEADLINE - SECONDS)); echo $(( rest < $1 ? (rest > 5 ? rest : 5) : $1 )); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD" || exit 1
else
  export PYTHONPATH="$PWD"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, transformers, trl; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"
timeout "$(left 380)" python3 bench/trainer.py --device cuda --shape qwen2.5-0.5b --steps 3 --repeats 1 \
  --sides ours,trl --lengths full,realistic --side-timeout 90 --profile "$OUT/profile" 2>&1 | tee "$OUT/trainer.txt"
timeout "$(left 110)" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
timeout "$(left 120)" python3 bench/mismatch.py --device cuda --shape qwen2.5-0.5b --precisions bf16 --kernels plain,auto \
  --dataset synthetic:64 --json "$OUT/mismatch.json" 2>&1 | tee "$OUT/mismatch.txt"
timeout "$(left 100)" python3 bench/trainer.py --device cuda --shape qwen2.5-0.5b --steps 3 --repeats 1 \
  --sides ours-unshared --lengths realistic --side-timeout 80 --profile "$OUT/profile-unshared" 2>&1 | tee "$OUT/trainer_unshared.txt"
timeout "$(left 100)" python3 bench/trainer.py --device cuda --shape qwen2.5-0.5b --steps 3 --repeats 1 --sides ours \
  --lengths realistic --chunk-size 1536 --side-timeout 80 --profile "$OUT/profile-chunk1536" 2>&1 | tee "$OUT/trainer_chunk.txt"
timeout "$(left 120)" python3 bench/sampler.py --device cuda --prompts 16 --repeats 2 2>&1 | tee "$OUT/sampler.txt"; echo "sampler exit ${PIPESTATUS[0]}" | tee -a "$OUT/sampler.txt"
timeout "$(left 120)" python3 bench/distributed.py --device cuda \
  --shape qwen2.5-0.5b --processes 1 --modes none,fsdp --steps 3 --prompts 16 --group 8 --micro-batch 32 \
  --new-tokens 256 2>&1 | tee "$OUT/fsdp.txt"
timeout "$(left 150)" python3 bench/memory.py --device cuda --shape qwen2.5-0.5b --setups full,full-8bit,lora \
  --prompts 16 --group 8 --micro-batch 32 --new-tokens 256 2>&1 | tee "$OUT/memory.txt"
if python3 -c "import vllm" >/dev/null 2>&1; then
  timeout "$(left 240)" python3 bench/vllm_bench.py --device cuda --shape qwen2.5-0.5b --precision bf16 --parts sampler,server \
    --weight-transfer ipc --prompts 16 --group 8 --new-tokens 256 --out "$OUT/vllm" 2>&1 | tee "$OUT/vllm.txt"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout "$(left 120)" python3 bench/vllm_bench.py --device cuda --shape qwen2.5-0.5b --precision bf16 --parts server \
      --weight-transfer nccl --server-devices 1 --prompts 16 --group 8 --new-tokens 256 --out "$OUT/vllm-nccl" 2>&1 \
      | tee -a "$OUT/vllm.txt"
  fi
else
  echo "vLLM is not installed on this machine: the vLLM comparison is skipped" | tee "$OUT/vllm.txt"
fi
echo "=== summary ==="; cat "$OUT/machine.txt"; grep -v " run: " "$OUT/trainer.txt" | tail -40
head -8 "$OUT"/profile/realistic-ours-0.txt 2>/dev/null; grep -A3 "s/step" "$OUT/trainer_unshared.txt" "$OUT/trainer_chunk.txt"
head -8 "$OUT"/profile-unshared/realistic-ours-unshared-0.txt 2>/dev/null
head -8 "$OUT"/profile-chunk1536/realistic-ours-0.txt 2>/dev/null
tail -3 "$OUT/gpu_tests.txt"; tail -3 "$OUT/mismatch.txt"; tail -6 "$OUT/sampler.txt"; tail -4 "$OUT/fsdp.txt"; tail -6 "$OUT/memory.txt"; tail -12 "$OUT/vllm.txt"
