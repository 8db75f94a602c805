#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (nothing binary is committed): small valid inputs and a few broken
ones per target. Usage: make_seeds.py OUT_DIR  (creates OUT_DIR/{idx,cifar,text}). fuzz_checkpoint writes its own
seed, OUT_DIR/checkpoint/small.pt; when it is there, the crafted checkpoints of docs/reliability.md (sizes the file
does not hold) are derived from it next to it, so that every fuzz run replays them."""
import gzip
import io
import os
import random
import struct
import sys
import zipfile

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


# Crafted checkpoints (fuzz_checkpoint): each declares a size its file does not hold.
def zip_records(data):
    z = zipfile.ZipFile(io.BytesIO(data))
    return {i.filename: z.read(i.filename) for i in z.infolist()}


def rezip(records, deflate=None):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records.items():
            z.writestr(name, data, zipfile.ZIP_DEFLATED if name == deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def patched(data, old, new):  # same length: the zip offsets stay valid (LibTorch checks no CRC)
    assert len(old) == len(new) and old in data, old
    return data.replace(old, new, 1)


small = f"{out}/checkpoint/small.pt"
if os.path.exists(small):
    good = open(small, "rb").read()
    recs = zip_records(good)
    pkl = next(n for n in recs if n.endswith("/data.pkl"))
    # A pickle string of 1.7 GB (the first finding: LibTorch reserves and zero-fills it).
    save("checkpoint", "string_length", patched(good, b"X\x06\x00\x00\x00format", b"X\x06\x00\x00\x66format"))
    # A memo index of 2^32 - 16 (LibTorch resizes its memo table to it).
    save("checkpoint", "memo_index", rezip({**recs, pkl: b"\x80\x02}r\xf0\xff\xff\xff."}))
    # lists nested 1,001 deep (deeper ones overflow the stack when LibTorch frees them).
    save("checkpoint", "nesting", rezip({**recs, pkl: b"\x80\x02" + b"]" * 1001 + b"a" * 1000 + b"."}))
    # The version record deflated, declaring 4 GiB uncompressed (allocated before it is inflated): the size field of
    # its central directory entry and of its local header.
    version = next(n for n in recs if n.endswith("/version"))
    deflated = bytearray(rezip(recs, deflate=version))
    entry = deflated.find(b"PK\x01\x02")
    while deflated[entry + 46:entry + 46 + len(version)] != version.encode():
        entry = deflated.find(b"PK\x01\x02", entry + 4)
    local = struct.unpack_from("<I", deflated, entry + 42)[0]
    struct.pack_into("<I", deflated, entry + 24, 0xFFFFFFF0)
    struct.pack_into("<I", deflated, local + 22, 0xFFFFFFF0)
    save("checkpoint", "deflated_size", bytes(deflated))
    # conv.weight (2, 2, 3): a view of 64 rows past its 12-float record, an expanded view (stride 0), and a storage
    # whose element count (200) exceeds its record.
    shape = b"(K\x02K\x02K\x03t(K\x06K\x03K\x01t"
    save("checkpoint", "view_past_record", patched(good, shape, b"(K\x40K\x02K\x03t(K\x06K\x03K\x01t"))
    save("checkpoint", "expanded_view", patched(good, shape, b"(K\x02K\x02K\x03t(K\x00K\x03K\x01t"))
    save("checkpoint", "storage_numel", patched(good, b"cpuq\rK\x0ct", b"cpuq\rK\xc8t"))
    # 4,200 bytes after the end record (fuzz_checkpoint's 10-minute run): miniz's search for the record read before
    # the file's buffer.
    save("checkpoint", "trailing_bytes", good + bytes(4200))
