"""Rewrite a GGUF file with its 2-D tensors in another block type, by the ``gguf`` package's
quantizer from the dequantized tensors (metadata and 1-D tensors copied as they are).

    python scripts/dev/gguf_requantize.py IN.gguf OUT.gguf --type Q8_0

For benchmarks: a Q8_0 file of the default model (SmolLM2-135M-Instruct ships Q4_1) that both
jaxlm and llama.cpp read. With ``--llama-cpp-ftype Q4_K_M`` (any LLAMA_FTYPE_MOSTLY_* name) the
tensors go through F32 and then llama.cpp's own quantizer (llama-cpp-python's binding), which
picks each tensor's type as llama.cpp does (a Q4_K_M file: Q4_K and Q6_K, with fallbacks such
as Q5_0 where a row is not whole super-blocks of 256):

    python scripts/dev/gguf_requantize.py IN.gguf OUT.gguf --llama-cpp-ftype Q4_K_M
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np


def requantize(src: str, dst: str, type_name: str) -> None:
    """src's 2-D tensors in type_name (the gguf package's quantizer), written to dst."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
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


def llama_cpp_quantize(src: str, dst: str, ftype: str) -> None:
    """src (F32 or F16 tensors) quantized by llama.cpp to LLAMA_FTYPE_MOSTLY_{ftype}, written to dst."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama.cpp's quantizer failed ({rc}) on {src}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_1", "F16", "F32"])
    p.add_argument("--llama-cpp-ftype", metavar="NAME", help="llama.cpp's quantizer to this file type (e.g. Q4_K_M)")
    args = p.parse_args()
    if not args.llama_cpp_ftype:
        requantize(args.src, args.dst, args.type)
        return
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.dst))) as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        requantize(args.src, f32, "F32")
        llama_cpp_quantize(f32, args.dst, args.llama_cpp_ftype)


if __name__ == "__main__":
    main()
