"""Host costs of structured outputs: compiling a constraint, and the mask of one decode step.

    python scripts/bench_structured.py                       # SmolLM2's tokenizer (V = 49152)
    python scripts/bench_structured.py --tokenizer PATH --rows 1 16 64 --threads 4

Reports
  tokenizer      building llguidance's view of the tokenizer (once per engine)
  compile cold   a typical JSON schema, a regex, a choice list, a Lark grammar: a compile with
                 the manager's cache cleared (llguidance builds its lexer/parser against the vocab),
                 median of --iters, and the very first one
  compile cached the same constraint again: cache lookup + a matcher deep copy (new_request)
  fill / accept  per decode step, walking a valid document token by token (tokenized as the model
                 would write it): filling the [rows, ceil(V/32)] bitmask for `rows` requests in one
                 batched call, and accepting the sampled token for each; median and p90 over steps
  apply          apply_token_bitmask jitted at [rows, V] on the default JAX device
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from jaxlm.structured_output.manager import StructuredOutputManager  # noqa: E402
from jaxlm.structured_output.params import StructuredOutputsParams  # noqa: E402

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 60},
                           "city": {"type": "string", "maxLength": 40},
                           "country": {"type": "string", "maxLength": 40}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
PERSON_DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor",
              "address": {"street": "12 St James's Square", "city": "London", "country": "United Kingdom"},
              "tags": ["math", "engines", "poetry"], "active": True}
CONSTRAINTS = {
    "json schema": StructuredOutputsParams(json=PERSON_SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]+ [0-9]{1,4}(, [A-Z][a-z]+)*"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed"]),
    "lark": StructuredOutputsParams(grammar='start: expr\nexpr: term (("+" | "-") term)*\n'
                                    'term: NUM | "(" expr ")"\nNUM: /[0-9]+/'),
}


def load_tokenizer(path: str | None):
    from jaxlm.config import ModelConfig
    from jaxlm.model_loader import get_tokenizer
    from jaxlm.model_loader.formats import default_model_path

    return get_tokenizer(ModelConfig(model=path or default_model_path()))


def _ms(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s) * 1e3:8.3f} ms   p90 {s[int(0.9 * (len(s) - 1))] * 1e3:8.3f} ms"


def bench_compile(mgr: StructuredOutputManager, iters: int) -> None:
    for name, params in CONSTRAINTS.items():
        cold, cached = [], []
        for _ in range(iters):
            mgr.clear_cache()
            t0 = time.perf_counter()
            mgr.new_request(params)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mgr.new_request(params)
            cached.append(time.perf_counter() - t0)
        print(f"compile cold   {name:<12} {_ms(cold)}   first {cold[0] * 1e3:.3f} ms")
        print(f"compile cached {name:<12} {_ms(cached)}")


def bench_steps(mgr: StructuredOutputManager, tokenizer, rows: int) -> None:
    params = CONSTRAINTS["json schema"]
    tokens = tokenizer.encode(json.dumps(PERSON_DOC), add_special_tokens=False)
    reqs = [mgr.new_request(params) for _ in range(rows)]
    bitmask = mgr.allocate_bitmask(rows)
    pairs = [(r, i) for i, r in enumerate(reqs)]
    fill, accept = [], []
    for t in tokens:
        t0 = time.perf_counter()
        mgr.fill_bitmask(bitmask, pairs)
        t1 = time.perf_counter()
        for r in reqs:
            if not r.accept_token(t):
                raise RuntimeError(f"the document does not fit its schema at token {t}: {r.error}")
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        accept.append(t2 - t1)
    assert all(r.is_terminated() for r in reqs)
    print(f"rows {rows:>3}  fill   {_ms(fill)}   ({len(tokens)} steps, per row "
          f"{statistics.median(fill) / rows * 1e6:.1f} us)")
    print(f"rows {rows:>3}  accept {_ms(accept)}")


def bench_apply(vocab: int, rows: int, iters: int) -> None:
    import jax

    from jaxlm.structured_output.bitmask import apply_token_bitmask

    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.standard_normal((rows, vocab), dtype=np.float32))
    mask = jax.device_put(rng.integers(-2**31, 2**31, (rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32))
    fn = jax.jit(apply_token_bitmask)
    fn(logits, mask).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(logits, mask).block_until_ready()
        times.append(time.perf_counter() - t0)
    print(f"rows {rows:>3}  apply  {_ms(times)}   on {jax.devices()[0].platform}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or GGUF (default: SmolLM2's GGUF)")
    p.add_argument("--vocab", type=int, default=None, help="model vocab (default: the tokenizer's)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--threads", type=int, default=None, help="llguidance mask threads (default: its own)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-apply", action="store_true", help="skip the JAX apply timing")
    args = p.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    vocab = args.vocab or len(tokenizer)
    t0 = time.perf_counter()
    mgr = StructuredOutputManager(tokenizer, vocab, num_threads=args.threads)
    print(f"V = {vocab}, bitmask row = {mgr.bitmask_width} int32 words; "
          f"tokenizer {(time.perf_counter() - t0) * 1e3:.0f} ms; cpus {os.cpu_count()}")
    bench_compile(mgr, args.iters)
    for rows in args.rows:
        bench_steps(mgr, tokenizer, rows)
    if not args.no_apply:
        for rows in args.rows:
            bench_apply(vocab, rows, args.iters * 5)


if __name__ == "__main__":
    main()
