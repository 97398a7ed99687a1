"""Pooling runner against sentence-transformers on this CPU, side by side in one process.

  python scripts/dev/bench_pooling.py embed    # 2,000 sentences of 8-128 tokens, all-MiniLM-L6 shape
  python scripts/dev/bench_pooling.py rerank   # a cross-encoder of that shape, 100 documents a query
  python scripts/dev/bench_pooling.py server   # /v1/embeddings, 8 concurrent clients

Models are random (f32), built here with transformers: all-MiniLM-L6-v2's shape (BERT, hidden
384, 6 layers, 12 heads, FFN 1536, vocabulary 30,522, mean pooling + Normalize). Timings run
from text in to vectors out (tokenization included) on both sides; sentence-transformers runs
``encode(batch_size=32)`` / ``CrossEncoder.predict(batch_size=32)`` with 2 torch threads. A/B
rounds are interleaved and medians reported, since the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _write_tokenizer(path: str) -> None:
    import transformers

    vocab = SPECIALS + [f"w{i}" for i in range(MINILM["vocab_size"] - len(SPECIALS))]
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(os.path.join(path, "vocab.txt"), model_max_length=512).save_pretrained(path)


def build_models(root: str) -> tuple[str, str]:
    import torch
    import transformers

    emb, ce = os.path.join(root, "minilm"), os.path.join(root, "minilm-ce")
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**MINILM)).eval().save_pretrained(emb, safe_serialization=True)
    _write_tokenizer(emb)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(emb, "1_Pooling"))
    os.makedirs(os.path.join(emb, "2_Normalize"))
    json.dump(modules, open(os.path.join(emb, "modules.json"), "w"))
    json.dump({"word_embedding_dimension": 384, "pooling_mode": "mean"},
              open(os.path.join(emb, "1_Pooling", "config.json"), "w"))
    json.dump({"max_seq_length": 128}, open(os.path.join(emb, "sentence_bert_config.json"), "w"))
    transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=1, **MINILM)).eval() \
        .save_pretrained(ce, safe_serialization=True)
    _write_tokenizer(ce)
    return emb, ce


def sentences(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """n texts of lo..hi tokens each ([CLS] and [SEP] included)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo - 2, hi - 1, size=n)
    return [" ".join(f"w{w}" for w in rng.integers(0, 30000, size=int(k))) for k in lens]


def _median_rounds(fns: dict, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # interleaved: A, B, A, B, ...
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _report(title: str, times: dict[str, list[float]], ours: str, theirs: str, units: int, unit: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{title}")
    for k, v in times.items():
        print(f"  {k:28s} median {med[k]:7.3f} s  ({units / med[k]:8.1f} {unit}/s)  rounds {[round(x, 3) for x in v]}")
    print(f"  speed-up {med[theirs] / med[ours]:.2f}x")


def bench_embed(emb: str, args: argparse.Namespace) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    from jaxlm import LLM

    torch.set_num_threads(2)
    texts = sentences(args.n, 8, 128)
    llm = LLM(emb, max_model_len=128, max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs)
    st = SentenceTransformer(emb, device="cpu")
    st.max_seq_length = 128
    ours = np.array([o.outputs.embedding for o in llm.embed(texts[:50])])
    ref = st.encode(texts[:50], batch_size=32)
    print(f"max |jaxlm - sentence-transformers| over 50 texts: {np.abs(ours - ref).max():.2e}")
    times = _median_rounds({"jaxlm LLM.embed": lambda: llm.embed(texts),
                            "sentence-transformers encode": lambda: st.encode(texts, batch_size=32)}, args.rounds)
    _report(f"embed {args.n} sentences of 8-128 tokens (all-MiniLM-L6 shape, f32)", times, "jaxlm LLM.embed",
            "sentence-transformers encode", args.n, "sentences")
    print(f"  compiles after warm-up: {llm.llm_engine.num_compiles_after_warmup}; programs "
          f"{len(llm.llm_engine.buckets.programs())}")


def bench_rerank(ce: str, args: argparse.Namespace) -> None:
    import torch
    from sentence_transformers import CrossEncoder

    from jaxlm import LLM

    torch.set_num_threads(2)
    queries = sentences(args.queries, 8, 16, seed=1)
    docs = [sentences(100, 16, 100, seed=10 + i) for i in range(args.queries)]
    llm = LLM(ce, max_model_len=128, max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs)
    model = CrossEncoder(ce, device="cpu", max_length=128)
    ours = [o.outputs.score for o in llm.score(queries[0], docs[0])]
    ref = model.predict([(queries[0], d) for d in docs[0]], batch_size=32)
    print(f"max |jaxlm - CrossEncoder.predict| over 100 pairs: {np.abs(np.array(ours) - ref).max():.2e}")

    def run_ours():
        for q, ds in zip(queries, docs):
            llm.score(q, ds)

    def run_theirs():
        for q, ds in zip(queries, docs):
            model.predict([(q, d) for d in ds], batch_size=32)

    times = _median_rounds({"jaxlm LLM.score": run_ours, "CrossEncoder.predict": run_theirs}, args.rounds)
    _report(f"rerank {args.queries} queries x 100 documents (16-100 tokens), cross-encoder of that shape", times,
            "jaxlm LLM.score", "CrossEncoder.predict", args.queries * 100, "pairs")


def bench_server(emb: str, args: argparse.Namespace) -> None:
    import httpx

    from tests.serve.server_process import ServerProcess

    srv = ServerProcess(emb, ["--max-model-len", "128", "--max-num-batched-tokens", str(args.budget),
                              "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "minilm"])
    texts = sentences(args.requests, 8, 128, seed=2)
    try:
        async def client(i: int, latencies: list[float], http: httpx.AsyncClient) -> None:
            for k in range(i, len(texts), args.concurrency):
                t0 = time.perf_counter()
                r = await http.post("/v1/embeddings", json={"model": "minilm", "input": texts[k]})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)

        async def run() -> tuple[float, list[float]]:
            latencies: list[float] = []
            async with httpx.AsyncClient(base_url=srv.base, timeout=120) as http:
                await http.post("/v1/embeddings", json={"input": texts[:8]})  # warm the connection
                t0 = time.perf_counter()
                await asyncio.gather(*(client(i, latencies, http) for i in range(args.concurrency)))
                return time.perf_counter() - t0, latencies

        for _ in range(args.rounds):
            wall, lat = asyncio.run(run())
            lat_ms = np.array(lat) * 1000
            print(f"\nserver /v1/embeddings, {args.concurrency} concurrent clients, {args.requests} requests of one "
                  f"sentence (8-128 tokens): {args.requests / wall:.1f} req/s, latency p50 "
                  f"{np.percentile(lat_ms, 50):.1f} ms, p99 {np.percentile(lat_ms, 99):.1f} ms")
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", default=["embed", "rerank", "server"], choices=["embed", "rerank", "server"])
    p.add_argument("--n", type=int, default=2000, help="sentences to embed")
    p.add_argument("--queries", type=int, default=5, help="rerank queries (100 documents each)")
    p.add_argument("--requests", type=int, default=400, help="server requests")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=int, default=2048, help="jaxlm --max-num-batched-tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        emb, ce = build_models(root)
        if "embed" in args.what:
            bench_embed(emb, args)
        if "rerank" in args.what:
            bench_rerank(ce, args)
        if "server" in args.what:
            bench_server(emb, args)


if __name__ == "__main__":
    main()
