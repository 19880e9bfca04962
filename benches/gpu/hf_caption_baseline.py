"""transformers' batched generate() captioning distinct images, the baseline of
`mmserve bench caption` on the GPU: llava-1.5-7b's shapes with random bf16 weights, the
real CLIP preprocessing (CLIPImageProcessor from assets/models/llava-1.5-7b-hf) of
generated images of mixed sizes, a prompt of the stand-in's length, 64 new tokens each
(min_new_tokens, as random weights would stop anywhere), batches of 32. Images/s over
the whole run, preprocessing included (as mmserve's figure includes it).

    python3 benches/gpu/hf_caption_baseline.py [IMAGES] [BATCH]
"""
import sys, time
import numpy as np
import torch
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
dev = torch.device("cuda")
vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                          image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5)
text = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5)
cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=32000, projector_hidden_act="gelu",
                  vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=576)
cfg._attn_implementation = "sdpa"
with torch.device("meta"):
    model = LlavaForConditionalGeneration(cfg)
model = model.to_empty(device=dev).to(torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.eval()
proc = CLIPImageProcessor.from_pretrained("assets/models/llava-1.5-7b-hf")

def image(i):
    side = 336 + (1024 - 336) * i // n
    x, y = np.meshgrid(np.arange(side, dtype=np.uint32), np.arange(side, dtype=np.uint32))
    rgb = np.stack([(x * 7) ^ i, y * 5 + i, (x + y) ^ (i >> 8)], -1).astype(np.uint8)
    return Image.fromarray(rgb)

images = [image(i) for i in range(n)]
prompt = [1] + [32000] * 576 + list(range(400, 430))  # BOS, the image, ~30 prompt tokens
def run(imgs):
    px = proc(images=imgs, return_tensors="pt").pixel_values.to(dev, torch.bfloat16)
    ids = torch.tensor([prompt] * len(imgs), device=dev)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px,
                             max_new_tokens=64, min_new_tokens=64, do_sample=False)
    return out.shape[1] - ids.shape[1]

run(images[:2])  # warm-up
torch.cuda.synchronize()
t0 = time.time()
new = 0
for i in range(0, n, batch):
    new += run(images[i:i + batch]) * len(images[i:i + batch])
torch.cuda.synchronize()
secs = time.time() - t0
print(f"transformers generate: {n} images in batches of {batch}: {n / secs:.2f} images/s, "
      f"{new / secs:.0f} output tok/s, {secs:.1f} s")
