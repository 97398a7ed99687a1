"""`jaxlm bench serve`: vLLM's serving benchmark, a pure HTTP client of any OpenAI-compatible server.

    jaxlm serve &                                  # or vLLM, llama.cpp's server, ...
    jaxlm bench serve --dataset-name random --random-input-len 256 --random-output-len 128 \\
        --num-prompts 64 --max-concurrency 8 --save-result

Streams every request (--endpoint /v1/completions or /v1/chat/completions); TTFT and the
inter-token gaps come from the arrival times of the SSE chunks. Requests start at once
(--request-rate inf) or with gaps drawn from a gamma distribution of shape --burstiness and mean
1/rate (burstiness 1: a Poisson process), at most --max-concurrency in flight. Output tokens are
the server's usage counts (the tokenizer's count of the text where a server sends none); input
tokens are the dataset's. The figures and the saved JSON use vLLM's keys (jaxlm/benchmarks/metrics.py).
A warm jaxlm server answers /health before it has loaded every compiled program: time it after
its log says "all deferred programs loaded", or start it with --no-defer-program-load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from datetime import datetime
from typing import Any, AsyncIterator

import numpy as np

from jaxlm.benchmarks.datasets import SampleRequest, add_dataset_args
from jaxlm.benchmarks.metrics import RequestOutcome, calculate_metrics, parse_percentile_args, print_serving_result

ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}
# Per-request lists, kept in the saved result only with --save-detailed (as vLLM).
_DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


class BenchmarkError(Exception):
    """A problem the user can fix (unreachable server, bad flag): printed in one line."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    g = parser.add_argument_group("server", "the endpoint (vLLM's flags)")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", choices=sorted(ENDPOINTS), help="API endpoint")
    g.add_argument("--model", default=None, help="model name in requests (default: the server's first model)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer path for the prompts and token counts (default: the model's path)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY)")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="seconds to retry the first request while the server starts (0: fail at once)")
    g.add_argument("--timeout", type=float, default=6 * 3600, help="seconds one request may take")
    t = parser.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once; otherwise gamma-distributed gaps)")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gaps' gamma distribution: 1 Poisson, < 1 burstier, > 1 more uniform")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    t.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")
    t.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly the output length (always on for --dataset-name random, as vLLM)")
    t.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    t.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    r = parser.add_argument_group("results")
    r.add_argument("--percentile-metrics", default=None, help="comma list of ttft,tpot,itl,e2el (default ttft,tpot,itl)")
    r.add_argument("--metric-percentiles", default="99", help='comma list of percentiles, e.g. "50,90,99"')
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--save-detailed", action="store_true", help="also the per-request lists (ttfts, itls, ...)")
    r.add_argument("--result-dir", default=None, help="directory of the result JSON (default: the current one)")
    r.add_argument("--result-filename", default=None,
                   help="file name (default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)")
    r.add_argument("--label", default=None, help="result label (default: the backend, openai or openai-chat)")
    r.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="extra keys for the result JSON")


def _body(req: SampleRequest, model: str, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.expected_output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The stream's lines, ended by CR, LF or CRLF only (the SSE rule).

    httpx's aiter_lines also splits at U+0085, U+2028, U+2029 (str.splitlines), which JSON
    leaves unescaped inside a generated text: the event would reach json.loads in pieces and
    the request count as failed.
    """
    buf = b""
    async for chunk in chunks:
        # A lone CR ends a line too; a CRLF split across chunks only adds an empty line.
        buf += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buf:
        yield buf.decode("utf-8", errors="replace")


async def send_request(client: Any, url: str, body: dict[str, Any], prompt_len: int, t0: float) -> RequestOutcome:
    """One streamed request; chunk arrival times give TTFT and the inter-token gaps."""
    import httpx

    out = RequestOutcome(prompt_len=prompt_len)
    start = last = time.perf_counter()
    out.start_time = start - t0
    texts = []
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return out
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if "error" in data:
                    out.error = str(data["error"].get("message", data["error"]))
                    return out
                if data.get("usage"):
                    out.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                text = _chunk_text(data)
                if text:
                    now = time.perf_counter()
                    if not texts:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    texts.append(text)
        out.latency = last - start
        out.generated_text = "".join(texts)
        # Tokens that decode to no text (special or partial-byte tokens) are still tokens served.
        out.success = bool(texts) or out.output_tokens > 0
        if not texts:
            if out.success:
                out.ttft = out.latency = time.perf_counter() - start
            else:
                out.error = "the stream carried no text"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def arrivals(requests: list[SampleRequest], rate: float, burstiness: float,
                   seed: int) -> AsyncIterator[SampleRequest]:
    """The requests in order, spaced by gamma(burstiness, 1 / (rate * burstiness)) seconds."""
    rng = np.random.default_rng(seed)
    for req in requests:
        yield req
        if rate != float("inf"):
            await asyncio.sleep(float(rng.gamma(burstiness, 1.0 / (rate * burstiness))))


async def _first_model(client: Any) -> tuple[str, str | None]:
    r = await client.get("/v1/models")
    if r.status_code != 200:
        raise BenchmarkError(f"GET /v1/models answered HTTP {r.status_code}: pass --model")
    data = r.json().get("data") or []
    if not data:
        raise BenchmarkError("the server lists no model: pass --model")
    return data[0]["id"], data[0].get("root")


async def _ready_check(client: Any, url: str, body: dict[str, Any], timeout_s: int) -> None:
    """The first request, as vLLM's 'initial test run': a failure stops the benchmark in one line."""
    deadline = time.monotonic() + timeout_s
    while True:
        short = {k: 2 if k in ("max_tokens", "max_completion_tokens") else v for k, v in body.items()}
        out = await send_request(client, url, short, 0, 0.0)
        if out.success or time.monotonic() >= deadline:
            break
        await asyncio.sleep(1.0)
    if not out.success:
        raise BenchmarkError(f"the initial test request to {url} failed: {out.error}")


def _load_tokenizer(path: str) -> Any:
    from jaxlm.config import ModelConfig
    from jaxlm.model_loader.tokenizer import get_tokenizer

    try:
        return get_tokenizer(ModelConfig(model=path))
    except Exception as e:  # noqa: BLE001  any failure means the same thing to the user
        raise BenchmarkError(f"no tokenizer at {path!r} ({type(e).__name__}: {e}): pass --tokenizer PATH") from None


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from tqdm.asyncio import tqdm

    from jaxlm.benchmarks.datasets import get_samples

    selected, percentiles = parse_percentile_args(args.percentile_metrics, args.metric_percentiles)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchmarkError(f"--max-concurrency must be positive, got {args.max_concurrency}")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise BenchmarkError("--request-rate and --burstiness must be positive")
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts + 1, keepalive_expiry=60)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=args.timeout, limits=limits) as client:
        try:
            model, root = (args.model, None) if args.model else await _first_model(client)
        except httpx.HTTPError as e:
            raise BenchmarkError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
        tokenizer_id = args.tokenizer or root or model
        tokenizer = _load_tokenizer(tokenizer_id)
        if args.dataset_name == "random":
            args.ignore_eos = True  # vLLM's: random prompts run to the requested length
        try:
            requests = get_samples(args, tokenizer, args.seed)
        except ValueError as e:
            raise BenchmarkError(str(e)) from None
        url = args.endpoint
        try:
            await _ready_check(client, url, _body(requests[0], model, url, args), args.ready_check_timeout_sec)
        except httpx.HTTPError as e:
            raise BenchmarkError(f"cannot reach {base}: {e}") from None
        for _ in range(args.num_warmups):
            await send_request(client, url, _body(requests[0], model, url, args), 0, 0.0)
        limit = asyncio.Semaphore(args.max_concurrency or len(requests))
        bar = None if args.disable_tqdm else tqdm(total=len(requests), unit="req", dynamic_ncols=True)
        t0 = time.perf_counter()

        async def limited(req: SampleRequest) -> RequestOutcome:
            async with limit:
                out = await send_request(client, url, _body(req, model, url, args), req.prompt_len, t0)
            if not out.output_tokens and out.generated_text:
                out.output_tokens = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
            if bar is not None:
                bar.update(1)
            return out

        tasks = [asyncio.create_task(limited(req))
                 async for req in arrivals(requests, args.request_rate, args.burstiness, args.seed)]
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    res = calculate_metrics(outcomes, duration, selected, percentiles)
    backend = ENDPOINTS[args.endpoint]
    head = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
            "label": args.label, "model_id": model, "tokenizer_id": tokenizer_id, "num_prompts": len(requests),
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "request_goodput": None}
    for item in args.metadata:
        key, eq, value = item.partition("=")
        if not eq:
            raise BenchmarkError(f"--metadata {item!r}: expected KEY=VALUE")
        head[key.strip()] = value.strip()
    detail = {"input_lens": [o.prompt_len for o in outcomes], "output_lens": [o.output_tokens for o in outcomes],
              "start_times": [o.start_time for o in outcomes], "ttfts": [o.ttft for o in outcomes],
              "itls": [o.itl for o in outcomes], "generated_texts": [o.generated_text for o in outcomes],
              "errors": [o.error for o in outcomes]}
    return {**head, **res, **detail}


def result_path(args: argparse.Namespace, res: dict[str, Any]) -> str:
    """vLLM's default name, under --result-dir."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (f"{args.label or res['backend']}-{args.request_rate}qps{conc}-"
                                    f"{str(res['model_id']).rstrip('/').split('/')[-1]}-{res['date']}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def main(args: argparse.Namespace) -> int:
    try:
        res = asyncio.run(benchmark(args))
    except BenchmarkError as e:
        print(f"jaxlm bench serve: {e}")
        return 1
    print_serving_result(res)
    for err in sorted({e for e in res["errors"] if e})[:5]:
        print("error:", err)
    if args.save_result:
        saved = res if args.save_detailed else {k: v for k, v in res.items() if k not in _DETAILED}
        path = result_path(args, res)
        with open(path, "w") as f:
            json.dump(saved, f, indent=2)
        print(f"result written to {path}")
    return 0 if res["failed"] == 0 else 1
