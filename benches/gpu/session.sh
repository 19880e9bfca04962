#!/usr/bin/env bash
# Everything this session needs from the GPU machine in one call of under 10 minutes, most
# important first (a part cut off by the limit leaves the ones before it): the kernels'
# self-tests, structured outputs' cost per token (bench engine --constrained), Qwen-VL through serve against transformers' tokens, Qwen2.5-VL-7B's shapes
# in `mmserve bench model` beside transformers' vision tower, then `mmserve caption` on
# 1,000 images at llava-1.5-7b's shapes with its component bound and transformers'
# batched generate. The full scripts: qwen_vl.sh and caption.sh.
set -uo pipefail
bin=.gpu/bin/mmserve
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel self-tests"
MMSERVE_LOG=warn timeout 60 $bin bench model --model assets/models/llava-tiny --device cuda --dtype bfloat16 --parity \
  --batches 1 --prompt 32 --output 8 --prefill 0 --images 1 --repeats 1 --json 2>&1 \
  | grep -oE '"[a-z_]*(differs|differ|differs_for)":\[[^]]*\]|"greedy[a-z_]*":[a-z]*'
echo "== structured outputs: bench engine at Qwen2.5-VL-7B's shapes with the real Qwen2 vocabulary"
python3 benches/gpu/stand_in_model.py /tmp/qwen25 qwen2.5-vl >/dev/null
gunzip -c assets/tokenizers/qwen2_real/tokenizer.json.gz > /tmp/qwen25/tokenizer.json
MMSERVE_LOG=warn timeout 150 $bin bench engine --model /tmp/qwen25 --clients 1,64 --constrained 0,50,100 \
  --prompt-tokens 128 --output-tokens 64 --rounds 2 --repeats 0 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=40GiB 2>&1 | grep -vE "^\s*$|shutting down"
echo "== Qwen2.5-VL-7B shapes end to end: 64 requests with distinct images, then the same again"
MMSERVE_LOG=warn timeout 150 $bin bench engine --model /tmp/qwen25 --clients 1 --image-clients 64 \
  --prompt-tokens 64 --output-tokens 128 --rounds 1 --repeats 0 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=40GiB 2>&1 | grep -vE "^\s*$|shutting down"
echo "== Qwen-VL tiny fixtures through serve"
timeout 90 python3 benches/gpu/qwen_vl_smoke.py $bin 2>&1 | grep -E "identical|DIFFERENT|Error"
echo "== mmserve bench model, Qwen2.5-VL-7B shapes"
MMSERVE_LOG=warn timeout 150 $bin bench model --model assets/models/qwen2.5-vl-7b-instruct --load-format dummy \
  --device cuda --dtype bfloat16 --batches 1,8,64 --prompt 512 --output 64 --prefill 2048 --images 32 \
  --image-sizes 448,1024 --repeats 3 2>&1 | grep -vE '^\{"device'
echo "== transformers vision tower, same shapes"
timeout 100 python3 benches/gpu/hf_qwen_vl_baseline.py 448,1024 32 vision 2>&1 | grep transformers
echo "== caption components (llava-1.5-7b shapes)"
python3 benches/gpu/stand_in_model.py /tmp/llava-1.5-7b-stand-in >/dev/null
MMSERVE_LOG=warn timeout 90 $bin bench model --model assets/models/llava-1.5-7b-hf --load-format dummy \
  --device cuda --dtype bfloat16 --batches 64 --prompt 640 --output 64 --prefill 2048 --images 32 --repeats 3 2>&1 \
  | grep -E "decode|prefill|vision"
echo "== mmserve caption, 1,000 images"
MMSERVE_LOG=warn timeout 150 $bin bench caption --model /tmp/llava-1.5-7b-stand-in --images 1000 --sizes 336,1024 \
  --concurrency 64 --max-tokens 64 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=48GiB --serve-arg=--max-running-requests=128 --serve-arg=--chunked-prefill-size=8192 2>&1 \
  | grep -vE "^\s*$|shutting down|^\{"
echo "== transformers generate, 128 images"
timeout 100 python3 benches/gpu/hf_caption_baseline.py 128 32 2>&1 | tail -1
