"""Rewrite a GGUF file with its 2-D tensors in another block type, by the ``gguf`` package's
quantizer from the dequantized tensors (metadata and 1-D tensors copied as they are).

    python scripts/dev/gguf_requantize.py IN.gguf OUT.gguf --type Q8_0

For benchmarks: a Q8_0 file of the default model (SmolLM2-135M-Instruct ships Q4_1) that both
jaxlm and llama.cpp read.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_1", "F16", "F32"])
    args = p.parse_args()
    qtype = gguf.GGMLQuantizationType[args.type]
    r = gguf.GGUFReader(args.src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(args.dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer's own header fields
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if data.ndim >= 2 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
