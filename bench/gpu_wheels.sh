#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the lent GPU machine, which has torch, accelerate, peft and pandas but no
# package registry, trl, datasets or bitsandbytes, and an older transformers. Run here (where pip reaches the
# registries), from the repository root; then run the check with `.whl` carried:
#   bash bench/gpu_wheels.sh            # writes .whl/ (ignored by git; it must stay under the 64 MiB a call carries)
#   device run: bash bench/gpu_check.sh   with carry [".whl"], timeout 600 s
# The versions are the ones the CPU tests install (pyproject.toml's parity extra and this venv): both sides of the
# benchmark then run the code the parity suite checks. huggingface_hub stays the machine's (transformers needs
# >= 1.31; the newer one here needs httpx2, which is not there).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for package in trl==1.16.0 transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 \
               bitsandbytes==0.50.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl "$package"
done
ls -l .whl && du -sh .whl
