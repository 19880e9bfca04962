#!/usr/bin/env bash
# Issue 30 on the GPU machine in one call: trains the default vision model (tiny LLaVA-1.5)
# and audio model (tiny Qwen2-Audio) side by side (the GPU is idle most of a tiny model's
# step; the CPU workers drawing scenes and clips are the bound), packs each directory under
# $OUT, then serves each with mmserve on the GPU in bf16 and measures held-out accuracy
# through /v1/chat/completions (clips as WAV: the machine has no soundfile).
set -uo pipefail
bin=.gpu/bin/mmserve
out="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
vsteps="${VSTEPS:-5000}" asteps="${ASTEPS:-3000}"
python3 tools/train/train_vision.py /tmp/vision --steps "$vsteps" --eval 200 --workers 4 > "$out/train_vision.log" 2>&1 &
python3 tools/train/train_audio.py /tmp/audio --steps "$asteps" --eval 100 --workers 11 > "$out/train_audio.log" 2>&1 &
wait
tail -3 "$out/train_vision.log" "$out/train_audio.log"
tar -C /tmp -cf "$out/vision.tar" vision
tar -C /tmp -cf "$out/audio.tar" audio
echo "== accuracy through mmserve serve on the GPU, bf16"
for m in vision:18001 audio:18002; do
  MMSERVE_LOG=warn $bin serve --model "/tmp/${m%%:*}" --port "${m##*:}" --device cuda --dtype bfloat16 \
    --kv-cache-memory 4GiB > "/tmp/serve_${m%%:*}.log" 2>&1 &
done
for p in 18001 18002; do
  for _ in $(seq 60); do curl -sf "http://127.0.0.1:$p/health" >/dev/null && break; sleep 1; done
done
timeout 150 python3 tools/train/eval_server.py --url http://127.0.0.1:18001 --vision 500 --out "$out/gpu_vision.json"
timeout 100 python3 tools/train/eval_server.py --url http://127.0.0.1:18002 --audio 200 --wav-only --out "$out/gpu_audio.json"
tail -3 /tmp/serve_vision.log /tmp/serve_audio.log
kill $(jobs -p) 2>/dev/null
