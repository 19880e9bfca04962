#!/usr/bin/env bash
# One run on the GPU machine (see ../shared/gpu/README.md): parity of the fixture on
# the GPU, mmserve's model benchmark of llava-1.5-7b's shapes (dummy bf16 weights), and
# transformers' figures for the same model in the same call. Build first, here:
#   ../shared/gpu/build-cuda.sh build --bin mmserve --features cuda
# then run with the .gpu folder carried:  bash benches/gpu/run.sh [models|e2e]
# (no argument: both parts; a device call has 10 minutes, so one part a call).
set -uo pipefail
part=${1:-all}
case "$part" in all | models | e2e) ;; *) echo "usage: $0 [models|e2e]" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/mmserve-gpu}
mkdir -p "$OUT"
bin=.gpu/bin/mmserve
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$part" != e2e ]; then
echo "== fixture parity on the GPU (f32, then bf16)"
timeout 120 $bin bench model --model assets/models/llava-tiny --device cuda --dtype float32 --parity \
  --batches 1,8 --prompt 32 --output 8 --prefill 256 --images 1,4 --repeats 3
timeout 120 $bin bench model --model assets/models/llava-tiny --device cuda --dtype bfloat16 --parity \
  --batches 1 --prompt 32 --output 8 --prefill 0 --images 1 --repeats 3
echo "== seeded sampling: device draws (GPU) against the host sampler (CPU), fixture in f32"
timeout 200 python3 benches/gpu/sampling_check.py $bin
echo "== transformers' own bf16 error on the fixture (the floor for the bf16 line above)"
timeout 200 python3 benches/gpu/hf_bf16_error.py 2>/dev/null | tail -1
echo "== llava-1.5-7b shapes, dummy bf16 weights"
timeout 420 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy --device cuda \
  --dtype bfloat16 --json | tee "$OUT/mmserve_llava7b.jsonl"
echo "== the same prefill and vision tower with flash attention off (the GEMM-and-softmax path)"
timeout 200 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy --no-flash-attention \
  --device cuda --dtype bfloat16 --batches 0 --images 1,32 2>&1 | grep -E "prefill|vision"
echo "== the vision tower with cuBLASLt and the pass for fc1 + quick_gelu and the projector (gemm_wgmma.cu off)"
timeout 120 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy --no-gemm-wgmma \
  --device cuda --dtype bfloat16 --batches 0 --prefill 0 --images 32 2>&1 | grep -E "vision"
echo "== the vision tower with cuBLASLt's first algorithms (no timing of candidates)"
timeout 120 $bin bench model --model assets/models/llava-1.5-7b-hf --gemm-tune-candidates 0 \
  --load-format dummy --device cuda --dtype bfloat16 --batches 0 --prefill 0 --images 32 2>&1 | grep -E "vision"
echo "== transformers, same model, same machine"
timeout 420 python3 benches/gpu/hf_llava_baseline.py
fi
[ "$part" = models ] && exit 0
echo "== end to end through mmserve serve, llava-1.5-7b shapes (dummy bf16, stand-in tokenizer)"
python3 benches/gpu/stand_in_model.py /tmp/llava-1.5-7b-stand-in >/dev/null
timeout 560 $bin bench engine --model /tmp/llava-1.5-7b-stand-in --clients 1,64 --rounds 1 \
  --prompt-tokens 512 --output-tokens 128 --image-clients 64 --repeats 5 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=48GiB --serve-arg=--max-running-requests=64 \
  --serve-arg=--chunked-prefill-size=8192 | tee "$OUT/mmserve_e2e.txt"
echo "== the same, text only, sampled (temperature 0.8, top-p 0.95: drawn on the device)"
timeout 300 $bin bench engine --model /tmp/llava-1.5-7b-stand-in --clients 1,64 --rounds 1 \
  --prompt-tokens 512 --output-tokens 128 --repeats 0 --temperature 0.8 --top-p 0.95 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=48GiB --serve-arg=--max-running-requests=64 \
  --serve-arg=--chunked-prefill-size=8192 | tee "$OUT/mmserve_e2e_sampled.txt"
