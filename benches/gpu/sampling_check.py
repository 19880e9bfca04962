#!/usr/bin/env python3
"""Seeded sampling through `mmserve serve` on the GPU against the CPU, on the fixture
in f32 (logits agree to ~1e-6): the GPU draws on the device (kernels/sampling.cu), the
CPU with the host sampler, so equal texts say the two make the same choices.
Usage: python3 benches/gpu/sampling_check.py .gpu/bin/mmserve"""
import json
import os
import subprocess
import sys
import urllib.request

BIN = sys.argv[1]
MODEL = "assets/models/llava-tiny"
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 20},
    {"temperature": 0.9, "min_p": 0.05, "top_p": 0.95},
]


def serve(device):
    p = subprocess.Popen(
        [BIN, "serve", "--model", MODEL, "--port", "0", "--device", device, "--dtype", "float32"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "MMSERVE_LOG": "warn"})
    for line in p.stdout:  # the server's ready line names its address
        if line.startswith("mmserve: serving "):
            return p, line.split(" at ")[1].strip()
    raise SystemExit(f"serve on {device} exited before it was ready")


def texts(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        name = json.load(r)["data"][0]["id"]
    out = []
    for s in SETTINGS:
        for seed in range(8):
            body = {"model": name, "max_tokens": 24, "seed": seed, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Tell me a story about a cat."}], **s}
            req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out.append(json.load(r)["choices"][0]["message"]["content"])
    return out


results = {}
for device in ["cpu", "cuda"]:
    proc, url = serve(device)
    try:
        results[device] = texts(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
same = sum(a == b for a, b in zip(results["cpu"], results["cuda"]))
print(f"seeded sampling, GPU (device draws) against CPU (host sampler): {same}/{len(results['cpu'])} identical")
