#!/usr/bin/env python3
"""Trains mmserve's default audio model (issue 30): a tiny Qwen2-Audio (a small Whisper-style
encoder over 4 s windows, a small Qwen2 LM, a byte-level BPE of the clips' words, Qwen2-Audio's
chat template) on the seeded clips of `clips.py`, with transformers' own
`Qwen2AudioForConditionalGeneration`, and writes a Hugging Face model directory that
`mmserve serve --model DIR` serves, with held-out exact-match scores per question type.

    python tools/train/train_audio.py OUT_DIR [--steps N] [--device cuda] [--eval 300] [--workers N]

Seeded and reproducible: clips 0.. train, clips from 10**9 are held out. The window is
`chunk_length` 4 s (400 mel frames, `max_source_positions` 200), so a clip costs 100 audio
tokens rather than the 750 of a 30 s window. Tooling, not the server: it needs torch and
transformers (5.x), as the GPU machine has.
"""

import argparse
import json
import os
import random
import sys

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2AudioConfig,
    Qwen2AudioEncoderConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2Config,
    WhisperFeatureExtractor,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clips  # noqa: E402
import trainer  # noqa: E402

HELD_OUT = clips.HELD_OUT
RATE, CHUNK = 16000, 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
SYSTEM = "You are a helpful assistant."
# Qwen2-Audio-7B-Instruct's template: a default system turn, "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\n".
TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer_ = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = clips.words() + ["system", "user", "assistant", SYSTEM, "Audio 1: ", "Audio 2: ", "\n"]
    tok.train_from_iterator(corpus * 20, trainer_)
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump({"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "unk_token": None, "additional_special_tokens": SPECIALS[1:], "tokenizer_class": "PreTrainedTokenizerFast",
               "model_max_length": 1024, "clean_up_tokenization_spaces": False},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def build_model(tok):
    audio = Qwen2AudioEncoderConfig(num_mel_bins=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=512,
                                    d_model=128, max_source_positions=CHUNK * RATE // 160 // 2)
    text = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       rope_theta=10000.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       tie_word_embeddings=False)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"), tie_word_embeddings=False)
    return Qwen2AudioForConditionalGeneration(config)


def feature_extractor():
    return WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE, hop_length=160, chunk_length=CHUNK, n_fft=400,
                                   padding_value=0.0, return_attention_mask=True)


def save_configs(out, tok):
    fe = feature_extractor()
    fe.save_pretrained(out)
    path = os.path.join(out, "preprocessor_config.json")
    cfg = json.load(open(path))
    cfg["processor_class"] = "Qwen2AudioProcessor"
    json.dump(cfg, open(path, "w"), indent=2)
    eos = tok.eos_token_id
    json.dump({"eos_token_id": eos, "pad_token_id": tok.pad_token_id}, open(os.path.join(out, "generation_config.json"), "w"))


def audio_tokens(frames):
    """`<|AUDIO|>` rows for `frames` valid mel frames: two stride-2 reductions (conv, pool)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


def at_16k(seed):
    """A clip at 16 kHz. A third of training clips are made at 8 kHz and upsampled (linearly),
    so the model has heard band-limited sound too."""
    if random.Random(seed ^ 0x5EED).random() < 0.3:
        low, _, facts = clips.clip(seed, rate=8000)
        return np.interp(np.arange(2 * len(low)) / 2, np.arange(len(low)), low).astype(np.float32), facts
    samples, _, facts = clips.clip(seed, rate=RATE)
    return samples, facts


def prompt(q):
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
            f"{q}<|im_end|>\n<|im_start|>assistant\n")


def example(seed, rng):
    samples, facts = at_16k(seed)
    kind, q, ans = rng.choice(clips.answers(facts))
    return samples, q, ans, kind


def encode(tok, fe, samples, q, ans=None):
    feats = fe(samples, sampling_rate=RATE, padding="max_length", return_attention_mask=True, return_tensors="pt")
    n = audio_tokens(int(feats["attention_mask"].sum()))
    ids = tok(prompt(q).replace("<|AUDIO|>", "<|AUDIO|>" * n), add_special_tokens=False)["input_ids"]
    a = [] if ans is None else tok(ans, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids, a, feats["input_features"][0], feats["attention_mask"][0]


class Batches:
    """Step `i`'s training batch, a function of `i` and the run's seed alone."""

    def __init__(self, tok, fe, size, seed):
        self.tok, self.fe, self.size, self.seed = tok, fe, size, seed

    def __call__(self, step):
        rng = random.Random(self.seed * 1_000_003 + step)
        ids, labels, feats, masks = [], [], [], []
        for _ in range(self.size):
            samples, q, ans, _ = example(rng.randrange(HELD_OUT // 2), rng)
            p, a, f, m = encode(self.tok, self.fe, samples, q, ans)
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
            feats.append(f)
            masks.append(m)
        width, pad = max(map(len, ids)), self.tok.pad_token_id
        return {
            "input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
            "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
            "input_features": torch.stack(feats),
            "feature_attention_mask": torch.stack(masks),
        }


def evaluate(model, tok, fe, device, n):
    """Greedy answers to `n` held-out clips (at 16 kHz)."""
    rng = random.Random(7)
    tally = trainer.Tally()
    for i in range(n):
        samples, _, facts = clips.clip(HELD_OUT + i, rate=RATE)
        kind, q, ans = rng.choice(clips.answers(facts))
        ids, _, f, m = encode(tok, fe, samples, q)
        out = model.generate(input_ids=torch.tensor([ids], device=device),
                             input_features=f[None].to(device, model.dtype), feature_attention_mask=m[None].to(device),
                             max_new_tokens=12, do_sample=False)
        tally.add(HELD_OUT + i, kind, q, ans, tok.decode(out[0, len(ids):], skip_special_tokens=True).strip())
    return tally


def main():
    ap = argparse.ArgumentParser()
    trainer.add_args(ap, steps=4000, evals=300)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    tok = build_tokenizer(args.out)
    fe = feature_extractor()
    save_configs(args.out, tok)
    model = build_model(tok).to(args.device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    trainer.train(model, Batches(tok, fe, args.batch, args.seed), args.steps, args.lr, args.device, args.workers,
                  args.max_seconds)
    trainer.ship(model, args.out, args.steps, lambda m: evaluate(m, tok, fe, args.device, args.eval))


if __name__ == "__main__":
    main()
