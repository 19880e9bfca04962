"""Makes a servable model directory of a real model's shapes for `--load-format dummy`:
the real config.json and preprocessor_config.json from assets/, a stand-in tokenizer (the
tiny fixture's BPE padded with unreachable entries up to the real vocabulary's special
tokens, which keep their real ids), the fixture's chat template, and its input.png for
the bench's TTFT runs. The text it writes is noise, as the weights are; the shapes and
the work are the real model's.

    python3 benches/gpu/stand_in_model.py OUT_DIR [llava | qwen2.5-vl | qwen2-vl]

llava: llava-1.5-7b-hf (1,000 BPE tokens padded to 32,000, then `<image>` at 32000, the
real image_token_index, and `<pad>` at 32001). qwen2.5-vl / qwen2-vl: the 7B Instruct
models (2,000 BPE tokens padded to 151,643, then the special tokens in Qwen's order from
151643: `<|im_end|>` 151645, `<|image_pad|>` 151655).
"""
import json
import shutil
import sys
from pathlib import Path

out = Path(sys.argv[1])
family = sys.argv[2] if len(sys.argv) > 2 else "llava"
real, tiny, first_special = {
    "llava": ("llava-1.5-7b-hf", "llava-tiny", 32000),
    "qwen2.5-vl": ("qwen2.5-vl-7b-instruct", "qwen2.5-vl-tiny", 151643),
    "qwen2-vl": ("qwen2-vl-7b-instruct", "qwen2-vl-tiny", 151643),
}[family]
real, tiny = Path("assets/models") / real, Path("assets/models") / tiny
out.mkdir(parents=True, exist_ok=True)
for name in ["config.json", "preprocessor_config.json"]:
    shutil.copy(real / name, out / name)
for name in ["chat_template.jinja", "tokenizer_config.json", "input.png"]:
    shutil.copy(tiny / name, out / name)
tok = json.loads((tiny / "tokenizer.json").read_text())
vocab = tok["model"]["vocab"]
base = len(vocab)
for i in range(base, first_special):
    vocab[f"<stand_in_{i}>"] = i
if family == "llava":
    ids = {"<image>": 32000, "<pad>": 32001}
    for t in tok["added_tokens"]:
        t["id"] = ids.get(t["content"], t["id"])
else:
    # The tiny's special tokens follow its BPE in the real vocabulary's order.
    for t in tok["added_tokens"]:
        t["id"] = first_special + t["id"] - base
(out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
print(out)
