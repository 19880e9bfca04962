"""How far transformers' own bf16 run of the LLaVA fixture is from its f32 reference
logits, measured the way `mmserve bench model --parity` measures ours (max |Δ| over the
largest |logit|, and ‖Δ‖₂ / ‖ref‖₂): the floor any bf16 implementation sits near. Run on
the GPU machine beside benches/gpu/run.sh:  python3 benches/gpu/hf_bf16_error.py
"""
import json

import torch
from safetensors.torch import load_file
from transformers import LlavaForConditionalGeneration

DIR = "assets/models/llava-tiny"
ref = load_file(f"{DIR}/reference.safetensors")
want = ref["logits"].double()
out = {}
for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    model = LlavaForConditionalGeneration.from_pretrained(DIR, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(
            input_ids=ref["input_ids"][None].cuda(),
            attention_mask=ref["attention_mask"][None].cuda(),
            pixel_values=ref["pixel_values"].to(dtype).cuda(),
        ).logits[0].double().cpu()
    d = logits - want
    greedy = bool((logits.argmax(-1) == want.argmax(-1)).all())
    out[name] = {
        "max_rel": float(d.abs().max() / want.abs().max()),
        "l2_rel": float(d.norm() / want.norm()),
        "argmax_identical_per_position": greedy,
    }
print(json.dumps({"transformers_vs_reference": out}))
