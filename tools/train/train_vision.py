#!/usr/bin/env python3
"""Trains mmserve's default vision model (issue 30): a tiny LLaVA-1.5 (a small CLIP
tower, a small Llama, a byte-level BPE of the scenes' words) on the seeded scenes of
`scenes.py`, with transformers' own `LlavaForConditionalGeneration`, and writes a
Hugging Face model directory that `mmserve serve --model DIR` serves, a held-out
evaluation set and its exact-match scores per question type.

    python tools/train/train_vision.py OUT_DIR [--steps N] [--device cuda] [--eval 500] [--workers N]

Seeded and reproducible on one device: scenes 0.. train, scenes from 10**9 are held out.
Tooling, not the server: it needs torch and transformers (5.x), as the GPU machine has.
"""

import argparse
import io
import json
import math
import os
import random
import sys
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scenes  # noqa: E402
import trainer  # noqa: E402

HELD_OUT = scenes.HELD_OUT
SPECIALS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
# LLaVA-1.5's template with the question before the images: "USER: {question}\n<image>\n
# ASSISTANT: {answer}</s>". The images' tokens then see the question, so the language
# model can mark the patches it asks about as it reads them; with the images first, a run
# described scenes right but answered "what colour is the star?" and counts near chance.
TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + '\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
SIDE = scenes.SIDE
# The tower's shape, set from the command line before anything is built (worker processes
# fork after that, so they see the same values).
PATCH, VISION_HIDDEN, VISION_LAYERS = 8, 192, 6
IMAGE_TOKENS = (SIDE // PATCH) ** 2
# Room for the longest answer (four shapes described: about 30 tokens).
MAX_ANSWER_TOKENS = 48


def corpus():
    """Every word the prompts and answers use, for the tokenizer."""
    words = ["USER:", "ASSISTANT:", "Describe the image.", "Which image has more shapes?", "The first.",
             "The second.", "Neither.", "Yes.", "No.", "None.", ", and .", "a an"]
    for s in scenes.SHAPES:
        words += [s, scenes.PLURAL[s], f"How many {scenes.PLURAL[s]} are there?", f"What colour is the {s}?",
                  f"Is there a {s} on the left?", f"Is there a {s} on the right?"]
    words += list(scenes.COLOURS) + [c.capitalize() + "." for c in scenes.COLOURS]
    words += scenes.NUMBERS + [n.lower() for n in scenes.NUMBERS] + [n + "." for n in scenes.NUMBERS]
    return words * 20


def build_tokenizer(out):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "clean_up_tokenization_spaces": False},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def build_model(tok):
    # Heads of 32 dimensions; the first run's 14-pixel patches (64 tokens, 4 × 128) learnt
    # colours but not shapes (rings read as circles, stars as triangles).
    vision = CLIPVisionConfig(hidden_size=VISION_HIDDEN, intermediate_size=4 * VISION_HIDDEN,
                              num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HIDDEN // 32,
                              image_size=SIDE, patch_size=PATCH, projection_dim=VISION_HIDDEN)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5,
                       rope_theta=10000.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         projector_hidden_act="gelu", vision_feature_layer=-2,
                         vision_feature_select_strategy="default", image_seq_length=IMAGE_TOKENS,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    return LlavaForConditionalGeneration(config)


def image_processor():
    return CLIPImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})


def example(seed, rng):
    """One training or evaluation item: (images, question, answer, kind, patch labels of each
    image), each image through the PNG or JPEG encoding a server is sent (so JPEG's
    artefacts are in training too)."""
    images, q, ans, kind = scenes.item(seed, rng)
    decoded = [Image.open(io.BytesIO(scenes.encode(img, s))).convert("RGB") for img, s, _ in images]
    return decoded, q, ans, kind, [patch_labels(placed) for _, _, placed in images]


def patch_labels(placed):
    """Per patch of a scene with layout `placed`, in the tower's token order (rows of
    patches): the shape (1 + its index in SHAPES) and the colour (1 + its index in COLOURS)
    of the shape whose disc covers the patch's centre, 0 where none does."""
    grid = SIDE // PATCH
    shapes, colours = [0] * grid * grid, [0] * grid * grid
    for i in range(grid):
        for j in range(grid):
            x, y = (j + 0.5) * PATCH, (i + 0.5) * PATCH
            for shape, colour, cx, cy, r in placed:
                if math.hypot(x - cx, y - cy) <= r:
                    shapes[i * grid + j] = 1 + scenes.SHAPES.index(shape)
                    colours[i * grid + j] = 1 + list(scenes.COLOURS).index(colour)
    return shapes, colours


class WithPatchLabels(torch.nn.Module):
    """The model, plus a linear head (not shipped) on the tower's features that the projector
    reads, trained to name each patch's shape and colour. The answers alone taught the tower
    colours but not shapes (two runs: counts and "what colour is the star" at chance): this
    dense signal reaches the tower directly."""

    def __init__(self, model, weight):
        super().__init__()
        self.model, self.weight = model, weight
        self.head = torch.nn.Linear(model.config.vision_config.hidden_size, 2 + len(scenes.SHAPES) + len(scenes.COLOURS))
        self.features = None
        layers = model.model.vision_tower.encoder.layers
        layers[model.config.vision_feature_layer].register_forward_hook(self._keep)

    def _keep(self, _module, _inputs, output):
        self.features = output[0] if isinstance(output, tuple) else output

    def forward(self, patch_shapes, patch_colours, **batch):
        out = self.model(**batch)
        logits = self.head(self.features[:, 1:]).float()  # the CLS token is not a patch
        n = 1 + len(scenes.SHAPES)
        ce = torch.nn.functional.cross_entropy
        aux = ce(logits[..., :n].flatten(0, 1), patch_shapes.flatten()) + ce(logits[..., n:].flatten(0, 1),
                                                                           patch_colours.flatten())
        out.loss = out.loss + self.weight * aux
        self.last = (logits[..., :n].detach(), patch_shapes)
        return out

    def report(self):
        """For the training log: how often a patch on a shape got its shape right in the
        last batch (read only when logged: it waits for the GPU)."""
        logits, truth = self.last
        on = truth > 0
        return f"patch shapes {(logits.argmax(-1) == truth)[on].float().mean().item():.1%}"


def prompt(q, n_images):
    """What TEMPLATE renders for one user turn with `n_images` images and the question."""
    return "USER: " + q + "\n" + "<image>\n" * n_images + "ASSISTANT:"


def batch(items, tok, proc):
    """Input ids (each `<image>` expanded to its tokens), pixel values, labels on the
    answers (and their `</s>`) only, and each image's patch labels, as CPU tensors."""
    ids, labels, pixels, patches = [], [], [], []
    for images, q, ans, _, image_labels in items:
        patches += image_labels
        p = tok(prompt(q, len(images)).replace("<image>", "<image>" * IMAGE_TOKENS))["input_ids"]
        a = tok(" " + ans, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append(p + a)
        labels.append([-100] * len(p) + a)
        pixels += images
    width = max(map(len, ids))
    pad = tok.pad_token_id
    return {
        "input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
        "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
        "pixel_values": proc(images=pixels, return_tensors="pt")["pixel_values"],
        "patch_shapes": torch.tensor([shapes for shapes, _ in patches]),
        "patch_colours": torch.tensor([colours for _, colours in patches]),
    }


class Batches:
    """Step `i`'s training batch, a function of `i` and the run's seed alone."""

    def __init__(self, tok, proc, size, seed):
        self.tok, self.proc, self.size, self.seed = tok, proc, size, seed

    def __call__(self, step):
        rng = random.Random(self.seed * 1_000_003 + step)
        items = [example(rng.randrange(HELD_OUT // 2), rng) for _ in range(self.size)]
        return batch(items, self.tok, self.proc)


def pixels(proc, images, model, device):
    return proc(images=images, return_tensors="pt")["pixel_values"].to(device, model.dtype)


def evaluate(model, tok, proc, device, n):
    """Greedy answers to `n` held-out items."""
    rng = random.Random(7)
    tally = trainer.Tally()
    for i in range(n):
        images, q, ans, kind, _ = example(HELD_OUT + i, rng)
        p = tok(prompt(q, len(images)).replace("<image>", "<image>" * IMAGE_TOKENS), return_tensors="pt").to(device)
        pv = pixels(proc, images, model, device)
        out = model.generate(**p, pixel_values=pv, max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False)
        tally.add(HELD_OUT + i, kind, q, ans, tok.decode(out[0, p["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return tally


def main():
    global PATCH, VISION_HIDDEN, VISION_LAYERS, IMAGE_TOKENS
    ap = argparse.ArgumentParser()
    trainer.add_args(ap, steps=6000, evals=500)
    ap.add_argument("--patch", type=int, default=PATCH)
    ap.add_argument("--vision-hidden", type=int, default=VISION_HIDDEN)
    ap.add_argument("--vision-layers", type=int, default=VISION_LAYERS)
    ap.add_argument("--patch-weight", type=float, default=0.5, help="the patch labels' loss weight")
    args = ap.parse_args()
    PATCH, VISION_HIDDEN, VISION_LAYERS = args.patch, args.vision_hidden, args.vision_layers
    IMAGE_TOKENS = (SIDE // PATCH) ** 2
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    tok = build_tokenizer(args.out)
    model = build_model(tok).to(args.device)
    proc = image_processor()
    proc.save_pretrained(args.out)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    trainer.train(WithPatchLabels(model, args.patch_weight).to(args.device), Batches(tok, proc, args.batch, args.seed), args.steps, args.lr,
                  args.device, args.workers, args.max_seconds)
    trainer.ship(model, args.out, args.steps, lambda m: evaluate(m, tok, proc, args.device, args.eval))


if __name__ == "__main__":
    main()
