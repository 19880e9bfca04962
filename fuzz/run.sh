#!/usr/bin/env bash
# Runs every fuzz target under libFuzzer for SECONDS each (default 60), starting from
# the committed seeds. A crash fails the run; its input is left in
# fuzz/artifacts/<target>/: copy it to fuzz/regressions/<target>/ (which `cargo test`
# replays) and fix the code. cargo-fuzz is installed into target/tools if missing.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
tools="$(pwd)/../target/tools"
if ! command -v cargo-fuzz >/dev/null && [ ! -x "$tools/bin/cargo-fuzz" ]; then
  cargo install --locked --root "$tools" cargo-fuzz --version 0.13.2
fi
export PATH="$tools/bin:$PATH"
for target in image audio chat_request media_url; do
  mkdir -p "corpus/$target"
  echo "fuzzing $target for ${secs}s"
  # -rss_limit_mb: a target that allocates without bound is a crash too.
  cargo fuzz run -O -s none --jobs 1 "$target" "corpus/$target" "seeds/$target" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 2>&1 | tail -n 40
done
