#!/usr/bin/env bash
# Per-kernel GPU time of mmserve's prefill, vision batch and decode steps on the H200, by
# Nsight Compute (durations only, clocks left alone). Run there after benches/gpu/run.sh's
# build, with the .gpu folder carried: bash benches/gpu/profile.sh. Writes $OUT/profile_*.csv.
set -uo pipefail
OUT=${OUT:-/tmp/mmserve-gpu}
mkdir -p "$OUT"
bin=.gpu/bin/mmserve
model=(--model assets/models/llava-1.5-7b-hf --load-format dummy --device cuda --dtype bfloat16 --repeats 1)
prof() {
  local name=$1; shift
  timeout 240 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-summary per-kernel \
    "$bin" bench model "${model[@]}" "$@" > "$OUT/profile_$name.csv" 2> "$OUT/profile_$name.err"
  echo "== $name: $(grep -c . "$OUT/profile_$name.csv") lines"; tail -n 3 "$OUT/profile_$name.err"
  # Kernel name, invocations, total time (in the unit column's unit), top 12.
  python3 - "$OUT/profile_$name.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if head is None:
    print("no summary; first lines:"); [print(",".join(r)[:200]) for r in rows[:8]]; sys.exit()
h = rows[head]
k, inv, unit, avg = h.index("Kernel Name"), h.index("Invocations"), h.index("Metric Unit"), h.index("Average")
tot = []
for r in rows[head + 1:]:
    if len(r) <= avg: continue
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}[r[unit]]
    n = int(r[inv]); a = float(r[avg].replace(",", "")) * scale
    tot.append((n * a, n, r[k][:90]))
tot.sort(reverse=True)
total = sum(t for t, _, _ in tot)
print(f"total {total/1e3:.1f} ms over {sum(n for _, n, _ in tot)} launches")
for t, n, name in tot[:12]:
    print(f"{t/1e3:9.2f} ms {100*t/total:5.1f}% {n:6d}x  {name}")
PY
}
# PROFILES picks some of them, e.g. PROFILES=vision32 bash benches/gpu/profile.sh
for p in ${PROFILES:-prefill vision32 decode64}; do
  case $p in
    prefill) prof prefill --batches 0 --prefill 2048 --images 0 ;;
    vision32) prof vision32 --batches 0 --prefill 0 --images 32 ;;
    decode1) prof decode1 --batches 1 --prompt 512 --output 16 --prefill 0 --images 0 ;;
    decode64) prof decode64 --batches 64 --prompt 512 --output 4 --prefill 0 --images 0 ;;
  esac
done
