"""Makes a servable model directory of llava-1.5-7b-hf's shapes for `--load-format dummy`:
the real config.json and preprocessor_config.json from assets/, a stand-in tokenizer
(the tiny fixture's 1,000-token BPE padded with unreachable entries to 32,000, then
`<image>` at 32000, the real image_token_index, and `<pad>` at 32001), and the fixture's
input.png for the bench's TTFT runs. The text it writes is noise, as the weights are;
the shapes and the work are the real model's.

    python3 benches/gpu/stand_in_model.py OUT_DIR
"""
import json
import shutil
import sys
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
real, tiny = Path("assets/models/llava-1.5-7b-hf"), Path("assets/models/llava-tiny")
for name in ["config.json", "preprocessor_config.json"]:
    shutil.copy(real / name, out / name)
for name in ["chat_template.jinja", "tokenizer_config.json", "input.png"]:
    shutil.copy(tiny / name, out / name)
tok = json.loads((tiny / "tokenizer.json").read_text())
vocab = tok["model"]["vocab"]
base = len(vocab)
for i in range(base, 32000):
    vocab[f"<stand_in_{i}>"] = i
ids = {"<image>": 32000, "<pad>": 32001}
for t in tok["added_tokens"]:
    t["id"] = ids.get(t["content"], t["id"])
(out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
print(out)
