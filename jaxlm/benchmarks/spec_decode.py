"""Speculative decoding against none, side by side in one process (scripts/bench.py --speculative-config).

    python scripts/bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    python scripts/bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \\
        --spec-workload random --spec-batch 1
    python scripts/bench.py --speculative-config '{"method": "draft_model", "model": "SAME", ...}'  # draft = target
    python scripts/bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \\
        --spec-workload mixed --spec-batch 64 --spec-also '{"disable_by_batch_size": 16}'

Workloads: copy (chat prompts asking to repeat or lightly edit a paragraph they contain), novel
(chat prompts asking for new text: little to copy), random (random token prompts, 128 in / 128
out; SmolLM2 tends to loop on them, which n-gram lookup does find), mixed (scripts/bench.py's synthetic workload, 64
requests at once). The engines (without speculation, with it, and with each --spec-also variant)
are built once and run in turn, --spec-reps times; it prints each one's median output tok/s and
decode tok/s, the ratio to the engine without speculation, and the speculating engines'
acceptance rate, mean acceptance length (drafts + bonus per verify step) and per-position rates, and
for every engine its steps: the share that verified drafts, output tokens per step, median step
times by kind (jaxlm/benchmarks/spec_step_probe.py).
"model": "SAME" in the config stands for the target model (the draft = target check).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
from jaxlm.benchmarks.spec_step_probe import StepProbe, describe, summarize

PARAGRAPHS = [
    "The river town woke slowly. Fishermen pushed their boats into the grey water while the baker "
    "stacked warm loaves by the open window. Children ran along the stone wall, counting the gulls "
    "that circled the harbour, and an old dog slept in the sun beside the church door. By noon the "
    "market square was full of voices: farmers sold apples and cheese, a man repaired shoes under a "
    "striped umbrella, and the mayor walked from stall to stall, shaking hands and asking about the "
    "harvest. When the bells rang at six, the shops closed one by one and the town grew quiet again.",
    "Photosynthesis turns light into chemical energy. In the leaves of a plant, chlorophyll absorbs "
    "sunlight, and the plant uses that energy to split water and combine carbon dioxide into sugar. "
    "Oxygen is released as a by-product, which is why forests are often called the lungs of the earth. "
    "The sugar is stored as starch or used to build cellulose, the material of stems and leaves. "
    "Without photosynthesis there would be no food for animals and almost no oxygen in the air, so "
    "nearly every living thing depends on it, directly or through the food chain.",
    "Our team meeting is moved to Thursday at ten in the small conference room. Please bring the "
    "quarterly figures, the draft of the customer survey and any questions about the new schedule. "
    "Lunch will be provided after the meeting, and the slides will be shared by email on Friday. "
    "If you cannot attend, send your notes to the project manager before Wednesday evening so that "
    "they can be discussed. The next meeting will take place in two weeks, at the same time and in "
    "the same room, unless the calendar invitation says otherwise.",
    "To make a simple tomato soup, soften one chopped onion in olive oil, add two cloves of garlic "
    "and a kilogram of ripe tomatoes, then simmer for twenty minutes with a cup of stock. Blend until "
    "smooth, season with salt and pepper, and serve with a spoon of cream and fresh basil. The soup "
    "keeps for three days in the fridge and can be frozen for a month. For a richer taste, roast the "
    "tomatoes in the oven for half an hour before adding them, and finish the soup with a little butter.",
]
INSTRUCTIONS = [
    "Repeat the following paragraph exactly, word for word:\n\n{p}",
    "Copy this text without changing anything:\n\n{p}",
    "Here is a paragraph. Write it out again exactly as it is, but in the past tense where it is "
    "in the present.\n\n{p}",
    "Here is a paragraph. Write it out again exactly as it is.\n\n{p}",
]


NOVEL = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain how a bicycle works to a ten-year-old.", "List five ideas for a rainy weekend and explain each.",
         "Describe the history of the printing press.", "What are the pros and cons of working from home?",
         "Write a poem about the first snow of winter.", "Give me advice for a job interview tomorrow.",
         "Describe a busy train station at rush hour."]


def chat_prompts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def copy_prompts(tokenizer: Any) -> list[list[int]]:
    return chat_prompts(tokenizer, [instr.format(p=p) for i, p in enumerate(PARAGRAPHS)
                                    for instr in INSTRUCTIONS[i % 2::2]])


def _workload(name: str, tokenizer: Any, vocab: int, batch: int) -> tuple[list[list[int]], list[int], bool]:
    """(prompts, max_tokens per prompt, ignore_eos)."""
    rng = np.random.default_rng(0)
    if name == "copy":
        prompts = copy_prompts(tokenizer)
        return prompts, [320] * len(prompts), False
    if name == "novel":  # new text, little to copy: drafts mostly rejected
        prompts = chat_prompts(tokenizer, NOVEL)
        return prompts, [128] * len(prompts), False
    if name == "random":
        prompts = [rng.integers(100, vocab - 100, 128).tolist() for _ in range(max(4, batch))]
        return prompts, [128] * len(prompts), True
    from jaxlm.benchmarks.workload import load_workload

    wl = load_workload("synthetic:num=64,prompt=16-256,output=16-128", vocab, 128, None)
    return [r.prompt_token_ids for r in wl.requests], [r.output_len for r in wl.requests], True


def _spec_totals(llm: Any) -> tuple[int, int, int, list[int]]:
    s = llm.llm_engine.get_stats()["spec_decoding"]
    if s is None:
        return 0, 0, 0, []
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.num_accepted_tokens_per_pos)


def _run(llm: Any, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool) -> dict:
    from jaxlm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens]
    before = _spec_totals(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _spec_totals(llm)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    first = min(o.metrics.first_token_ts for o in outs)
    last = max(o.metrics.last_token_ts for o in outs)
    decode = sum(len(o.outputs[0].token_ids) - 1 for o in outs) / max(last - first, 1e-9)
    delta = [a - b for a, b in zip(after[:3], before[:3])]
    per_pos = [a - b for a, b in zip(after[3], before[3])]
    return {"out_tok_s": n_out / wall, "decode_tok_s": decode, "tokens": n_out, "drafts": delta[0],
            "draft_tokens": delta[1], "accepted": delta[2], "per_pos": per_pos,
            "texts": [o.outputs[0].token_ids for o in outs]}


def bench_spec(model: str | None, spec: dict, workload: str, batch: int, variants: list[dict], reps: int,
               dtype: str = "auto", off_sync: bool = False) -> dict:
    from jaxlm import LLM
    from jaxlm.model_loader.formats import default_model_path

    target = model or default_model_path()
    if spec.get("model") == "SAME":
        spec = dict(spec, model=target)
    k = int(spec.get("num_speculative_tokens", 1))
    max_len, budget = (1024, 256) if batch == 1 else (512, 512)
    # The KV cache sized to the workload, not to the host's free memory (shared, it varies).
    kw = dict(model=target, dtype=dtype, max_num_seqs=batch, max_model_len=max_len, max_num_batched_tokens=budget,
              num_gpu_blocks_override=batch * max_len // 16 + 16)
    if batch == 1:  # the sizes a batch-1 step takes (decode, each engine's verify, a prompt): fewer compiles
        ks = {k} | {int(v.get("num_speculative_tokens", k)) for v in variants}
        kw["token_buckets"] = sorted({1, budget} | {1 + x for x in ks})
    engines: dict[str, Any] = {"off": LLM(**kw)}
    if off_sync:  # a speculating step runs synchronously: the same engine without speculation, sync too
        engines["off-sync"] = LLM(async_scheduling=False, **kw)
    engines["spec"] = LLM(speculative_config=spec, **kw)
    for i, extra in enumerate(variants):
        engines[f"spec+{json.dumps(extra)}"] = LLM(speculative_config=dict(spec, **extra), **kw)
    if reps == 0:  # engines built only: fills the compile caches outside a timed run
        return {}
    tok = engines["off"].get_tokenizer()
    prompts, max_tokens, ignore_eos = _workload(workload, tok, int(engines["off"].llm_engine.model_config.hf_config.vocab_size), batch)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    probes = {name: StepProbe(llm) for name, llm in engines.items()}
    for _ in range(reps):
        for name, llm in engines.items():
            runs[name].append(_run(llm, prompts, max_tokens, ignore_eos))
            runs[name][-1]["steps"] = probes[name].take()
            r = runs[name][-1]  # as it goes: a run cut short still says something
            print(f"  rep {len(runs[name])} {name}: out tok/s {r['out_tok_s']:.1f}, {r['tokens']} tokens, "
                  f"{len(r['steps'])} steps", flush=True)
    print(f"workload {workload}: {len(prompts)} prompts, batch {batch}, k={k}, spec {json.dumps(spec)}")
    base = statistics.median(r["out_tok_s"] for r in runs["off"])
    base_sync = statistics.median(r["out_tok_s"] for r in runs["off-sync"]) if off_sync else None
    result = {}
    for name, rs in runs.items():
        out_tok_s = statistics.median(r["out_tok_s"] for r in rs)
        decode = statistics.median(r["decode_tok_s"] for r in rs)
        line = f"  {name:<40} out tok/s {out_tok_s:7.1f}  decode tok/s {decode:7.1f}  x{out_tok_s / base:.2f}"
        if base_sync and not name.startswith("off"):
            line += f" (x{out_tok_s / base_sync:.2f} vs off-sync)"
        drafts, drafted, accepted = (sum(r[key] for r in rs) for key in ("drafts", "draft_tokens", "accepted"))
        entry = {"out_tok_s": out_tok_s, "decode_tok_s": decode, "ratio": out_tok_s / base,
                 "ratio_vs_off_sync": out_tok_s / base_sync if base_sync else None}
        if drafts:
            per_pos = np.sum([r["per_pos"] for r in rs], axis=0) / drafts
            entry.update(acceptance_rate=accepted / drafted, mean_acceptance_length=1 + accepted / drafts,
                         per_position=per_pos.tolist())
            line += (f"  acceptance {accepted / drafted:.1%}  mean acceptance length {1 + accepted / drafts:.2f}"
                     f"  per position {', '.join(f'{p:.2f}' for p in per_pos)}")
        same = rs[-1]["texts"] == runs["off"][-1]["texts"]
        line += "" if name.startswith("off") else f"  greedy outputs {'identical' if same else 'DIFFER'}"
        steps = summarize([s for r in rs for s in r["steps"]], sum(r["tokens"] for r in rs))
        entry["steps"] = steps
        print(line + "\n      " + describe(steps), flush=True)
        result[name] = entry
    for name, llm in engines.items():
        assert llm.llm_engine.get_model_runner().num_compiles_after_warmup == 0, name
    return result
