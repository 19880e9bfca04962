#!/usr/bin/env bash
# The figures of the security section: a release mmserve serve under hostile load
# (large texts, the disconnect storm, the overload burst, the admin flood, 1 Hz WAVs).
# Run from the repo root after `cargo build --release`: bash benches/hostile/measure.sh
set -u
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/mmserve}
start() { # model extra...
  local model=$1; shift
  MMSERVE_LOG=warn MMSERVE_ADMIN_TOKEN=tok $BIN serve --port 0 --admin-addr 127.0.0.1:0 --model $model "$@" > /tmp/serve.out 2>/tmp/serve.err &
  SERVE=$!
  for i in $(seq 1 600); do grep -q "mmserve: serving" /tmp/serve.out && break; sleep 0.1; done
  URL=$(grep "mmserve: serving" /tmp/serve.out | sed 's/.* at //' | awk '{print $1}')
  ADMIN=$(grep "admin listener at" /tmp/serve.out | sed 's/.* at //')
  API=$(pgrep -P $SERVE -f " api ")
}
stop() { kill $SERVE; wait $SERVE 2>/dev/null; }
hwm() { grep VmHWM /proc/$1/status | awk '{print $2/1024 " MiB"}'; }
start assets/models/llava-tiny
echo "url $URL admin $ADMIN api $API; api peak RSS at start: $(hwm $API)"
python3 - "$URL" <<'PY'
import json, sys, time, urllib.request
url = sys.argv[1]
for mb in (10, 50):
    body = json.dumps({"messages": [{"role": "user", "content": "a " * (mb << 19)}], "max_tokens": 1}).encode()
    t0 = time.monotonic()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=600)
        status = 200
    except urllib.error.HTTPError as e:
        status, msg = e.code, e.read()[:140]
    print(f"{mb} MB text: {status} in {time.monotonic() - t0:.2f} s: {msg}")
PY
echo "api peak RSS after the large texts: $(hwm $API)"
python3 benches/hostile/storm.py disconnect --url $URL --streams 300 --vanish 0.2
python3 benches/hostile/storm.py overload --url $URL --requests 2000
python3 benches/hostile/storm.py admin-flood --admin $ADMIN --connections 19000 --token tok --mmserve $BIN
stop
start assets/models/qwen2-audio-tiny
python3 - "$URL" <<'PY'
import base64, json, struct, sys, time, urllib.request
url = sys.argv[1]
def wav(rate, n):
    frames = b"".join(struct.pack("<h", (i * 37) % 20000 - 10000) for i in range(n))
    return b"RIFF" + struct.pack("<I", 36 + len(frames)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", len(frames)) + frames
clip = base64.b64encode(wav(1, 600)).decode()
parts = [{"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}} for _ in range(16)] + [{"type": "text", "text": "?"}]
body = json.dumps({"messages": [{"role": "user", "content": parts}], "max_tokens": 1}).encode()
t0 = time.monotonic()
try:
    urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"}), timeout=600)
    status, msg = 200, b""
except urllib.error.HTTPError as e:
    status, msg = e.code, e.read()[:160]
print(f"16 WAVs claiming 1 Hz ({len(body)} bytes): {status} in {time.monotonic() - t0:.3f} s: {msg}")
PY
stop
