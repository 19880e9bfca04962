#!/usr/bin/env bash
# Finer GPU profiles than profile.sh, on the H200 after the same build (.gpu carried):
#   launches: per-launch durations of one vision batch of 32, grouped by kernel and grid
#             (cuBLAS runs one kernel name for several shapes), then one encoder layer's
#             launches in order; decode1: the same for
#             decode steps at batch 1 (decode8: 8); prefill: the same for a 2048-token prefill;
#   flash:    Nsight Compute's throughput, occupancy and stall sections for one launch of
#             each flash attention kernel (prefill over the pool, the encoder's).
# Usage: DETAIL="launches flash" bash benches/gpu/profile_detail.sh
set -uo pipefail
OUT=${OUT:-/tmp/mmserve-gpu}
mkdir -p "$OUT"
bin=.gpu/bin/mmserve
model=(--model assets/models/llava-1.5-7b-hf --load-format dummy --device cuda --dtype bfloat16 --repeats 0)
launches() {
  local name=$1; shift
  timeout 240 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
    "$bin" bench model "${model[@]}" "$@" > "$OUT/launches_$name.csv" 2> "$OUT/launches_$name.err"
  echo "== launches: $name"
  python3 - "$OUT/launches_$name.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if head is None:
    print("no rows"); sys.exit()
h = rows[head]
k, g, v, u = h.index("Kernel Name"), h.index("Grid Size"), h.index("Metric Value"), h.index("Metric Unit")
agg = collections.defaultdict(list)
for r in rows[head + 1:]:
    if len(r) <= v: continue
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}[r[u]]
    agg[(r[k][:60], r[g])].append(float(r[v].replace(",", "")) * scale)
tot = sorted(((sum(t), len(t), key) for key, t in agg.items()), reverse=True)
for t, n, (name, grid) in tot[:32]:
    print(f"{t/1e3:8.2f} ms {n:5d}x {t/n:8.1f} us  {grid:>16}  {name}")
# One layer in launch order: from the launch after the second flash attention launch's
# layer norm to the next (the second layer of the first forward pass).
seq = [(r[k][:60], r[g], float(r[v].replace(",", "")) * {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1,
       "ms": 1e3, "msecond": 1e3}[r[u]]) for r in rows[head + 1:] if len(r) > v]
flash = [i for i, x in enumerate(seq) if "flash" in x[0]]
if len(flash) >= 3:
    print("one layer, in launch order:")
    for name, grid, us in seq[flash[1]:flash[2]]:
        print(f"{us:9.1f} us  {grid:>16}  {name}")
    print(f"{sum(x[2] for x in seq[flash[1]:flash[2]]):9.1f} us  the layer")
PY
}
for d in ${DETAIL:-launches flash}; do
  case $d in
    launches) launches vision32 --batches 0 --prefill 0 --images 32 ;;
    decode1) launches decode1 --batches 1 --prompt 512 --output 4 --prefill 0 --images 0 ;;
    decode8) launches decode8 --batches 8 --prompt 512 --output 4 --prefill 0 --images 0 ;;
    prefill) launches prefill2048 --batches 0 --prefill 2048 --images 0 ;;
    flash)
      for spec in "flash_paged --batches 0 --prefill 2048 --images 0" "flash_dense --batches 0 --prefill 0 --images 32"; do
        set -- $spec; name=$1; shift
        echo "== $name"
        timeout 240 ncu --kernel-name "regex:$name" --launch-count 1 --section SpeedOfLight --section Occupancy \
          --section WarpStateStats --section ComputeWorkloadAnalysis "$bin" bench model "${model[@]}" "$@" 2>&1 \
          | grep -E "Duration|Throughput|Pipe|Occupancy|Registers|Stall|Warp Cycles|Issued|Eligible|Shared Memory Config" | head -40
      done
      ;;
  esac
done
