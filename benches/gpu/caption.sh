#!/usr/bin/env bash
# `mmserve caption` on the GPU machine: 1,000 distinct generated images (336² to 1024²)
# through the whole server at llava-1.5-7b's shapes (dummy bf16 weights, stand-in
# tokenizer), 64-token captions; the components it is bounded by, measured in the same
# call (`mmserve bench model`: the vision tower at 32 images, a prefill, decode at batch
# 64); and transformers' batched generate() on the same kind of images
# (hf_caption_baseline.py). Build first: ../shared/gpu/build-cuda.sh build --bin mmserve --features cuda
set -uo pipefail
bin=.gpu/bin/mmserve
nvidia-smi --query-gpu=name --format=csv,noheader
nproc
python3 benches/gpu/stand_in_model.py /tmp/llava-1.5-7b-stand-in >/dev/null
echo "== components (mmserve bench model)"
MMSERVE_LOG=warn timeout 150 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy \
  --device cuda --dtype bfloat16 --batches 64 --prompt 640 --output 64 --prefill 2048 --images 32 --repeats 3 2>&1 \
  | grep -E "decode|prefill|vision"
echo "== mmserve caption, 1,000 images"
MMSERVE_LOG=warn timeout 300 $bin bench caption --model /tmp/llava-1.5-7b-stand-in --images 1000 --sizes 336,1024 \
  --concurrency ${CONCURRENCY:-64,128} --max-tokens 64 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=48GiB --serve-arg=--max-running-requests=128 --serve-arg=--chunked-prefill-size=8192 2>&1 \
  | grep -vE "^\s*$|shutting down"
echo "== transformers"
timeout 240 python3 benches/gpu/hf_caption_baseline.py ${HF_IMAGES:-256} 32 2>&1 | tail -1
