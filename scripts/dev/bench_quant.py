"""Quantized weights on CPU: weight bytes and batch-1 / batch-16 decode tok/s, float vs formats.

    python scripts/dev/bench_quant.py                      # random Llama of hidden 512, 8 layers
    python scripts/dev/bench_quant.py --hidden 1024 --layers 8 --rounds 3

Writes a random float checkpoint, quantizes it with the tests' quantizer
(tests/helpers/quant_checkpoints.py) and serves each variant with ``LLM``: one engine per
variant (built and warmed once), then rounds that alternate the variants, medians reported.
On CPU the products dequantize inside the compiled step (no integer or fp8 units used), so
this measures what the weight bytes cost and save on this path, not a kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxlm import LLM, SamplingParams  # noqa: E402
from tests.helpers import quant_checkpoints as qc  # noqa: E402
from tests.helpers.tiny_models import make_tiny_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["float", "fp8-online", "ct-w8a16", "ct-w4a16", "awq"])
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_quant_")
    base = make_tiny_llama(os.path.join(work, "float"), hidden_size=args.hidden, num_hidden_layers=args.layers,
                           intermediate_size=3 * args.hidden, num_attention_heads=args.hidden // 64,
                           num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab)
    engines = {}
    for v in args.variants:
        path, quant = base, None
        if v == "fp8-online":
            quant = "fp8"
        elif v != "float":
            path, _ = qc.write_quantized(base, v, os.path.join(work, v), os.path.join(work, v + "-ref"))
        engines[v] = LLM(model=path, quantization=quant, max_num_seqs=16, max_model_len=256,
                         max_num_batched_tokens=256, token_buckets=[16, 256], seq_buckets=[1, 16])
    prompt = [1] + [3 + (7 * j) % 250 for j in range(63)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in (1, 16):
            for v, llm in engines.items():
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
                times.setdefault((v, batch), []).append(batch * args.tokens / (time.perf_counter() - start))
    print(f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.rounds} rounds, medians; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<12} {'weight MiB':>10} {'b1 tok/s':>9} {'b16 tok/s':>10}")
    for v, llm in engines.items():
        mib = llm.llm_engine.engine_config.model_config.weight_bytes / 2**20
        print(f"{v:<12} {mib:>10.1f} {statistics.median(times[(v, 1)]):>9.1f} "
              f"{statistics.median(times[(v, 16)]):>10.1f}")


if __name__ == "__main__":
    main()
