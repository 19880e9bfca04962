#!/usr/bin/env python3
"""Hostile load against a running `mmserve serve` (stdlib only), for the figures of
README's security section:

  storm.py disconnect --url http://127.0.0.1:8000 --streams 300 --vanish 0.2
      300 streaming requests with distinct images at once; 20% of the clients close their
      socket 0-500 ms after sending. Prints what the server holds once it is idle.
  storm.py overload --url ... --requests 2000
      2,000 requests at once: how many are answered 200 and 429, latencies, and /health's
      latency during the burst.
  storm.py admin-flood --admin 127.0.0.1:8001 --connections 20000 --token T --mmserve PATH
      opens and closes 20,000 connections to the admin port, then times `mmserve cache stats`.
"""
import argparse, asyncio, base64, json, os, random, subprocess, sys, time, urllib.request

FIXTURE = os.path.join(os.path.dirname(__file__), "../../assets/models/llava-tiny/input.png")


def host_port(url):
    hp = url.split("//", 1)[1].split("/", 1)[0]
    h, p = hp.rsplit(":", 1)
    return h, int(p)


def body(i, stream, max_tokens=32):
    png = open(FIXTURE, "rb").read() + b"mmserve-storm-%d-%d" % (os.getpid(), i)  # distinct bytes after IEND
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return json.dumps({
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is shown?"}]}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}).encode()


async def request(url, payload, vanish_after=None):
    h, p = host_port(url)
    r, w = await asyncio.open_connection(h, p)
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(payload) + payload)
    await w.drain()
    t0 = time.monotonic()
    if vanish_after is not None:
        await asyncio.sleep(vanish_after)
        w.transport.abort()
        return None, time.monotonic() - t0
    data = await r.read()
    w.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1") else 0
    return status, time.monotonic() - t0


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out.setdefault(k.split("{", 1)[0], float(v))  # the first sample of a series
    return out


async def disconnect(a):
    tasks = []
    for i in range(a.streams):
        vanish = random.uniform(0, a.max_vanish_ms / 1000) if random.random() < a.vanish else None
        tasks.append(request(a.url, body(i, True), vanish))
    res = await asyncio.gather(*tasks, return_exceptions=True)
    done = sum(1 for r in res if isinstance(r, tuple) and r[0] == 200)
    vanished = sum(1 for r in res if isinstance(r, tuple) and r[0] is None)
    print(f"{a.streams} streams: {done} answered 200, {vanished} vanished, "
          f"{len(res) - done - vanished} other")
    deadline = time.monotonic() + 60
    keys = ["mmserve_embed_cache_references", "mmserve_embed_cache_waiting", "mmserve_num_requests_running",
            "mmserve_num_requests_waiting", "mmserve_queued_requests", "mmserve_kv_blocks_used"]
    while True:
        m = metrics(a.url)
        if all(m.get(k, 0) == 0 for k in keys) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    print("once idle: " + ", ".join(f"{k.removeprefix('mmserve_')}={int(m.get(k, -1))}" for k in keys))


async def overload(a):
    async def health_probe(stop):
        worst = 0.0
        while not stop.is_set():
            t0 = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: urllib.request.urlopen(a.url + "/health", timeout=30).read())
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.1)
        return worst
    stop = asyncio.Event()
    probe = asyncio.create_task(health_probe(stop))
    t0 = time.monotonic()
    res = await asyncio.gather(*[request(a.url, body(i, False, a.max_tokens)) for i in range(a.requests)],
                               return_exceptions=True)
    stop.set()
    worst = await probe
    by = {}
    for r in res:
        key = r[0] if isinstance(r, tuple) else type(r).__name__
        by.setdefault(key, []).append(r[1] if isinstance(r, tuple) else 0)
    for k, ls in sorted(by.items(), key=lambda kv: str(kv[0])):
        ls.sort()
        print(f"{k}: {len(ls)} (p50 {ls[len(ls) // 2]:.2f} s, max {ls[-1]:.2f} s)")
    print(f"burst took {time.monotonic() - t0:.1f} s; /health worst {worst * 1000:.0f} ms during it")


async def admin_flood(a):
    h, p = a.admin.rsplit(":", 1)
    opened = []
    for _ in range(a.connections):
        try:
            opened.append(await asyncio.open_connection(h, int(p)))
        except OSError:
            pass
    print(f"opened {len(opened)} of {a.connections} admin connections")
    for _, w in opened:
        w.transport.abort()
    t0 = time.monotonic()
    out = subprocess.run([a.mmserve, "cache", "--admin-addr", a.admin, "stats"],
                         env={**os.environ, "MMSERVE_ADMIN_TOKEN": a.token}, capture_output=True, text=True)
    print(f"cache stats after the flood: exit {out.returncode} in {time.monotonic() - t0:.2f} s")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("disconnect"); d.add_argument("--url", required=True)
    d.add_argument("--streams", type=int, default=300); d.add_argument("--vanish", type=float, default=0.2)
    d.add_argument("--max-vanish-ms", type=float, default=500)
    o = sub.add_parser("overload"); o.add_argument("--url", required=True)
    o.add_argument("--requests", type=int, default=2000); o.add_argument("--max-tokens", type=int, default=16)
    f = sub.add_parser("admin-flood"); f.add_argument("--admin", required=True)
    f.add_argument("--connections", type=int, default=20000); f.add_argument("--token", required=True)
    f.add_argument("--mmserve", default="target/release/mmserve")
    a = ap.parse_args()
    random.seed(1)
    asyncio.run({"disconnect": disconnect, "overload": overload, "admin-flood": admin_flood}[a.cmd](a))


if __name__ == "__main__":
    sys.exit(main())
