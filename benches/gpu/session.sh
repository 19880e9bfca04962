#!/usr/bin/env bash
# Everything this session needs from the GPU machine in one call of under 10 minutes, most
# important first (a part cut off by the limit leaves the ones before it): the kernels'
# self-tests, structured outputs' cost per token (bench engine --constrained), Qwen2.5-VL-7B's
# shapes end to end through serve, Qwen-VL through serve against transformers' tokens, and
# preprocessing's scaling over this machine's cores (bench preprocess --threads, the same
# images as benches/preprocess/compare.py). Parts measured before live in their own scripts:
# qwen_vl.sh (bench model against transformers at Qwen2.5-VL-7B's shapes) and caption.sh.
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
echo "== preprocessing threads: bench preprocess --threads on this machine's CPUs"
python3 benches/preprocess/images.py /tmp/pp
timeout 120 $bin bench preprocess --preprocessor benches/preprocess/configs/clip-336/preprocessor_config.json \
  --repeat 3 --threads 1,2,4,8,16 /tmp/pp/img*.jpg /tmp/pp/img*.png 2>&1 | grep threads
