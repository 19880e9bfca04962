"""Seeded synthetic sound clips and their questions, for the tiny audio model that mmserve
ships beside its vision model (issue 30). A clip is one of

    beeps   one to four short tone bursts of one pitch, sometimes over quiet noise
    tone    a steady tone of a named pitch (C4, G4, C5, G5, C6)
    chirp   a tone sweeping up or down
    noise   a burst of noise
    silence nothing (a little hiss at most)

lasting 1 to 3.5 s at an amplitude, onset and sample rate the seed decides, and comes with
questions whose answers the clip decides:

    "What do you hear?"                 -> "Three beeps." / "A steady tone." / "Noise." / ...
    "How many beeps?"                   -> "Three." / "None."
    "Is the tone rising or falling?"    -> "Rising." / "Falling."   (asked of chirps)
    "What note is the tone?"            -> "G4."                    (asked of tones and beeps)
    "Is there noise?"                   -> "Yes." / "No."

Everything is a function of the seed; `clip(seed)` returns float samples in [-1, 1] at its
own sample rate. `encode(samples, rate, fmt)` writes WAV bytes (the standard library), or FLAC or MP3
(soundfile with libsndfile >= 1.1), for the evaluation through the server; training needs
numpy alone.
"""

import io
import math
import random
import wave

import numpy as np

NOTES = {"C4": 261.63, "G4": 392.00, "C5": 523.25, "G5": 783.99, "C6": 1046.50}
NUMBERS = ["None", "One", "Two", "Three", "Four"]
KINDS = ["beeps", "tone", "chirp", "noise", "silence"]
RATES = [8000, 16000, 22050, 44100, 48000]
MAX_SECONDS = 3.5
# Seeds from here on are held out: training draws below HELD_OUT // 2.
HELD_OUT = 10**9
QUESTIONS = {
    "describe": "What do you hear?",
    "count": "How many beeps?",
    "direction": "Is the tone rising or falling?",
    "pitch": "What note is the tone?",
    "noise": "Is there noise?",
}


def _tone(rate, n, freq, amp):
    t = np.arange(n) / rate
    return amp * np.sin(2 * math.pi * freq * t)


def _envelope(n, rate, ramp=0.01):
    """A short linear fade in and out, so bursts start and stop without clicks."""
    k = max(1, min(n // 2, int(ramp * rate)))
    env = np.ones(n)
    env[:k] = np.linspace(0, 1, k)
    env[n - k:] = np.linspace(1, 0, k)
    return env


def clip(seed, rate=None):
    """(samples, rate, facts) for a seed; `rate` overrides the seeded sample rate."""
    rng = random.Random(seed)
    nrs = np.random.default_rng(seed)
    kind = rng.choice(KINDS)
    seeded = rng.choice(RATES)
    rate = rate or seeded
    seconds = rng.uniform(1.0, MAX_SECONDS)
    n = int(seconds * rate)
    out = np.zeros(n)
    amp = rng.uniform(0.15, 0.8)
    facts = {"kind": kind, "beeps": 0, "note": None, "direction": None, "noise": False}
    if kind == "beeps":
        count = rng.randint(1, 4)
        note = rng.choice(list(NOTES))
        facts.update(beeps=count, note=note)
        # Bursts of 0.12-0.25 s with gaps of at least 0.12 s, all inside the clip.
        burst = rng.uniform(0.12, 0.25)
        gap = rng.uniform(0.12, 0.3)
        span = count * burst + (count - 1) * gap
        if span > seconds - 0.1:
            scale = (seconds - 0.1) / span
            burst, gap, span = burst * scale, gap * scale, span * scale
        start = rng.uniform(0.05, seconds - span - 0.05)
        for b in range(count):
            s = int((start + b * (burst + gap)) * rate)
            m = int(burst * rate)
            out[s:s + m] += _tone(rate, m, NOTES[note], amp) * _envelope(m, rate)
        if rng.random() < 0.3:
            facts["noise"] = True
            out += nrs.normal(0, amp * rng.uniform(0.08, 0.2), n)
    elif kind == "tone":
        note = rng.choice(list(NOTES))
        facts["note"] = note
        s = int(rng.uniform(0, 0.2) * rate)
        m = n - s - int(rng.uniform(0, 0.2) * rate)
        out[s:s + m] = _tone(rate, m, NOTES[note], amp) * _envelope(m, rate)
        if rng.random() < 0.3:
            facts["noise"] = True
            out += nrs.normal(0, amp * rng.uniform(0.08, 0.2), n)
    elif kind == "chirp":
        rising = rng.random() < 0.5
        lo, hi = rng.uniform(200, 500), rng.uniform(1000, 2000)
        f0, f1 = (lo, hi) if rising else (hi, lo)
        facts["direction"] = "Rising" if rising else "Falling"
        t = np.arange(n) / rate
        # Exponential sweep: the phase is the integral of f0 · (f1/f0)^(t/T).
        k = math.log(f1 / f0) / seconds
        phase = 2 * math.pi * f0 * (np.exp(k * t) - 1) / k
        out = amp * np.sin(phase) * _envelope(n, rate, 0.05)
    elif kind == "noise":
        facts["noise"] = True
        s = int(rng.uniform(0, 0.3) * seconds * rate)
        m = max(int(0.3 * rate), n - s - int(rng.uniform(0, 0.3) * seconds * rate))
        m = min(m, n - s)
        out[s:s + m] = nrs.normal(0, amp / 2.5, m) * _envelope(m, rate)
    else:  # silence
        if rng.random() < 0.5:
            out += nrs.normal(0, rng.uniform(0.0005, 0.003), n)
    return np.clip(out, -1, 1).astype(np.float32), rate, facts


def answers(facts):
    """Every (kind, question, answer) the clip decides."""
    kind = facts["kind"]
    describe = {
        "beeps": lambda: ("One beep." if facts["beeps"] == 1 else f"{NUMBERS[facts['beeps']]} beeps."),
        "tone": lambda: "A steady tone.",
        "chirp": lambda: f"A {facts['direction'].lower()} tone.",
        "noise": lambda: "Noise.",
        "silence": lambda: "Silence.",
    }[kind]()
    out = [("describe", QUESTIONS["describe"], describe),
           ("count", QUESTIONS["count"], NUMBERS[facts["beeps"]] + "."),
           ("noise", QUESTIONS["noise"], "Yes." if facts["noise"] else "No.")]
    if facts["direction"]:
        out.append(("direction", QUESTIONS["direction"], facts["direction"] + "."))
    if facts["note"]:
        out.append(("pitch", QUESTIONS["pitch"], facts["note"] + "."))
    return out


def words():
    """Every string prompts and answers use, for the tokenizer."""
    out = list(QUESTIONS.values()) + ["One beep."] + [f"{n} beeps." for n in NUMBERS[2:]]
    out += ["A steady tone.", "A rising tone.", "A falling tone.", "Noise.", "Silence.", "Rising.", "Falling.",
            "Yes.", "No."] + [n + "." for n in NUMBERS] + [n + "." for n in NOTES]
    return out


def encode(samples, rate, fmt):
    """The clip as a file's bytes: 16-bit WAV (the standard library's writer), or FLAC or
    MP3 (soundfile)."""
    buf = io.BytesIO()
    if fmt == "wav":
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
        return buf.getvalue()
    import soundfile as sf

    if fmt == "flac":
        sf.write(buf, samples, rate, format="FLAC", subtype="PCM_16")
    elif fmt == "mp3":
        sf.write(buf, samples, rate, format="MP3", subtype="MPEG_LAYER_III")
    else:
        raise ValueError(fmt)
    return buf.getvalue()
