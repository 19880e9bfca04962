#!/usr/bin/env python3
"""Makes the audio test files of crates/media/tests/audio.rs. The tests never run this; its outputs
are committed. Needs numpy, soundfile (libsndfile 1.2, with MP3), soxr and ffmpeg (libmp3lame,
libvorbis, aac, libopus); ffmpeg 5.1 made the committed files.

Source: the qwen2_audio fixture (/work/shared/fixtures/models/qwen2_audio): `input.wav` (1.37 s
chirp, 16 kHz mono float32) and `reference.safetensors` (transformers 5.24's `waveform`,
`input_features`, `feature_attention_mask`).

Outputs (all 1.37 s of that chirp):
  input.wav, preprocessor_config.json   copies of the fixture's
  reference.safetensors                 waveform [21920]; input_features_head [128,160] (frames
                                        160.. are all equal: input_features_pad [128] is frame 2999);
                                        feature_attention_mask [3000] i64;
                                        soxr_44k1 [21920]: pcm16_44k1.wav read by soundfile and
                                        resampled with soxr "soxr_hq" to 16 kHz (transformers' path);
                                        soundfile_mp3 / soundfile_ogg: those files as soundfile
                                        (libsndfile + mpg123 / libvorbis) reads them
  pcm16.wav pcm24.wav pcm32.wav u8.wav  the waveform quantised: round(x·(2^(b−1)−1)) (u8: +128)
  stereo_pcm16.wav                      left = pcm16, right = pcm16 reversed in time
  pcm16_44k1.wav                        the waveform resampled to 44.1 kHz (soxr HQ), 16-bit
  pcm16.flac                            pcm16.wav losslessly
  chirp.mp3 chirp.ogg chirp.m4a         pcm16.wav as MP3 64 kb/s, Vorbis q4, AAC-LC 64 kb/s (ffmpeg)
  chirp.opus                            Ogg Opus (a codec symphonia lacks)
  chirp.webm                            WebM/Opus (a container this build lacks)
"""

import json
import os
import struct
import subprocess

import numpy as np
import soundfile as sf
import soxr

FIXTURE = "/work/shared/fixtures/models/qwen2_audio"
HERE = os.path.dirname(os.path.abspath(__file__))


def read_safetensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    dtypes = {"F32": np.float32, "I64": np.int64}
    out = {}
    for k, m in header.items():
        if k == "__metadata__":
            continue
        s, e = m["data_offsets"]
        out[k] = np.frombuffer(b[8 + n + s : 8 + n + e], dtype=dtypes[m["dtype"]]).reshape(m["shape"])
    return out


def write_safetensors(path, tensors):
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        v = np.ascontiguousarray(v)
        data = v.tobytes()
        header[k] = {"dtype": names[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def quantise(x, bits):
    scale = 2 ** (bits - 1) - 1
    return np.clip(np.round(x.astype(np.float64) * scale), -scale - 1, scale).astype(np.int32)


def ffmpeg(*args):
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


def main():
    os.chdir(HERE)
    ref = read_safetensors(f"{FIXTURE}/reference.safetensors")
    w = ref["waveform"]
    x, sr = sf.read(f"{FIXTURE}/input.wav", dtype="float32")
    assert sr == 16000 and np.array_equal(x, w)
    feats = ref["input_features"][0]
    assert (feats[:, 160:] == feats[:, 2999:3000]).all()

    q16 = quantise(w, 16).astype(np.int16)
    sf.write("pcm16.wav", q16, 16000, subtype="PCM_16")
    sf.write("pcm24.wav", quantise(w, 24) << 8, 16000, subtype="PCM_24")  # int32 input: top 24 bits
    sf.write("pcm32.wav", quantise(w, 32), 16000, subtype="PCM_32")
    u8 = (quantise(w, 8) + 128).astype(np.uint8)
    with open("u8.wav", "wb") as f:  # libsndfile would rescale; write the bytes directly
        data = u8.tobytes()
        f.write(b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE")
        f.write(b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16000, 16000, 1, 8))
        f.write(b"data" + struct.pack("<I", len(data)) + data)
    assert np.array_equal(sf.read("u8.wav", dtype="float32")[0], (u8.astype(np.float32) - 128) / 128)
    assert np.array_equal(sf.read("pcm16.wav", dtype="float32")[0], q16.astype(np.float32) / 32768)
    sf.write("stereo_pcm16.wav", np.stack([q16, q16[::-1]], axis=1), 16000, subtype="PCM_16")

    up = soxr.resample(w, 16000, 44100, quality="soxr_hq")
    sf.write("pcm16_44k1.wav", quantise(up, 16).astype(np.int16), 44100, subtype="PCM_16")
    y, r = sf.read("pcm16_44k1.wav", dtype="float32")
    n = -(-len(y) * 16000 // r)
    soxr_44k1 = soxr.resample(y, r, 16000, quality="soxr_hq")
    soxr_44k1 = np.pad(soxr_44k1, (0, max(0, n - len(soxr_44k1))))[:n].astype(np.float32)

    ffmpeg("-i", "pcm16.wav", "-c:a", "flac", "pcm16.flac")
    ffmpeg("-i", "pcm16.wav", "-c:a", "libmp3lame", "-b:a", "64k", "chirp.mp3")
    ffmpeg("-i", "pcm16.wav", "-c:a", "libvorbis", "-q:a", "4", "chirp.ogg")
    ffmpeg("-i", "pcm16.wav", "-c:a", "aac", "-b:a", "64k", "chirp.m4a")
    ffmpeg("-i", "pcm16.wav", "-c:a", "libopus", "-b:a", "32k", "chirp.opus")
    ffmpeg("-i", "pcm16.wav", "-c:a", "libopus", "-b:a", "32k", "chirp.webm")
    assert np.array_equal(sf.read("pcm16.flac", dtype="float32")[0], q16.astype(np.float32) / 32768)

    write_safetensors(
        "reference.safetensors",
        {
            "waveform": w,
            "input_features_head": np.ascontiguousarray(feats[:, :160]),
            "input_features_pad": np.ascontiguousarray(feats[:, 2999]),
            "feature_attention_mask": ref["feature_attention_mask"][0],
            "soxr_44k1": soxr_44k1,
            "soundfile_mp3": sf.read("chirp.mp3", dtype="float32")[0],
            "soundfile_ogg": sf.read("chirp.ogg", dtype="float32")[0],
        },
    )
    for f in sorted(os.listdir(".")):
        print(f"{os.path.getsize(f):>8}  {f}")


if __name__ == "__main__":
    main()
