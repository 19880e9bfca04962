#!/usr/bin/env bash
# The encoder's pipeline on the GPU machine: time to first token for a burst of 64 new
# 336² images through `mmserve serve` (llava-1.5-7b's shapes, dummy bf16 weights), the
# build before the change (.gpu/bin/mmserve-base) and after (.gpu/bin/mmserve),
# alternating, in one call.
# Measured 2026-12-07 on an H100 80GB (16 cores), three calls, the first of each binary's
# first call left out as warm-up: TTFT median 1,058 ms before (975-1,143, five runs) and
# 926 ms after (825-1,031, six), p99 1,440 against 1,333, output 615 against 660 tok/s.
# The rest is the language model's prefill of 64 × 640 prompt tokens (41k tokens, about
# 1 s at the 2,048-token prefill rate of the README), which every request waits behind.
set -uo pipefail
python3 benches/gpu/stand_in_model.py /tmp/llava-1.5-7b-stand-in >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
nproc
for round in 1 2; do
  for bin in .gpu/bin/mmserve-base .gpu/bin/mmserve; do
    echo "== $bin (round $round)"
    MMSERVE_LOG=warn timeout 140 $bin bench engine --model /tmp/llava-1.5-7b-stand-in --clients 1 --rounds 1 \
      --prompt-tokens 64 --output-tokens 16 --image-clients 64 --repeats 0 \
      --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
      --serve-arg=--kv-cache-memory=32GiB --serve-arg=--max-running-requests=64 \
      --serve-arg=--chunked-prefill-size=8192 2>&1 | grep -E "new images|same images|burst|concurrent"
  done
done
