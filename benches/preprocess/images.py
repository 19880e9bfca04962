#!/usr/bin/env python3
"""The images the preprocessing benchmarks decode: a photo-like picture (smooth colour
fields plus fine noise, so it compresses like a photograph) at each size, as a JPEG
(quality 90) and a PNG. `compare.py` times them against transformers; the GPU session
(`benches/gpu/session.sh`) feeds them to `mmserve bench preprocess --threads`.

    python3 benches/preprocess/images.py DIR
"""

import os
import sys

import numpy as np
from PIL import Image

SIZES = [256, 512, 1024, 2048]


def photo(size, seed):
    """Smooth colour fields plus fine noise: compresses like a photograph."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + 2 * y), np.cos(5 * y - 3 * x), np.sin(4 * (x + y))], -1)
    img = (base * 0.4 + 0.5 + rng.normal(0, 0.04, (size, size, 3))).clip(0, 1)
    return Image.fromarray((img * 255).astype(np.uint8))


def write(d):
    """Writes `img{size}.jpg` and `img{size}.png` into `d`; returns [(path, size)]."""
    os.makedirs(d, exist_ok=True)
    files = []
    for size in SIZES:
        img = photo(size, size)
        for fmt, ext in (("JPEG", "jpg"), ("PNG", "png")):
            p = os.path.join(d, f"img{size}.{ext}")
            img.save(p, fmt, quality=90) if fmt == "JPEG" else img.save(p, fmt)
            files.append((p, size))
    return files


if __name__ == "__main__":
    write(sys.argv[1])
