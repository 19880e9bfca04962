"""Qwen2-VL and Qwen2.5-VL through `mmserve serve` on the GPU (f32 and bf16): the
fixture's image and prompt, greedy, against transformers' tokens (reference.json).

    python3 benches/gpu/qwen_vl_smoke.py .gpu/bin/mmserve
"""
import base64, json, subprocess, sys, urllib.request

binary = sys.argv[1]
for name in ["qwen2-vl-tiny", "qwen2.5-vl-tiny"]:
    d = f"assets/models/{name}"
    ref = json.load(open(f"{d}/reference.json"))
    png = base64.b64encode(open(f"{d}/input.png", "rb").read()).decode()
    for dtype in ["float32", "bfloat16"]:
        p = subprocess.Popen([binary, "serve", "--port", "0", "--model", d, "--device", "cuda", "--dtype", dtype],
                             stdout=subprocess.PIPE, text=True)
        url = None
        for line in p.stdout:
            if line.startswith("mmserve: serving "):
                url = line.split(" at ")[1].strip()
                break
        body = {"model": name, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": "What is shown in this image?"}]}]}
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        got = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["token_ids"]
        want = ref["generated_ids"]
        print(f"{name} {dtype}: {'identical' if got == want else 'DIFFERENT'} {got} (transformers {want})")
        p.terminate(); p.wait(timeout=30)
