#!/usr/bin/env python3
"""Writes an ImageNet-style labelled folder of generated images (for `eval` on a machine without
ImageNet): DIR/<wnid>/<n>.jpg|png, smooth random colour fields of random sizes, a few classes.
Labels are arbitrary (the model has random or real weights: accuracy is whatever it is); the point
is the loader, the settings and the comparisons at scale.

usage: make_labelled_folder.py DIR [--images 4000] [--classes 10] [--seed 0]
"""
import argparse
import os

import numpy as np
from PIL import Image

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361", "n01494475", "n01496331", "n01498041",
         "n01514668", "n01514859", "n01518878", "n01530575", "n01531178", "n01532829", "n01534433"]

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--images", type=int, default=4000)
ap.add_argument("--classes", type=int, default=10)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
rng = np.random.default_rng(a.seed)
for c in WNIDS[: a.classes]:
    os.makedirs(os.path.join(a.dir, c), exist_ok=True)
for i in range(a.images):
    h, w = int(rng.integers(180, 400)), int(rng.integers(180, 400))
    small = rng.random((max(h // 32, 2), max(w // 32, 2), 3)) * 255
    contrast = rng.uniform(0.2, 1.0)
    img = Image.fromarray(((small - 127.5) * contrast + 127.5).clip(0, 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)
    cls = WNIDS[i % a.classes]
    ext = "jpg" if i % 3 else "png"
    img.save(os.path.join(a.dir, cls, f"{i:05d}.{ext}"))
print(f"wrote {a.images} images in {a.classes} classes under {a.dir}")
