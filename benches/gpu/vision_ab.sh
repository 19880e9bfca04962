#!/usr/bin/env bash
# A/B of the vision tower's kernel settings at 32 images (llava-1.5-7b shapes, dummy bf16),
# each setting in its own process, alternating, on one machine: cuBLASLt algorithm timing
# and our Hopper GEMM. Same build as run.sh.
set -uo pipefail
bin=.gpu/bin/mmserve
vision() {
  timeout 120 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy \
    --device cuda --dtype bfloat16 --batches 0 --prefill 0 --images ${IMAGES:-32} "$@" 2>&1 | grep -E "vision" \
    | sed "s|^|${*:-baseline} |"
}
vision
vision --gemm-tune-candidates 0
vision --no-gemm-wgmma
vision
