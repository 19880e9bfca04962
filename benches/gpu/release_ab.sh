#!/usr/bin/env bash
# The README's GPU figures before and after a change, in one call per part, on one
# machine: the build before (.gpu/bin/mmserve-base) and after (.gpu/bin/mmserve),
# alternating. `models`: fixture parity and every kernel's self-test (after), then
# `mmserve bench model` at llava-1.5-7b's shapes (dummy bf16). `e2e`: `mmserve bench
# engine` through `mmserve serve` (64 clients, one new 336² image each, then the same
# images again; the stand-in tokenizer of stand_in_model.py). Build both first, here:
#   ../shared/gpu/build-cuda.sh build --bin mmserve --features cuda   (in each checkout)
set -uo pipefail
part=${1:-models}
nvidia-smi --query-gpu=name --format=csv,noheader
bins=(.gpu/bin/mmserve-base .gpu/bin/mmserve .gpu/bin/mmserve-base .gpu/bin/mmserve)
if [ "$part" = models ]; then
  echo "== fixture parity and kernel self-tests on the GPU (after): f32, then bf16"
  for dtype in float32 bfloat16; do
    MMSERVE_LOG=warn timeout 120 .gpu/bin/mmserve bench model --model assets/models/llava-tiny --device cuda \
      --dtype $dtype --parity --batches 1 --prompt 32 --output 8 --prefill 256 --images 1,4 --repeats 3 --json \
      | grep -E "parity|kernel" | cut -c1-600
  done
  for bin in "${bins[@]}"; do
    echo "== $bin: llava-1.5-7b shapes"
    MMSERVE_LOG=warn timeout 150 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy \
      --device cuda --dtype bfloat16 --batches 1,8,64 --output 64 --prefill 2048 --images 1,32 --repeats 3 2>&1 \
      | grep -vE "^\s*$"
  done
else
  python3 benches/gpu/stand_in_model.py /tmp/llava-1.5-7b-stand-in >/dev/null
  for bin in "${bins[@]}"; do
    echo "== $bin: end to end"
    MMSERVE_LOG=warn timeout 130 $bin bench engine --model /tmp/llava-1.5-7b-stand-in --clients 64 --rounds 1 \
      --prompt-tokens 512 --output-tokens 128 --image-clients 64 --repeats 2 \
      --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
      --serve-arg=--kv-cache-memory=48GiB --serve-arg=--max-running-requests=64 \
      --serve-arg=--chunked-prefill-size=8192 2>&1 | grep -vE "^\s*$"
  done
fi
