#!/usr/bin/env bash
# Issue 34's serving figures on the GPU machine: `mmserve bench serve` against an mmserve
# serving llava-1.5-7b's shapes with dummy weights (stand_in_model.py): random-mm with one
# 336² image a request (distinct, then 50% repeated), 64 words in, 128 tokens out, EOS
# ignored; saturation (rate inf, 500 prompts) and Poisson rates 5, 10, 20 requests/s.
# Results as JSON under $OUT (bench compare reads them).
set -uo pipefail
bin=.gpu/bin/mmserve
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 benches/gpu/stand_in_model.py /tmp/llava-1.5-7b-stand-in >/dev/null
MMSERVE_LOG=warn $bin serve --model /tmp/llava-1.5-7b-stand-in --port 18000 --load-format dummy --device cuda \
  --dtype bfloat16 --kv-cache-memory 48GiB --max-running-requests 256 > /tmp/serve.log 2>&1 &
for _ in $(seq 120); do curl -sf http://127.0.0.1:18000/health >/dev/null && break; sleep 1; done
common=(--base-url http://127.0.0.1:18000 --dataset-name random-mm --random-mm-bucket-config '{(336, 336, 1): 1.0}'
  --random-input-len 64 --random-output-len 128 --ignore-eos --disable-tqdm --num-warmups 16)
for repeat in 0 0.5; do
  echo "== repeat ratio $repeat: saturation"
  timeout 120 $bin bench serve "${common[@]}" --random-mm-repeat-ratio $repeat --num-prompts 500 --request-rate inf \
    --seed 1 --save-result "$out/sat_$repeat.json" | grep -E "throughput|Median|P99|Failed"
  echo "== repeat ratio $repeat: Poisson 5, 10, 20 requests/s"
  timeout 200 $bin bench serve "${common[@]}" --random-mm-repeat-ratio $repeat --num-prompts 300 --sweep 5,10,20 \
    --seed 2 --slo ttft_p50=100,ttft_p99=300,tpot_p50=15 --save-result "$out/sweep_$repeat.json" \
    | grep -E "requests/s|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT|SLO|highest|Failed"
done
kill %1
