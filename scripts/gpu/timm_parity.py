"""Cross-checks our DeiT against timm on the GPU machine (which has torch and timm).

For each architecture: build timm's model with random weights (wide enough to give logits of
a few units), save its state dict as safetensors in the exact layout timm's Hub repos use, plus a
config.json with its pretrained_cfg, draw a test image whose size makes timm's resize an identity
(so both sides crop the same pixels), compute timm's f32 CPU logits, then run our `classify` on
the CPU and on CUDA (f32) and compare the top-5 logits: |Δ| <= 1e-4 and the same top-1.
Also runs `classify --device cuda` in f16 and bf16 and reports their top-1 agreement.

usage: python3 timm_parity.py WORKDIR PATH/TO/classify
"""
import json
import math
import subprocess
import sys

import numpy as np
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

work, classify = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
rng = np.random.default_rng(0)
failures = 0
TOL = 1e-4

for timm_name, ours in [
    ("deit_tiny_patch16_224", "deit-tiny"),
    ("deit_small_distilled_patch16_224", "deit-small-distilled"),
]:
    model = timm.create_model(timm_name, pretrained=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(max(p.shape[-1], 1)) * (3.0 if "head" in name else 1.0))
    weights = f"{work}/{timm_name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    cfg = dict(model.pretrained_cfg)
    with open(f"{work}/config.json", "w") as f:
        json.dump({"architecture": timm_name, "num_classes": 1000, "pretrained_cfg": cfg}, f, default=str)

    data_cfg = timm.data.resolve_data_config({}, model=model)
    side = math.floor(data_cfg["input_size"][-1] / data_cfg["crop_pct"])
    img = (rng.random((side, side, 3)) * 255).astype(np.uint8)
    # Smooth it a little so the image is not pure noise.
    img = ((img.astype(np.float32) + np.roll(img, 1, 0) + np.roll(img, 1, 1)) / 3).astype(np.uint8)
    path = f"{work}/{timm_name}.png"
    Image.fromarray(img).save(path)
    transform = timm.data.create_transform(**data_cfg)
    with torch.no_grad():
        x = transform(Image.open(path).convert("RGB")).unsqueeze(0)
        ref = model(x)[0].double().numpy()
    print(f"{timm_name}: data cfg {data_cfg}, image {side}x{side}, timm top-1 {int(ref.argmax())} logit {ref.max():.4f}")

    def run(device, dtype):
        cmd = [classify, path, "--model", ours, "--weights", weights, "--device", device, "--dtype", dtype, "--json", "--top-k", "5"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"classify failed: {' '.join(cmd)}\n{res.stderr}")
        return json.loads(res.stdout)["images"][0]["top_k"]

    results = {}
    for device, dtype in [("cpu", "f32"), ("cuda", "f32"), ("cuda", "f16"), ("cuda", "bf16")]:
        top = run(device, dtype)
        results[(device, dtype)] = top
        diffs = [abs(p["logit"] - ref[p["index"]]) for p in top]
        same_top1 = top[0]["index"] == int(ref.argmax())
        line = f"  {device:4} {dtype:4}: top-1 {top[0]['index']} ({'same' if same_top1 else 'DIFFERENT'}), max |Δlogit| vs timm over top-5 {max(diffs):.2e}"
        if dtype == "f32":
            ok = same_top1 and max(diffs) <= TOL
            line += " OK" if ok else f" FAIL (tolerance {TOL})"
            failures += 0 if ok else 1
        print(line)
    cpu, gpu = results[("cpu", "f32")], results[("cuda", "f32")]
    d = max(abs(a["logit"] - b["logit"]) for a, b in zip(cpu, gpu))
    same = [a["index"] for a in cpu] == [b["index"] for b in gpu]
    ok = same and d <= TOL
    failures += 0 if ok else 1
    print(f"  cpu f32 vs cuda f32: same top-5 {same}, max |Δlogit| {d:.2e} {'OK' if ok else 'FAIL'}")

    # The text output a user sees.
    print(subprocess.run([classify, path, "--model", ours, "--weights", weights, "--device", "cuda"], capture_output=True, text=True).stdout)

sys.exit(1 if failures else 0)
