#!/usr/bin/env bash
# A/B of the vision tower's GPU switches at 32 images (llava-1.5-7b shapes, dummy bf16),
# each setting in its own process, on one machine:
# cuBLASLt algorithm timing, the flash kernel's warp-group count and pipelining. Same build as run.sh.
set -uo pipefail
bin=.gpu/bin/mmserve
vision() {
  env "$@" timeout 120 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy \
    --device cuda --dtype bfloat16 --batches 0 --prefill 0 --images ${IMAGES:-32} 2>&1 | grep -E "vision" \
    | sed "s|^|$* |"
}
vision MMSERVE_X=baseline
vision MMSERVE_GEMM_TUNE=0
vision MMSERVE_FLASH_WGMMA_GROUPS=1
vision MMSERVE_FLASH_WGMMA_PIPE=0
vision MMSERVE_FLASH_WGMMA_PIPE=0 MMSERVE_FLASH_WGMMA_GROUPS=1
vision MMSERVE_X=baseline-again
