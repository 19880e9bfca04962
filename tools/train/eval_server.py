#!/usr/bin/env python3
"""Accuracy of the default models measured through a running server (issue 30): held-out
scenes and clips (seeds the training never saw, questions drawn as the training scripts'
own evaluation draws them) sent to `/v1/chat/completions` as base64 uploads, greedy,
exact match per question type.

    python tools/train/eval_server.py --url http://127.0.0.1:8000 --vision-model M --vision 500
    python tools/train/eval_server.py --url http://127.0.0.1:8001 --audio-model M --audio 200
    python tools/train/eval_server.py --export tests/data/accuracy --vision 20 --audio 10

Scenes go as PNG or JPEG (by seed); clips at their seeded sample rate (8 to 48 kHz) as WAV,
FLAC or MP3 in turn where soundfile can write them, else all as WAV (`--wav-only` forces that).
`--export DIR` writes the items and `expected.json` instead of asking a server: the fixed set
the CI accuracy test replays. Needs numpy and Pillow; soundfile for FLAC and MP3.
"""

import argparse
import base64
import io
import json
import os
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clips  # noqa: E402
import scenes  # noqa: E402


def vision_items(n):
    """(files as (name, bytes, mime), question, answer, kind) for held-out scenes, drawn as
    train_vision.py's evaluation draws them."""
    rng = random.Random(7)
    for i in range(n):
        images, q, ans, kind = scenes.item(scenes.HELD_OUT + i, rng)
        files = []
        for k, (img, s, _) in enumerate(images):
            data = scenes.encode(img, s)
            mime = "image/png" if data[:4] == b"\x89PNG" else "image/jpeg"
            files.append((f"scene_{scenes.HELD_OUT + i}_{k}.{mime.split('/')[1]}", data, mime))
        yield files, q, ans, kind


def audio_items(n, wav_only):
    """Held-out clips at their seeded rates, in WAV, FLAC and MP3 in turn."""
    try:
        import soundfile  # noqa: F401
    except ImportError:
        wav_only = True
    rng = random.Random(7)
    for i in range(n):
        seed = clips.HELD_OUT + i
        samples, rate, facts = clips.clip(seed)
        kind, q, ans = rng.choice(clips.answers(facts))
        fmt = "wav" if wav_only else ["wav", "flac", "mp3"][i % 3]
        data = clips.encode(samples, rate, fmt)
        mime = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}[fmt]
        yield [(f"clip_{seed}.{fmt}", data, mime)], q, ans, kind


def ask(url, model, files, question, kind):
    parts = []
    for _, data, mime in files:
        b64 = base64.b64encode(data).decode()
        if mime.startswith("image/"):
            parts.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}})
        else:
            fmt = {"audio/wav": "wav", "audio/flac": "flac", "audio/mpeg": "mp3"}[mime]
            parts.append({"type": "input_audio", "input_audio": {"data": b64, "format": fmt}})
    parts.append({"type": "text", "text": question})
    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 48, "temperature": 0}
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["message"]["content"].strip()


def served_model(url):
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def score(url, model, items):
    model = model or served_model(url)
    right, total, misses = {}, {}, []
    t0 = time.time()
    items = list(items)
    # Sixteen requests in flight, as a server is used.
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda it: ask(url, model, it[0], it[1], it[3]), items))
    for (files, q, ans, kind), got in zip(items, answers):
        total[kind] = total.get(kind, 0) + 1
        right[kind] = right.get(kind, 0) + int(got == ans)
        if got != ans and len(misses) < 20:
            misses.append({"files": [f[0] for f in files], "question": q, "answer": ans, "got": got})
    n = sum(total.values())
    return {"items": n, "seconds": round(time.time() - t0, 1),
            "overall": round(sum(right.values()) / max(n, 1), 4),
            "per_kind": {k: {"right": right[k], "of": total[k], "accuracy": round(right[k] / total[k], 4)}
                         for k in sorted(total)},
            "misses": misses}


def export(out, vision, audio, wav_only):
    os.makedirs(out, exist_ok=True)
    expected = []
    for model, items in (("vision", vision_items(vision)), ("audio", audio_items(audio, wav_only))):
        for files, q, ans, kind in items:
            for name, data, _ in files:
                with open(os.path.join(out, name), "wb") as f:
                    f.write(data)
            expected.append({"model": model, "files": [f[0] for f in files], "question": q, "answer": ans,
                             "kind": kind})
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"{len(expected)} items in {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--vision-model", help="default: the first of /v1/models")
    ap.add_argument("--audio-model", help="default: the first of /v1/models")
    ap.add_argument("--vision", type=int, default=0)
    ap.add_argument("--audio", type=int, default=0)
    ap.add_argument("--wav-only", action="store_true")
    ap.add_argument("--export")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.export:
        return export(args.export, args.vision, args.audio, args.wav_only)
    report = {}
    if args.vision:
        report["vision"] = score(args.url, args.vision_model, vision_items(args.vision))
    if args.audio:
        report["audio"] = score(args.url, args.audio_model, audio_items(args.audio, args.wav_only))
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for name, r in report.items():
        per = ", ".join(f"{k} {v['accuracy']:.1%} ({v['right']}/{v['of']})" for k, v in r["per_kind"].items())
        print(f"{name}: {r['overall']:.1%} of {r['items']} in {r['seconds']} s: {per}")


if __name__ == "__main__":
    main()
