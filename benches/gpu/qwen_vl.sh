#!/usr/bin/env bash
# Qwen-VL on the GPU machine, one call: the kernels' self-tests (the varlen flash kernel at
# head dim 80 among them), the tiny fixtures through `mmserve serve` against transformers'
# tokens, `mmserve bench model` at Qwen2.5-VL-7B's shapes (dummy bf16 weights; the vision
# tower also with flash attention off), transformers at the same shapes
# (hf_qwen_vl_baseline.py), and, with `e2e` as the argument, `mmserve bench engine` through
# the whole server with 64 image clients instead. Build first:
#   ../shared/gpu/build-cuda.sh build --bin mmserve --features cuda
set -uo pipefail
part=${1:-models}
bin=.gpu/bin/mmserve
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$part" = models ]; then
echo "== kernel self-tests (llava-tiny parity run, bf16)"
MMSERVE_LOG=warn timeout 120 $bin bench model --model assets/models/llava-tiny --device cuda --dtype bfloat16 --parity \
  --batches 1 --prompt 32 --output 8 --prefill 0 --images 1 --repeats 1 --json 2>&1 | grep -oE '"[a-z_]*(differs|differ|differs_for)":\[[^]]*\]'
echo "== Qwen-VL tiny fixtures through serve"
timeout 120 python3 benches/gpu/qwen_vl_smoke.py $bin 2>&1 | grep -E "identical|DIFFERENT|Error"
echo "== mmserve bench model, Qwen2.5-VL-7B shapes"
MMSERVE_LOG=warn timeout 200 $bin bench model --model assets/models/qwen2.5-vl-7b-instruct --load-format dummy \
  --device cuda --dtype bfloat16 --batches 1,8,64 --prompt 512 --output 128 --prefill 2048 --images 32 \
  --image-sizes 448,1024 --repeats 5 2>&1 | grep -vE '^\{"device'
echo "== the vision tower with flash attention off"
MMSERVE_LOG=warn timeout 90 $bin bench model --model assets/models/qwen2.5-vl-7b-instruct --load-format dummy \
  --no-flash-attention --device cuda --dtype bfloat16 --batches 0 --prefill 0 --images 32 --image-sizes 448,1024 \
  --repeats 3 2>&1 | grep vision
echo "== transformers"
timeout 200 python3 benches/gpu/hf_qwen_vl_baseline.py 448,1024 32 2>&1 | grep transformers
else
echo "== mmserve bench engine, Qwen2.5-VL-7B shapes, 64 image clients (distinct images, then again)"
python3 benches/gpu/stand_in_model.py /tmp/q25 qwen2.5-vl >/dev/null
MMSERVE_LOG=warn timeout 500 $bin bench engine --model /tmp/q25 --clients 1,64 --image-clients 64 --image-size 448 \
  --prompt-tokens 64 --output-tokens 64 --rounds 2 \
  --serve-arg=--load-format=dummy --serve-arg=--device=cuda --serve-arg=--dtype=bfloat16 \
  --serve-arg=--kv-cache-memory=40GiB 2>&1 | grep -vE "^\s*$|shutting down"
fi
