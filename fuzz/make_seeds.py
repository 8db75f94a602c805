#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (nothing binary is committed): small valid inputs and a few broken
ones per target. Usage: make_seeds.py OUT_DIR  (creates OUT_DIR/{idx,cifar,text}; fuzz_checkpoint writes its own
seed)."""
import gzip
import os
import random
import struct
import sys

out = sys.argv[1]
rng = random.Random(0)


def idx_pair(n, h, w, gz_images=False, gz_labels=False, label_max=9):
    images = struct.pack(">IIII", 0x803, n, h, w) + bytes(rng.randrange(256) for _ in range(n * h * w))
    labels = struct.pack(">II", 0x801, n) + bytes(rng.randrange(label_max + 1) for _ in range(n))
    if gz_images:
        images = gzip.compress(images, mtime=0)
    if gz_labels:
        labels = gzip.compress(labels, mtime=0)
    return struct.pack(">H", len(images)) + images + labels  # fuzz_idx: 2-byte cut, images, labels


def save(kind, name, data):
    os.makedirs(f"{out}/{kind}", exist_ok=True)
    with open(f"{out}/{kind}/{name}", "wb") as f:
        f.write(data)


save("idx", "plain", idx_pair(3, 4, 5))
save("idx", "gzip", idx_pair(3, 4, 5, gz_images=True, gz_labels=True))
save("idx", "mixed", idx_pair(2, 6, 6, gz_labels=True))
save("idx", "empty_images", idx_pair(0, 1, 1))
save("idx", "label_range", idx_pair(4, 2, 2, label_max=12))
p = idx_pair(3, 4, 5)
save("idx", "truncated", p[:-7])
for kind, label_bytes, classes in ((0, 1, 10), (1, 2, 100)):
    recs = b"".join(bytes(rng.randrange(classes if i else 20) for i in range(label_bytes)) +
                    bytes(rng.randrange(256) for _ in range(3072)) for _ in range(2))
    save("cifar", f"kind{kind}", bytes([kind]) + recs)
    save("cifar", f"kind{kind}_truncated", bytes([kind]) + recs[:-100])
save("cifar", "bad_label", bytes([0, 10]) + bytes(3072))

# Text (fuzz_text): first byte picks the block size (1 + byte % 64), the rest is input.txt.
line = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
save("text", "valid", bytes([7]) + line * 5)
save("text", "too_short", bytes([63]) + line)
save("text", "nul", bytes([3]) + line * 2 + b"\0" + line)
save("text", "binary", bytes([1]) + bytes(range(256)))
