"""Writes a GGUF file of random blocks of every type the engine reads, with the gguf package
(llama.cpp's own Python library, pinned by the test), and beside it each tensor's values as
that library dequantizes them: the independent values the engine's dequantization must equal.

    python3 write_ref.py OUT_DIR

writes OUT_DIR/blocks.gguf and OUT_DIR/<tensor>.f32 (little-endian float32).
"""

import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# Where each type's f16 scales sit in a block (byte offsets), to make them finite.
F16_AT = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def main() -> None:
    out = sys.argv[1]
    rng = np.random.default_rng(20261205)
    w = GGUFWriter(f"{out}/blocks.gguf", "llama")
    rows = 3
    for name in TYPES:
        qt = T[name]
        per, size = GGML_QUANT_SIZES[qt]
        cols = 512
        if name in ("F32", "F16", "BF16"):
            vals = rng.standard_normal((rows, cols)).astype(np.float32)
            if name == "F32":
                raw = vals.view(np.uint8)
            elif name == "F16":
                raw = vals.astype(np.float16).view(np.uint8)
            else:
                raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            blocks = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
            for at in F16_AT[name]:
                scale = rng.uniform(-0.5, 0.5, size=blocks.shape[0]).astype(np.float16)
                blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
            raw = blocks.reshape(rows, -1)
        raw = np.ascontiguousarray(raw.reshape(rows, -1))
        w.add_tensor(f"t.{name}", raw, raw_dtype=qt)
        want = dequantize(raw, qt).astype(np.float32)
        assert want.shape == (rows, cols), (name, want.shape)
        want.tofile(f"{out}/t.{name}.f32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
