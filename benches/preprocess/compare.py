#!/usr/bin/env python3
"""Preprocessing speed: mmserve against transformers' processors as users have them, on
the same inputs, single-threaded, in one run. With torch and torchvision installed (every
vLLM and SGLang installation) transformers 5 defaults to its torchvision image backend
and torch's STFT for Whisper; each row says which backend it timed: the default first,
then the PIL / numpy one. Run by hand (not in CI):

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install "transformers==5.24.*" \
        "torch==2.15.*" "torchvision==0.29.*" pillow numpy soundfile
    cargo build --release
    /tmp/hfenv/bin/python benches/preprocess/compare.py target/release/mmserve

Images: JPEG and PNG at 256², 512², 1024² and 2048² (photo-like content), through
CLIP-336 (LLaVA-1.5) and Qwen2-VL. Audio: 30 s of 16 kHz WAV through Whisper features
(128 mel bins). Each side decodes the bytes and preprocesses; the figure is items (or
seconds of audio) per second from the fastest of several runs after a warm-up, on both
sides; the ratio is mmserve over transformers.
"""

import io
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    CLIPImageProcessor,
    CLIPImageProcessorPil,
    Qwen2VLImageProcessor,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)
from transformers.models.whisper import feature_extraction_whisper  # noqa: E402

import images  # noqa: E402  (this directory's images.py)

torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = images.SIZES
REPEAT = {256: 40, 512: 20, 1024: 8, 2048: 4}


def make_inputs(d):
    files = images.write(d)
    t = np.arange(30 * 16000) / 16000
    wave = (0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.05 * np.random.default_rng(0).normal(size=t.size))
    audio = os.path.join(d, "speech30s.wav")
    sf.write(audio, wave.astype(np.float32), 16000, subtype="PCM_16")
    return files, audio


def best_of(n, work):
    """Seconds of the fastest of `n` runs after one warm-up: the statistic mmserve's
    `bench preprocess` reports, so that both sides are measured alike."""
    work()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best


def time_images(proc, files):
    per_size = {}
    for path, size in files:
        data = open(path, "rb").read()

        def work():
            img = Image.open(io.BytesIO(data)).convert("RGB")
            proc(images=img, return_tensors="np")

        per_size.setdefault(size, []).append(best_of(REPEAT[size], work))
    return per_size


def time_audio(fe, path, backend, n=20):
    """`backend` "torch" (the default with torch installed) or "numpy"."""
    data = open(path, "rb").read()
    feature_extraction_whisper.is_torch_available = lambda: backend == "torch"

    def work():
        wave, sr = sf.read(io.BytesIO(data), dtype="float32")
        fe(wave, sampling_rate=sr, return_tensors="np", return_attention_mask=True)

    return best_of(n, work)


def ours(binary, config, files, repeat):
    out = subprocess.run(
        [binary, "bench", "preprocess", "--preprocessor", config, "--repeat", str(repeat), "--json", *files],
        check=True, capture_output=True, text=True,
    ).stdout
    return {r["file"]: r["seconds"] for r in map(json.loads, out.splitlines())}


ROUNDS = 3


def main():
    """Each side runs ROUNDS times, alternating, and keeps its best time per input: the
    machine's background load shifts from minute to minute, and alternating exposes both
    sides to the same windows."""
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/mmserve"
    with tempfile.TemporaryDirectory() as d:
        files, audio = make_inputs(d)
        print(f"{'processor':<10} {'backend':<12} {'input':<14} {'transformers/s':>15} {'mmserve/s':>10} {'ratio':>7}")
        for name, backends, cfg in (
            ("clip-336", (("torchvision", CLIPImageProcessor), ("pil", CLIPImageProcessorPil)), "clip-336"),
            ("qwen2-vl", (("torchvision", Qwen2VLImageProcessor), ("pil", Qwen2VLImageProcessorPil)), "qwen2-vl"),
        ):
            cfg_path = os.path.join(HERE, "configs", cfg, "preprocessor_config.json")
            procs = [(b, cls(**json.load(open(cfg_path)))) for b, cls in backends]
            theirs, mine = {b: {} for b, _ in procs}, {}
            for _ in range(ROUNDS):
                for backend, proc in procs:
                    t = time_images(proc, files)
                    for (path, _), sec in zip(files, [x for size in SIZES for x in t[size]]):
                        theirs[backend][path] = min(theirs[backend].get(path, float("inf")), sec)
                for path, sec in ours(binary, cfg_path, [p for p, _ in files], 8).items():
                    mine[path] = min(mine.get(path, float("inf")), sec)
            for backend, _ in procs:
                tot_t = tot_m = 0.0
                for path, _ in files:
                    t, m = theirs[backend][path], mine[path]
                    tot_t += t
                    tot_m += m
                    print(f"{name:<10} {backend:<12} {os.path.basename(path):<14} {1 / t:>15.1f} {1 / m:>10.1f} {t / m:>7.2f}")
                print(f"{name:<10} {backend:<12} {'mix (all 8)':<14} {len(files) / tot_t:>15.1f} "
                      f"{len(files) / tot_m:>10.1f} {tot_t / tot_m:>7.2f}")
        cfg_path = os.path.join(HERE, "configs", "whisper-128", "preprocessor_config.json")
        fe = WhisperFeatureExtractor(**json.load(open(cfg_path)))
        t = {"torch": float("inf"), "numpy": float("inf")}
        m = float("inf")
        for _ in range(ROUNDS):
            for backend in t:
                t[backend] = min(t[backend], time_audio(fe, audio, backend))
            m = min(m, ours(binary, cfg_path, [audio], 20)[audio])
        for backend, sec in t.items():
            print(f"{'whisper':<10} {backend:<12} {'30 s WAV':<14} {30 / sec:>15.1f} {30 / m:>10.1f} {sec / m:>7.2f}"
                  "   (seconds of audio per second)")

if __name__ == "__main__":
    main()
