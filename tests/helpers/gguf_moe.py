"""Tiny MoE models written as GGUF with quantized experts, and the float checkpoint of their
dequantized weights (transformers' reference), for tests/models/quantization/test_moe_gguf.py and
gguf_moe_mesh_cases.py."""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Callable

import gguf
import numpy as np
import transformers
from safetensors.numpy import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_loader"))
from gguf_writer import write_gguf  # noqa: E402

_Q = gguf.GGMLQuantizationType
ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def write(src: str, out_dir: str, quant: Callable[[str], gguf.GGMLQuantizationType], family: str) -> tuple[str, str]:
    """(the GGUF of ``src``, with each 2-D tensor's type ``quant(name)`` -- the experts' names
    are the stacked ``blk.N.ffn_*_exps.weight`` --, an HF checkpoint of its dequantized weights)."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = transformers.AutoConfig.from_pretrained(src)
    path = os.path.join(out_dir, "model.gguf")
    deq = write_gguf(src, path, cfg, quant, arch=ARCHS[family])
    state = {}
    for name, arr in deq.items():
        m = _EXPS.match(name)
        if m is None:
            state[name] = arr.reshape(-1, arr.shape[-1]) if name.endswith("shared_expert_gate.weight") else arr
            continue
        for e in range(arr.shape[0]):
            if family == "mixtral":
                state[f"model.layers.{m.group(1)}.block_sparse_moe.experts.{e}.{_MIXTRAL[m.group(2)]}.weight"] = arr[e]
            else:
                state[f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}_proj.weight"] = arr[e]
    # The checkpoint's own tensors replaced by the file's values (transformers fuses the experts
    # in memory, so the reference is written as a checkpoint, in the per-expert names it reads).
    ref = os.path.join(out_dir, "ref")
    shutil.copytree(src, ref, dirs_exist_ok=True)
    original = load_file(os.path.join(src, "model.safetensors"))
    assert set(original) == set(state), set(original) ^ set(state)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}, os.path.join(ref, "model.safetensors"),
              metadata={"format": "pt"})
    return path, ref


def expert_tensor_bytes(path: str) -> dict[str, int]:
    """Bytes of each stacked expert tensor in the file."""
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if _EXPS.match(t.name)}


def expert_kernel_layout_bytes(path: str) -> int:
    """Bytes of the stacked expert tensors once each expert's blocks are in the C++ kernel's layout
    (kernels_cpu/gguf_matmul.py: to_kernel_layout; the K-quants' scales unpacked, rows padded to 16)."""
    import numpy as np

    from kernels_cpu.gguf_matmul import to_kernel_layout

    total = 0
    for t in gguf.GGUFReader(path).tensors:
        if _EXPS.match(t.name):
            data = np.asarray(t.data)
            data = data.reshape(-1, *data.shape[-2:])  # [E, rows, row bytes]
            total += sum(to_kernel_layout(e, int(t.tensor_type)).nbytes for e in data)
    return total


def run_llm(path: str, tokenizer: str, quantization: str | None = None, twice: bool = False,
            **engine) -> tuple[list[dict], dict]:
    """quant_moe.run_llm on a GGUF file, plus: the dtype of every Param by path (``dtypes``) and,
    with ``twice``, the outputs of the same prompts again (``again``: served from the prefix cache)."""
    import jax
    from flax import nnx

    from jaxlm import LLM, SamplingParams
    from tests.helpers import quant_moe as qm

    llm = LLM(model=path, tokenizer=tokenizer, quantization=quantization, **{**qm.ENGINE, **engine})
    params = SamplingParams(max_tokens=qm.N_OUT, temperature=0.0, logprobs=qm.TOP_K, ignore_eos=True)

    def generate() -> list[dict]:
        outs = llm.generate([{"prompt_token_ids": p} for p in qm.PROMPTS], params, use_tqdm=False)
        return [dict(tokens=list(o.outputs[0].token_ids),
                     logprobs=[{int(t): lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                for o in outs]

    got = generate()
    runner = llm.llm_engine.get_model_runner()
    flat = nnx.to_flat_state(runner.params)
    dev = jax.devices()[0]

    def shard(value) -> list[int]:  # device 0's
        return list([s.data for s in value.addressable_shards if s.device == dev][0].shape)

    experts = {".".join(map(str, p)): dict(dtype=str(v.get_value().dtype), shape=list(v.get_value().shape),
                                           shard=shard(v.get_value()), bytes=int(v.get_value().nbytes))
               for p, v in flat if "experts" in p}
    facts = dict(experts=experts, dtypes={".".join(map(str, p)): str(v.get_value().dtype) for p, v in flat},
                 weight_bytes=llm.llm_engine.engine_config.model_config.weight_bytes)
    if twice:
        facts["again"] = generate()
    facts["compiles"] = runner.num_compiles_after_warmup
    del llm
    return got, facts
