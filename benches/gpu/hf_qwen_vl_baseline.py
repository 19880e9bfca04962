"""transformers beside `mmserve bench model` at Qwen2.5-VL-7B-Instruct's shapes (random bf16
weights from assets/models/qwen2.5-vl-7b-instruct/config.json, sdpa), with CUDA events
after warm-up:
  - the vision tower and merger (Qwen2_5_VisionTransformerPretrainedModel) images/s for one
    image of each side in SIDES, and a batch of BATCH images cycling through them;
  - the LM: prefill of 2,048 tokens, and greedy decode tok/s at batch 1 and 64 (prompt
    512, 128 new tokens, generate() less one prefill).
Grids follow the preprocessor's smart_resize (multiples of 28). Prints one line a figure.

    python3 benches/gpu/hf_qwen_vl_baseline.py [SIDES=448,1024] [BATCH=32] [vision]

With `vision` as the third argument, the tower only.
"""
import sys, time
import torch
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

sides = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "448,1024").split(",")]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
dev = torch.device("cuda")
cfg = AutoConfig.from_pretrained("assets/models/qwen2.5-vl-7b-instruct")
cfg._attn_implementation = "sdpa"
cfg.vision_config._attn_implementation = "sdpa"


def ev_time(fn, iters=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2] / 1000.0


def random_init(module):
    module = module.to_empty(device=dev).to(torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.eval()


def grid(side):
    g = round(side / 28) * 2
    return [1, g, g]


with torch.device("meta"):
    vision = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg.vision_config)
vision = random_init(vision)
runs = [(str(s), [grid(s)]) for s in sides] + [(f"mix of {len(sides)}", [grid(sides[i % len(sides)]) for i in range(batch)])]
with torch.no_grad():
    for label, grids in runs:
        patches = sum(t * h * w for t, h, w in grids)
        px = torch.randn(patches, 3 * 2 * 14 * 14, device=dev, dtype=torch.bfloat16)
        thw = torch.tensor(grids, device=dev)
        t = ev_time(lambda: vision(px, grid_thw=thw))
        print(f"transformers vision batch {len(grids)} ({label}): {len(grids) / t:.1f} img/s {t * 1e3:.2f} ms")
del vision
torch.cuda.empty_cache()
if len(sys.argv) > 3 and sys.argv[3] == "vision":
    sys.exit(0)

with torch.device("meta"):
    model = Qwen2_5_VLForConditionalGeneration(cfg)
model = random_init(model)
with torch.no_grad():
    ids = torch.randint(0, 150000, (1, 2048), device=dev)
    t = ev_time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), 5, 2)
    print(f"transformers prefill 2048 tokens: {2048 / t:.0f} tok/s {t * 1e3:.1f} ms")
    for bs in (1, 64):
        ids = torch.randint(0, 150000, (bs, 512), device=dev)
        mask = torch.ones_like(ids)
        gen = lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, min_new_tokens=128,
                                     do_sample=False, pad_token_id=0)
        gen()
        torch.cuda.synchronize(); t0 = time.time(); gen(); torch.cuda.synchronize(); total = time.time() - t0
        pre = ev_time(lambda: model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1), 3, 1)
        print(f"transformers decode batch {bs}: {bs * 127 / max(total - pre, 1e-6):.1f} tok/s")
