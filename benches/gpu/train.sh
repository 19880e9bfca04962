#!/usr/bin/env bash
# Issue 30 on the GPU machine in one call: trains variants of the default vision model
# (tiny LLaVA-1.5) side by side (a tiny model's step leaves the GPU idle most of the time;
# the CPU workers drawing scenes are the other bound), packs each directory under $OUT,
# then serves each with mmserve on the GPU in bf16 and measures held-out accuracy through
# /v1/chat/completions; also serves the shipped audio model (assets/models/qwen2-audio-clips)
# on the GPU in bf16 (clips as WAV: the machine has no soundfile; AUDIO=0 skips it).
#
#   VARIANTS="name:flags;name:flags" STEPS=5500 BATCH=96 bash benches/gpu/train.sh
#
# Each trainer stops by MAX_SECONDS (the machine's 10-minute limit on a command has to
# cover the serving and scoring too); STEPS is set to finish before it (three variants
# side by side took 93 ms a step on an H200, two should take about two thirds of that), so
# that the learning rate's schedule runs to its end.
set -uo pipefail
bin=.gpu/bin/mmserve
out="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
steps="${STEPS:-5500}" batch="${BATCH:-96}" max_seconds="${MAX_SECONDS:-400}"
variants="${VARIANTS:-lr5w2:--lr 5e-4 --patch-weight 2;lr10w2:--lr 1e-3 --patch-weight 2}"
IFS=';' read -ra list <<< "$variants"
names=()
for v in "${list[@]}"; do
  name="${v%%:*}" flags="${v#*:}"
  names+=("$name")
  # shellcheck disable=SC2086
  python3 tools/train/train_vision.py "/tmp/$name" --steps "$steps" --batch "$batch" --max-seconds "$max_seconds" \
    --eval 50 --workers 4 $flags \
    > "/tmp/train_$name.log" 2>&1 &
done
wait
port=18010
for name in "${names[@]}"; do
  echo "== $name: $(tail -n 1 "/tmp/train_$name.log")"
  # One log file back (the machine returns a few files only).
  { echo "== $name"; cat "/tmp/train_$name.log"; } >> "$out/train_logs.txt"
  tar -C /tmp -cf "$out/$name.tar" "$name"
  MMSERVE_LOG=warn $bin serve --model "/tmp/$name" --port $port --device cuda --dtype bfloat16 > "/tmp/serve_$name.log" 2>&1 &
  for _ in $(seq 60); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  timeout 120 python3 tools/train/eval_server.py --url "http://127.0.0.1:$port" --vision 500 --out "$out/gpu_$name.json" \
    || tail -n 20 "/tmp/serve_$name.log"
  port=$((port + 1))
done
[ "${AUDIO:-1}" = 1 ] || { kill $(jobs -p) 2>/dev/null; exit 0; }
echo "== audio (shipped) on the GPU, bf16"
MMSERVE_LOG=warn $bin serve --model assets/models/qwen2-audio-clips --port 18020 --device cuda --dtype bfloat16 \
  > /tmp/serve_audio.log 2>&1 &
for _ in $(seq 60); do curl -sf http://127.0.0.1:18020/health >/dev/null && break; sleep 1; done
timeout 60 python3 tools/train/eval_server.py --url http://127.0.0.1:18020 --audio 200 --wav-only || tail -n 30 /tmp/serve_audio.log
kill $(jobs -p) 2>/dev/null
