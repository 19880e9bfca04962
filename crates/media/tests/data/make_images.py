#!/usr/bin/env python3
"""Makes the image parity fixtures of mmserve-media (run by hand; tests never run Python).

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install transformers pillow numpy safetensors
    /tmp/hfenv/bin/python crates/media/tests/data/make_images.py

Writes, next to this script:
- images/<name>.<ext>: small test images of every format and mode the server decodes, many
  hand-assembled (PNG chunks, GIF blocks, BMP headers) so that each feature is exercised on purpose;
- image_cases.json: per image its format and the size transformers sees (after EXIF rotation), the
  processor configs, which processor runs on which image, and a table of Qwen `smart_resize` answers;
- image_expected.safetensors: per image the RGB array transformers' processors start from
  (`load_image` = `PIL.Image.open` -> `ImageOps.exif_transpose` -> `convert("RGB")`, then the
  processor's own `convert_to_rgb`), and per processor run its `pixel_values`, stored losslessly as
  uint8 levels plus the [channels, 256] float32 table that maps a level to transformers' value (the
  script checks that the table reproduces every value bit for bit); for Qwen2-VL only the first of
  the (identical, checked) temporal copies of each patch is stored.
"""

import base64
import io
import json
import math
import random
import struct
import zlib
from pathlib import Path

import numpy as np
import PIL
import transformers
from PIL import Image, ImageOps
from safetensors.numpy import save_file
from transformers.image_transforms import convert_to_rgb
from transformers.image_transforms import normalize as np_normalize
from transformers.image_transforms import rescale as np_rescale
from transformers.image_utils import load_image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

HERE = Path(__file__).resolve().parent
IMAGES = HERE / "images"
REPO = HERE.parents[3]

cases = []  # image cases, in order
expected = {}  # name -> np.ndarray for the safetensors file
rgb_of = {}  # image name -> what the processor starts from


def pattern(w, h, seed=0):
    """Smooth gradients, a sine, noise and a sharp rectangle: detail at every frequency."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), 128 + 100 * np.sin(x / 3.0 + y / 5.0)], -1)
    img += rng.normal(0, 14, (h, w, 3))
    img[h // 4 : h // 2, w // 3 : w // 2] = [250, 30, 60]
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------- writers


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(w, h, color_type, depth, rows, before=(), after=(), plte=None, trns=None):
    """A PNG from raw scanlines (filter 0); `before`/`after`: extra (kind, data) chunks around IDAT."""
    out = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 0))
    for kind, data in before:
        out += png_chunk(kind, data)
    if plte is not None:
        out += png_chunk(b"PLTE", plte)
    if trns is not None:
        out += png_chunk(b"tRNS", trns)
    out += png_chunk(b"IDAT", zlib.compress(b"".join(b"\0" + r for r in rows), 9))
    for kind, data in after:
        out += png_chunk(kind, data)
    return out + png_chunk(b"IEND", b"")


def pack_bits(values, depth):
    """One scanline of `depth`-bit samples, most significant first."""
    out, acc, n = bytearray(), 0, 0
    for v in values:
        acc = (acc << depth) | int(v)
        n += depth
        if n == 8:
            out.append(acc)
            acc, n = 0, 0
    if n:
        out.append(acc << (8 - n))
    return bytes(out)


def pil_bytes(im, fmt, **kw):
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def gif(width, height, frames, global_palette=None, background=0):
    """A GIF. frames: dicts with idx (2-D uint8), x, y, palette (local), transparency, interlace."""
    out = bytearray(b"GIF89a" + struct.pack("<HH", width, height))

    def palette_bits(p):
        n = len(p) // 3
        bits = max(1, math.ceil(math.log2(max(n, 2))))
        return bits, p + b"\0" * (3 * (1 << bits) - len(p))

    if global_palette is not None:
        bits, p = palette_bits(global_palette)
        out += bytes([0x80 | (bits - 1), background, 0]) + p
    else:
        out += bytes([0, 0, 0])
    for f in frames:
        if f.get("transparency") is not None or len(frames) > 1:
            t = f.get("transparency")
            out += bytes([0x21, 0xF9, 4, (1 if t is not None else 0) | (1 << 2), 10, 0, t or 0, 0])
        idx = f["idx"]
        h, w = idx.shape
        flags = 0x40 if f.get("interlace") else 0
        local = b""
        if f.get("palette") is not None:
            bits, local = palette_bits(f["palette"])
            flags |= 0x80 | (bits - 1)
        out += b"," + struct.pack("<HHHH", f.get("x", 0), f.get("y", 0), w, h) + bytes([flags]) + local
        rows = list(range(h))
        if f.get("interlace"):
            rows = list(range(0, h, 8)) + list(range(4, h, 8)) + list(range(2, h, 4)) + list(range(1, h, 2))
        out += bytes([8]) + sub_blocks(lzw([int(v) for r in rows for v in idx[r]]))
    return bytes(out + b";")


def lzw(values):
    """GIF LZW with 8-bit minimum code size: literal codes only, and a clear code often enough
    that the code width stays at 9 bits (valid, if not compact)."""
    codes = [256]
    for i, v in enumerate(values):
        if i and i % 200 == 0:
            codes.append(256)
        codes.append(v)
    codes.append(257)
    acc, n, out = 0, 0, bytearray()
    for c in codes:
        acc |= c << n
        n += 9
        while n >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            n -= 8
    if n:
        out.append(acc)
    return bytes(out)


def sub_blocks(data):
    return b"".join(bytes([len(data[i : i + 255])]) + data[i : i + 255] for i in range(0, len(data), 255)) + b"\0"


def bmp(w, h, bpp, pixel_rows, masks=None, palette=b"", top_down=False):
    """A BMP (BITMAPINFOHEADER; BI_BITFIELDS when `masks`): rows bottom-up unless top_down."""
    stride = (w * bpp + 31) // 32 * 4
    rows = [r + b"\0" * (stride - len(r)) for r in pixel_rows]
    if not top_down:
        rows = rows[::-1]
    data = b"".join(rows)
    extra = b"".join(struct.pack("<I", m) for m in masks) if masks else b""
    header = struct.pack("<IiiHHIIiiII", 40, w, -h if top_down else h, 1, bpp, 3 if masks else 0, len(data), 2835, 2835, len(palette) // 4, 0)
    offset = 14 + len(header) + len(extra) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + header + extra + palette + data


def exif(orientation, big_endian=False):
    e = Image.Exif()
    if orientation is not None:
        e[0x0112] = orientation
    e[0x010F] = "mmserve"
    b = e.tobytes()
    if big_endian:
        # Pillow writes little-endian; hand-assemble a big-endian IFD0 with one SHORT.
        b = b"MM\0*\0\0\0\x08\0\x01" + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + b"\0\0\0\0"
    return b


def xmp(orientation, attribute=True):
    body = f'tiff:Orientation="{orientation}"' if attribute else f"<tiff:Orientation>{orientation}</tiff:Orientation>"
    return (
        '<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?><x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF '
        'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
        + (body + " />" if attribute else ">" + body + "</rdf:Description>")
        + "</rdf:RDF></x:xmpmeta>"
    ).encode()


def jpeg_insert(data, segments):
    """Inserts APPn segments (marker, payload) right after SOI."""
    seg = b"".join(b"\xff" + bytes([m]) + struct.pack(">H", len(p) + 2) + p for m, p in segments)
    return data[:2] + seg + data[2:]


ZIGZAG = [0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14,
          21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60,
          61, 54, 47, 55, 62, 63]


def jpeg_encode(width, height, planes, factors, ids, app=(), restart=0, quant=None):
    """A baseline JPEG from component planes at their own resolution (any sampling factors),
    for layouts Pillow does not write. Huffman tables: every DC category in 4 bits, every AC
    symbol in 8 bits (valid, not compact)."""
    max_h, max_v = max(f[0] for f in factors), max(f[1] for f in factors)
    mcus_x, mcus_y = -(-width // (8 * max_h)), -(-height // (8 * max_v))
    q = np.array(quant if quant is not None else [max(1, (i * 7 + 5) // 4) for i in range(64)], dtype=np.int64)
    u = np.arange(8)
    basis = np.cos((2 * u[:, None] + 1) * u[None, :] * np.pi / 16) * np.where(u == 0, np.sqrt(0.5), 1.0)[None, :] / 2
    blocks = []
    for plane, (h, v) in zip(planes, factors):
        ph, pw = mcus_y * v * 8, mcus_x * h * 8
        padded = np.pad(plane.astype(np.float64), ((0, ph - plane.shape[0]), (0, pw - plane.shape[1])), mode="edge") - 128
        coefs = np.einsum("yu,xv,byax->bauv", basis, basis, padded.reshape(ph // 8, 8, pw // 8, 8).transpose(0, 1, 2, 3))
        blocks.append(np.rint(coefs.reshape(ph // 8, pw // 8, 64) / q[np.array(range(64))]).astype(np.int64))
    dc_vals, ac_vals = list(range(12)), [0x00, 0xF0] + [(r << 4) | s for r in range(16) for s in range(1, 11)]
    dc_code = {v: (i, 4) for i, v in enumerate(dc_vals)}
    ac_code = {v: (i, 8) for i, v in enumerate(ac_vals)}
    bits = []

    def put(value, n):
        bits.extend((value >> (n - 1 - i)) & 1 for i in range(n))

    def category(x):
        return int(abs(x)).bit_length()

    def amplitude(x, s):
        return x if x >= 0 else x + (1 << s) - 1

    out = bytearray()

    def flush_bits():
        nonlocal bits
        bits += [1] * (-len(bits) % 8)
        for i in range(0, len(bits), 8):
            byte = int("".join(map(str, bits[i : i + 8])), 2)
            out.append(byte)
            if byte == 0xFF:
                out.append(0)
        bits = []

    last = [0] * len(planes)
    mcu = 0
    for my in range(mcus_y):
        for mx in range(mcus_x):
            if restart and mcu and mcu % restart == 0:
                flush_bits()
                out.extend([0xFF, 0xD0 + (mcu // restart - 1) % 8])
                last = [0] * len(planes)
            mcu += 1
            for ci, (h, v) in enumerate(factors):
                for by in range(v):
                    for bx in range(h):
                        blk = blocks[ci][my * v + by, mx * h + bx].reshape(8, 8)
                        zz = [int(blk.flat[k]) for k in ZIGZAG]
                        diff, last[ci] = zz[0] - last[ci], zz[0]
                        s = category(diff)
                        put(*dc_code[s])
                        if s:
                            put(amplitude(diff, s), s)
                        run = 0
                        for k in range(1, 64):
                            if zz[k] == 0:
                                run += 1
                                continue
                            while run > 15:
                                put(*ac_code[0xF0])
                                run -= 16
                            s = category(zz[k])
                            put(*ac_code[(run << 4) | s])
                            put(amplitude(zz[k], s), s)
                            run = 0
                        if run:
                            put(*ac_code[0])
    flush_bits()

    def seg(marker, payload):
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    head = b"\xff\xd8" + b"".join(seg(m, p) for m, p in app)
    head += seg(0xDB, bytes([0]) + bytes(int(q[k]) for k in ZIGZAG))
    head += seg(0xC0, bytes([8]) + struct.pack(">HH", height, width) + bytes([len(planes)])
                + b"".join(bytes([i, (h << 4) | v, 0]) for i, (h, v) in zip(ids, factors)))
    dc_counts = [0] * 16
    dc_counts[3] = len(dc_vals)
    ac_counts = [0] * 16
    ac_counts[7] = len(ac_vals)
    head += seg(0xC4, bytes([0x00] + dc_counts + dc_vals) + bytes([0x10] + ac_counts + ac_vals))
    if restart:
        head += seg(0xDD, struct.pack(">H", restart))
    head += seg(0xDA, bytes([len(planes)]) + b"".join(bytes([i, 0]) for i in ids) + bytes([0, 63, 0]))
    return bytes(head + out + b"\xff\xd9")


def subsampled(img, h, v, max_h, max_v):
    """A plane at sampling (h, v) of max (max_h, max_v): box-averaged, ceil-sized like libjpeg."""
    H, W = img.shape
    fy, fx = max_v // v, max_h // h
    ph, pw = -(-H // fy) * fy, -(-W // fx) * fx
    p = np.pad(img.astype(np.float64), ((0, ph - H), (0, pw - W)), mode="edge")
    return np.rint(p.reshape(ph // fy, fy, pw // fx, fx).mean(axis=(1, 3))).astype(np.uint8)


# ---------------------------------------------------------------- cases


def add(name, ext, data, fmt, tol=0):
    """Saves one image and what transformers makes of it."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    (IMAGES / f"{name}.{ext}").write_bytes(data)
    # The server path: bytes -> load_image (open, exif_transpose, convert RGB) -> processor's convert_to_rgb.
    loaded = load_image(base64.b64encode(data).decode())
    rgb = convert_to_rgb(loaded, return_numpy=True)
    # The size seen from the header, after EXIF rotation.
    w, h = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size
    assert rgb.shape == (h, w, 3), (name, rgb.shape, w, h)
    cases.append({"name": name, "file": f"images/{name}.{ext}", "format": fmt, "width": w, "height": h, "tol": tol,
                  "truncated": truncations(data)})
    expected[f"rgb/{name}"] = np.ascontiguousarray(rgb)
    rgb_of[name] = loaded


def truncations(data):
    """[cut, whether transformers' loader accepts the first `cut` bytes] for a few cuts."""
    out = []
    for cut in sorted({len(data) // 3, len(data) // 2, len(data) * 9 // 10, len(data) - 1}):
        try:
            convert_to_rgb(load_image(base64.b64encode(data[:cut]).decode()), return_numpy=True)
            out.append([cut, True])
        except Exception:
            out.append([cut, False])
    return out


def png_cases():
    base = pattern(64, 48, 1)
    add("png_rgb8", "png", pil_bytes(Image.fromarray(base), "PNG"), "png")
    alpha = np.fromfunction(lambda y, x: (x * 4 + y * 3) % 256, (48, 64)).astype(np.uint8)
    alpha[:8, :8] = 0  # fully transparent pixels keep their stored colour
    add("png_rgba8", "png", pil_bytes(Image.fromarray(np.dstack([base, alpha])), "PNG"), "png")
    grey = base[..., 0] // 2 + base[..., 1] // 2
    add("png_l8", "png", pil_bytes(Image.fromarray(grey), "PNG"), "png")
    add("png_la8", "png", pil_bytes(Image.fromarray(np.dstack([grey, alpha]), "LA"), "PNG"), "png")
    add("png_l1", "png", pil_bytes(Image.fromarray(grey > 100), "PNG"), "png")

    q = Image.fromarray(base).quantize(200)
    add("png_p8", "png", pil_bytes(q, "PNG"), "png")
    # Simple tRNS (one fully transparent entry): transformers whitens every pixel of that colour,
    # including those of another palette entry with the same colour (index 7 is made equal to 3).
    pal = bytearray(q.getpalette()[: 3 * 200])
    pal[21:24] = pal[9:12]
    q.putpalette(bytes(pal))
    add("png_p8_key", "png", pil_bytes(q, "PNG", transparency=3), "png")
    add("png_p8_alpha", "png", pil_bytes(q, "PNG", transparency=bytes([255, 128, 0] + [255] * 197)), "png")
    idx = np.asarray(q)
    # A tRNS that ends in 0x0A: Python's `$` matches before a final newline, so Pillow takes it as simple.
    add("png_p8_key_newline", "png", png(64, 48, 3, 8, [r.tobytes() for r in idx], plte=bytes(pal), trns=b"\xff\xff\x00\x0a"), "png")
    # Indices past the end of the palette (Pillow's palette is a grey ramp beyond PLTE).
    short = np.clip(idx // 10, 0, 19).astype(np.uint8)
    add("png_p8_short_palette", "png", png(64, 48, 3, 8, [r.tobytes() for r in short], plte=bytes(pal[:30])), "png")
    q16 = Image.fromarray(base).quantize(16)
    add("png_p4", "png", pil_bytes(q16, "PNG", bits=4), "png")
    q2 = Image.fromarray(base).quantize(2)
    add("png_p1", "png", pil_bytes(q2, "PNG", bits=1, transparency=1), "png")

    # Low bit depth grey (scaled by the decoder) and its colour key (compared unscaled by Pillow).
    g2 = (grey // 64).astype(np.uint8)
    add("png_l2_key0", "png", png(64, 48, 0, 2, [pack_bits(r, 2) for r in g2], trns=struct.pack(">H", 0)), "png")
    g4 = (grey // 16).astype(np.uint8)
    add("png_l4_key5", "png", png(64, 48, 0, 4, [pack_bits(r, 4) for r in g4], trns=struct.pack(">H", 5)), "png")
    add("png_l1_key0", "png", png(64, 48, 0, 1, [pack_bits(r > 100, 1) for r in grey], trns=struct.pack(">H", 0)), "png")
    add("png_l8_key", "png", png(64, 48, 0, 8, [r.tobytes() for r in grey], trns=struct.pack(">H", int(grey[5, 5]))), "png")
    key = base[10, 20]
    add("png_rgb8_key", "png", png(64, 48, 2, 8, [r.tobytes() for r in base], trns=struct.pack(">HHH", *map(int, key))), "png")

    # 16-bit: grey clamps to 255, colour keeps the high byte.
    rng = np.random.default_rng(16)
    lo = rng.integers(0, 256, base.shape, dtype=np.uint16)
    rgb16 = (base.astype(np.uint16) << 8) | lo
    add("png_rgb16", "png", png(64, 48, 2, 16, [r.astype(">u2").tobytes() for r in rgb16]), "png")
    a16 = (alpha.astype(np.uint16) << 8) | 0x55
    add("png_rgba16", "png", png(64, 48, 6, 16, [r.astype(">u2").tobytes() for r in np.dstack([rgb16, a16])]), "png")
    g16 = (grey.astype(np.uint16) << 8) | lo[..., 0]
    add("png_la16", "png", png(64, 48, 4, 16, [r.astype(">u2").tobytes() for r in np.dstack([g16, a16])]), "png")
    i16 = (np.arange(64 * 48).reshape(48, 64) * 7 % 700).astype(np.uint16)  # many values above 255
    add("png_l16", "png", png(64, 48, 0, 16, [r.astype(">u2").tobytes() for r in i16]), "png")
    add("png_l16_key0", "png", png(64, 48, 0, 16, [r.astype(">u2").tobytes() for r in i16], trns=struct.pack(">H", 0)), "png")
    # A 16-bit colour key is compared, unscaled, against the 8-bit high bytes.
    k = rgb16[3, 4] >> 8
    add("png_rgb16_key", "png", png(64, 48, 2, 16, [r.astype(">u2").tobytes() for r in rgb16], trns=struct.pack(">HHH", *map(int, k))), "png")

    # EXIF orientation in PNG: eXIf before and after IDAT, ImageMagick's zTXt raw profile, XMP.
    small = pattern(40, 24, 2)
    rows = [r.tobytes() for r in small]
    add("png_exif6", "png", png(40, 24, 2, 8, rows, before=[(b"eXIf", exif(6))]), "png")
    add("png_exif8_after_idat", "png", png(40, 24, 2, 8, rows, after=[(b"eXIf", exif(8))]), "png")
    raw = exif(3)
    profile = f"\nexif\n{len(raw):8}\n{raw.hex()}\n".encode()
    add("png_raw_profile3", "png", png(40, 24, 2, 8, rows, before=[(b"zTXt", b"Raw profile type exif\0\0" + zlib.compress(profile))]), "png")
    itxt = b"XML:com.adobe.xmp\0\0\0\0\0" + xmp(5)
    add("png_xmp5", "png", png(40, 24, 2, 8, rows, after=[(b"iTXt", itxt)]), "png")
    add("png_exif1_xmp6", "png", png(40, 24, 2, 8, rows, before=[(b"eXIf", exif(1))], after=[(b"iTXt", itxt.replace(b'"5"', b'"6"'))]), "png")

    # Odd sizes for the processors.
    add("png_tiny", "png", pil_bytes(Image.fromarray(pattern(3, 2, 3)), "PNG"), "png")
    add("png_tall", "png", pil_bytes(Image.fromarray(pattern(4, 90, 4)), "PNG"), "png")
    add("png_100x80", "png", pil_bytes(Image.fromarray(pattern(100, 80, 5)), "PNG"), "png")
    add("png_98x70", "png", pil_bytes(Image.fromarray(pattern(98, 70, 6)), "PNG"), "png")
    add("png_126x42", "png", pil_bytes(Image.fromarray(pattern(126, 42, 7)), "PNG"), "png")
    add("png_20x10", "png", pil_bytes(Image.fromarray(pattern(20, 10, 8)), "PNG"), "png")
    add("png_120x90", "png", pil_bytes(Image.fromarray(pattern(120, 90, 9)), "PNG"), "png")
    # Tall and shrinking: Pillow 13 resizes vertically first (height shrinks > 2x the width).
    add("png_60x150", "png", pil_bytes(Image.fromarray(pattern(60, 150, 10)), "PNG"), "png")


def jpeg_cases():
    base = Image.fromarray(pattern(64, 48, 11))
    add("jpg_444", "jpg", pil_bytes(base, "JPEG", quality=95, subsampling=0), "jpeg")
    add("jpg_422", "jpg", pil_bytes(base, "JPEG", quality=90, subsampling=1), "jpeg")
    add("jpg_420", "jpg", pil_bytes(base, "JPEG", quality=90, subsampling=2), "jpeg")
    add("jpg_progressive", "jpg", pil_bytes(base, "JPEG", quality=85, progressive=True), "jpeg")
    add("jpg_restart", "jpg", pil_bytes(base, "JPEG", quality=90, restart_marker_blocks=3), "jpeg")
    add("jpg_odd_420", "jpg", pil_bytes(Image.fromarray(pattern(37, 29, 12)), "JPEG", quality=90), "jpeg")
    add("jpg_grey", "jpg", pil_bytes(base.convert("L"), "JPEG", quality=90), "jpeg")
    add("jpg_cmyk", "jpg", pil_bytes(base.convert("CMYK"), "JPEG", quality=95), "jpeg")
    cmyk = np.asarray(base.convert("CMYK")).copy()
    cmyk[..., 3] = np.fromfunction(lambda y, x: (x * 5 + y * 2) % 256, (48, 64))  # real black ink
    add("jpg_cmyk_k", "jpg", pil_bytes(Image.fromarray(cmyk, "CMYK"), "JPEG", quality=95), "jpeg")
    small = Image.fromarray(pattern(40, 24, 13))
    for o in range(1, 9):
        add(f"jpg_orient{o}", "jpg", pil_bytes(small, "JPEG", quality=95, subsampling=0, exif=exif(o)), "jpeg")
    plain = pil_bytes(small, "JPEG", quality=95, subsampling=0)
    add("jpg_orient6_mm", "jpg", jpeg_insert(plain, [(0xE1, b"Exif\0\0" + exif(6, big_endian=True))]), "jpeg")
    add("jpg_xmp8", "jpg", pil_bytes(small, "JPEG", quality=95, subsampling=0, xmp=xmp(8, attribute=False)), "jpeg")
    add("jpg_exif_no_orient_xmp6", "jpg", pil_bytes(small, "JPEG", quality=95, subsampling=0, exif=exif(None), xmp=xmp(6)), "jpeg")
    add("jpg_exif_garbage", "jpg", jpeg_insert(plain, [(0xE1, b"Exif\0\0not a tiff header")]), "jpeg")
    # Bigger, more MCU rows, progressive with restarts, and layouts Pillow does not write.
    big = Image.fromarray(pattern(96, 72, 14))
    add("jpg_progressive_444_restart", "jpg", pil_bytes(big, "JPEG", quality=80, progressive=True, subsampling=0, restart_marker_rows=1), "jpeg")
    add("jpg_progressive_420_odd", "jpg", pil_bytes(Image.fromarray(pattern(75, 53, 15)), "JPEG", quality=70, progressive=True), "jpeg")
    add("jpg_420_q100", "jpg", pil_bytes(big, "JPEG", quality=100), "jpeg")
    add("jpg_420_q20", "jpg", pil_bytes(big, "JPEG", quality=20), "jpeg")
    ycc = np.asarray(Image.fromarray(pattern(61, 43, 16)).convert("YCbCr"))
    y, cb, cr = (ycc[..., i] for i in range(3))
    jfif = [(0xE0, b"JFIF\0\1\1\0\0\1\0\1\0\0")]
    for name, fy, fc in [("h1v2", (1, 2), (1, 1)), ("h4v1", (4, 1), (1, 1)), ("h2v2_h1v2", (2, 2), None), ("h1v1_h1v4", (1, 4), (1, 1)),
                         ("h2v1_narrow", (2, 1), (1, 1))]:
        w = 3 if name.endswith("narrow") else 61
        fcb, fcr = (fc, fc) if fc else ((1, 1), (1, 2))
        mh, mv = max(fy[0], fcb[0], fcr[0]), max(fy[1], fcb[1], fcr[1])
        planes = [subsampled(y[:, :w], *fy, mh, mv), subsampled(cb[:, :w], *fcb, mh, mv), subsampled(cr[:, :w], *fcr, mh, mv)]
        add(f"jpg_{name}", "jpg", jpeg_encode(w, 43, planes, [fy, fcb, fcr], [1, 2, 3], jfif), "jpeg")
    rgb = pattern(61, 43, 17)
    planes = [rgb[..., i] for i in range(3)]
    add("jpg_rgb_adobe", "jpg", jpeg_encode(61, 43, planes, [(1, 1)] * 3, [1, 2, 3], [(0xEE, b"Adobe\0\x64\0\0\0\0\0")]), "jpeg")
    add("jpg_rgb_ids", "jpg", jpeg_encode(61, 43, planes, [(1, 1)] * 3, list(b"RGB"), restart=5), "jpeg")
    k = np.fromfunction(lambda yy, xx: (xx * 3 + yy * 5) % 256, (43, 61)).astype(np.uint8)
    ycck = [y[:, :61], subsampled(cb, 1, 1, 2, 2), subsampled(cr, 1, 1, 2, 2), k]
    add("jpg_ycck", "jpg", jpeg_encode(61, 43, ycck, [(2, 2), (1, 1), (1, 1), (2, 2)], [1, 2, 3, 4], [(0xEE, b"Adobe\0\x64\0\0\0\0\2")]), "jpeg")
    add("jpg_grey_h2v2", "jpg", jpeg_encode(61, 43, [y[:, :61]], [(2, 2)], [1]), "jpeg")


def webp_cases():
    base = pattern(64, 48, 21)
    alpha = np.fromfunction(lambda y, x: (x * 4 + y * 3) % 256, (48, 64)).astype(np.uint8)
    rgba = Image.fromarray(np.dstack([base, alpha]))
    add("webp_lossless", "webp", pil_bytes(Image.fromarray(base), "WEBP", lossless=True), "webp")
    add("webp_lossless_alpha", "webp", pil_bytes(rgba, "WEBP", lossless=True, exact=True), "webp")
    add("webp_lossy", "webp", pil_bytes(Image.fromarray(base), "WEBP", quality=80), "webp")
    add("webp_lossy_alpha", "webp", pil_bytes(rgba, "WEBP", quality=80, exact=True), "webp")
    odd = Image.fromarray(pattern(61, 37, 25))
    add("webp_lossy_q20_odd", "webp", pil_bytes(odd, "WEBP", quality=20, method=6), "webp")
    add("webp_lossy_q95_odd", "webp", pil_bytes(odd, "WEBP", quality=95, method=0), "webp")
    small = Image.fromarray(pattern(40, 24, 22))
    add("webp_exif6", "webp", pil_bytes(small, "WEBP", lossless=True, exif=exif(6)), "webp")
    add("webp_xmp3", "webp", pil_bytes(small, "WEBP", lossless=True, xmp=xmp(3)), "webp")
    frames = [Image.fromarray(pattern(40, 24, s)) for s in (23, 24)]
    add("webp_animated", "webp", pil_bytes(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True), "webp")


def gif_cases():
    rng = np.random.default_rng(31)
    pal = rng.integers(0, 256, 64 * 3, dtype=np.uint8)
    pal[3 * 9 : 3 * 10] = pal[3 * 5 : 3 * 6]  # index 9 has the colour of index 5
    pal = pal.tobytes()
    idx = (np.fromfunction(lambda y, x: (x // 3 + y // 4 * 5) % 64, (36, 50)) + rng.integers(0, 2, (36, 50))).astype(np.uint8) % 64
    add("gif_global", "gif", gif(50, 36, [{"idx": idx}], pal), "gif")
    add("gif_local", "gif", gif(50, 36, [{"idx": idx, "palette": pal}]), "gif")
    add("gif_interlaced", "gif", gif(50, 36, [{"idx": idx, "interlace": True}], pal), "gif")
    add("gif_transparent", "gif", gif(50, 36, [{"idx": idx, "transparency": 5}], pal), "gif")
    inner = idx[5:25, 10:40]
    add("gif_offset", "gif", gif(50, 36, [{"idx": inner, "x": 10, "y": 5}], pal), "gif")
    add("gif_offset_transparent", "gif", gif(50, 36, [{"idx": inner, "x": 10, "y": 5, "transparency": 9}], pal), "gif")
    # A frame reaching past the logical screen: Pillow grows the image to hold it.
    add("gif_oversize_frame", "gif", gif(30, 20, [{"idx": idx, "x": 4, "y": 2}], pal), "gif")
    grey = bytes(np.repeat(np.arange(256, dtype=np.uint8), 3))
    add("gif_grey_palette", "gif", gif(50, 36, [{"idx": (idx * 4).astype(np.uint8), "transparency": 20}], grey), "gif")
    add("gif_no_palette", "gif", gif(50, 36, [{"idx": idx}]), "gif")
    add("gif_short_palette", "gif", gif(50, 36, [{"idx": idx % 12}], pal[:12]), "gif")
    second = (idx + 7) % 64
    add("gif_animated", "gif", gif(50, 36, [{"idx": idx, "transparency": 2}, {"idx": second, "palette": pal[::-1]}], pal), "gif")


def bmp_cases():
    base = pattern(45, 30, 41)
    add("bmp_rgb24", "bmp", pil_bytes(Image.fromarray(base), "BMP"), "bmp")
    alpha = np.fromfunction(lambda y, x: (x * 5 + y * 3) % 256, (30, 45)).astype(np.uint8)
    add("bmp_rgba32", "bmp", pil_bytes(Image.fromarray(np.dstack([base, alpha])), "BMP"), "bmp")
    add("bmp_p8", "bmp", pil_bytes(Image.fromarray(base).quantize(100), "BMP"), "bmp")
    add("bmp_l8", "bmp", pil_bytes(Image.fromarray(base[..., 1]), "BMP"), "bmp")
    add("bmp_1bit", "bmp", pil_bytes(Image.fromarray(base[..., 0] > 128), "BMP"), "bmp")
    rows565 = []
    for r in base:
        v = ((r[:, 0].astype(np.uint16) >> 3) << 11) | ((r[:, 1].astype(np.uint16) >> 2) << 5) | (r[:, 2] >> 3)
        rows565.append(v.astype("<u2").tobytes())
    add("bmp_565", "bmp", bmp(45, 30, 16, rows565, masks=(0xF800, 0x07E0, 0x001F)), "bmp")
    rows555 = []
    for r in base:
        v = ((r[:, 0].astype(np.uint16) >> 3) << 10) | ((r[:, 1].astype(np.uint16) >> 3) << 5) | (r[:, 2] >> 3)
        rows555.append(v.astype("<u2").tobytes())
    add("bmp_555", "bmp", bmp(45, 30, 16, rows555), "bmp")
    add("bmp_top_down", "bmp", bmp(45, 30, 24, [r[:, ::-1].tobytes() for r in base], top_down=True), "bmp")


# ---------------------------------------------------------------- processors

LLAVA_TINY = json.loads((REPO / "assets/models/llava-tiny/preprocessor_config.json").read_text())
CLIP_336 = {  # llava-hf/llava-1.5-7b-hf
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
QWEN = json.loads((REPO.parent / "shared/fixtures/models/qwen2_vl/preprocessor_config.json").read_text()) if (REPO.parent / "shared/fixtures/models/qwen2_vl/preprocessor_config.json").exists() else None
QWEN = QWEN or {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
}
CONFIGS = {
    "llava_tiny": LLAVA_TINY,
    "clip_336": CLIP_336,
    "qwen2_vl": QWEN,
    "qwen_small_max": {**QWEN, "max_pixels": 6272},
    "qwen_size_dict": {k: v for k, v in QWEN.items() if k not in ("min_pixels", "max_pixels")} | {"size": {"shortest_edge": 3136, "longest_edge": 6272}},
    "qwen_big_min": {**QWEN, "min_pixels": 12544},
    "qwen_patch16": {
        "size": {"shortest_edge": 4096, "longest_edge": 16384}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
    },
}
RUNS = {
    "llava_tiny": ["png_rgb8", "png_rgba8", "png_p8_key", "png_rgb16", "png_l16", "png_exif6", "gif_transparent", "gif_offset_transparent",
                   "webp_lossless_alpha", "bmp_565", "png_tiny", "png_tall", "png_60x150", "jpg_orient6", "jpg_cmyk_k",
                   "jpg_420_q20", "jpg_ycck"],
    "clip_336": ["png_rgb8"],
    "qwen2_vl": ["png_rgb8", "png_100x80", "png_98x70", "png_126x42", "png_20x10", "png_tiny", "png_p8_key", "png_exif8_after_idat", "gif_oversize_frame", "jpg_orient5"],
    "qwen_small_max": ["png_120x90", "png_60x150"],
    "qwen_size_dict": ["png_120x90"],
    "qwen_big_min": ["png_rgb8"],
    "qwen_patch16": ["png_rgb8"],
}


def make_processor(cfg):
    kwargs = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
    cls = CLIPImageProcessorPil if cfg["image_processor_type"].startswith("CLIP") else Qwen2VLImageProcessorPil
    return cls(**kwargs)


def level_table(proc, channels=3):
    """transformers' value of each uint8 level, per channel (its own rescale and normalize)."""
    levels = np.tile(np.arange(256, dtype=np.uint8), (channels, 1, 1))
    x = levels
    if proc.do_rescale:
        x = np_rescale(x, proc.rescale_factor, input_data_format="channels_first")
    if proc.do_normalize:
        x = np_normalize(x, proc.image_mean, proc.image_std, input_data_format="channels_first")
    return np.ascontiguousarray(x.reshape(channels, 256).astype(np.float32))


def to_levels(values, table, channel_of):
    """uint8 levels that reproduce `values` exactly through `table` (asserted)."""
    levels = np.zeros(values.shape, dtype=np.uint8)
    for c in range(table.shape[0]):
        lookup = {v.tobytes(): i for i, v in enumerate(table[c])}
        mask = channel_of == c
        levels[mask] = [lookup[v.tobytes()] for v in values[mask]]
    assert np.array_equal(table[channel_of, levels].view(np.uint32), values.view(np.uint32))
    return levels


def processor_runs():
    runs = []
    for cfg_name, images in RUNS.items():
        cfg = CONFIGS[cfg_name]
        proc = make_processor(cfg)
        table = level_table(proc)
        expected[f"table/{cfg_name}"] = table
        for image in images:
            out = proc(images=[rgb_of[image]], return_tensors="np")
            pv = np.asarray(out["pixel_values"], dtype=np.float32)
            run = {"config": cfg_name, "image": image}
            if "image_grid_thw" in out:
                grid = [int(v) for v in out["image_grid_thw"][0]]
                # The temporal copies of a patch are identical: keep the first only.
                t = proc.temporal_patch_size
                per_t = pv.reshape(pv.shape[0], 3, t, -1)
                assert all(np.array_equal(per_t[:, :, 0], per_t[:, :, i]) for i in range(t))
                pv = np.ascontiguousarray(per_t[:, :, 0].reshape(pv.shape[0], -1))
                d = pv.shape[1]
                channel_of = np.broadcast_to(np.arange(d) // (d // 3), pv.shape)
                run |= {"grid_thw": grid, "tokens": grid[0] * grid[1] * grid[2] // proc.merge_size**2}
                n = proc.get_number_of_image_patches(*rgb_of[image].size[::-1]) // proc.merge_size**2
                assert n == run["tokens"], (n, run)
            else:
                pv = pv[0]
                channel_of = np.broadcast_to(np.arange(3)[:, None, None], pv.shape)
                run |= {"shape": list(pv.shape)}
            expected[f"levels/{cfg_name}/{image}"] = to_levels(pv, table, channel_of)
            runs.append(run)
    return runs


def smart_resize_table():
    rows = []
    sizes = [(1, 1), (1, 200), (1, 201), (200, 1), (3, 600), (3, 601), (2, 401), (28, 28), (14, 14), (13, 13), (42, 42), (70, 70),
             (98, 126), (42, 154), (70, 14), (15, 14 * 3), (3584, 3584), (3585, 3584), (10000, 10000), (20000, 100), (100, 20000),
             (65535, 65535), (1, 56), (56, 11200), (4000, 3000), (3000, 4000), (1080, 1920), (2160, 3840), (480, 640), (333, 500)]
    rng = random.Random(7)
    sizes += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(150)]
    sizes += [(14 * rng.randint(1, 300), 14 * rng.randint(1, 300)) for _ in range(60)]  # many x.5 ties
    params = [(28, 3136, 12845056), (28, 3136, 6272), (28, 12544, 12845056), (32, 4096, 16384), (32, 65536, 16777216), (28, 256 * 28 * 28, 1280 * 28 * 28)]
    for h, w in sizes:
        for factor, lo, hi in params:
            try:
                rh, rw = smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
                rows.append([h, w, factor, lo, hi, int(rh), int(rw)])
            except ValueError:
                rows.append([h, w, factor, lo, hi, None, None])
    return rows


def main():
    assert PIL.__version__.startswith("13."), PIL.__version__
    for p in IMAGES.glob("*"):
        p.unlink()
    png_cases()
    jpeg_cases()
    webp_cases()
    gif_cases()
    bmp_cases()
    runs = processor_runs()
    manifest = {
        "made_with": {"transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__},
        "images": cases,
        "configs": CONFIGS,
        "runs": runs,
        "smart_resize": smart_resize_table(),
    }
    # One line per row of the long tables.
    text = json.dumps(manifest, indent=1)
    for key in ("smart_resize", "images", "runs"):
        rows = ",\n  ".join(json.dumps(r) for r in manifest[key])
        text = text.replace(json.dumps(manifest[key], indent=1).replace("\n", "\n "), "[\n  " + rows + "\n ]")
    assert json.loads(text) == manifest
    (HERE / "image_cases.json").write_text(text + "\n")
    save_file(expected, str(HERE / "image_expected.safetensors"))
    (HERE / "image_expected.safetensors").chmod(0o644)
    total = sum(v.nbytes for v in expected.values()) + sum(p.stat().st_size for p in IMAGES.glob("*"))
    print(f"{len(cases)} images, {len(runs)} processor runs, {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
