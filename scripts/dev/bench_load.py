"""Model load time and peak host memory per checkpoint format, each in a fresh process.

    python scripts/bench_load.py                      # SmolLM2 default: gguf, safetensors, orbax
    python scripts/bench_load.py --repeats 3 --workdir /tmp/jaxlm_bench_load

The safetensors and orbax checkpoints are derived from the default GGUF first (dequantized f32
weights in HF layout → safetensors with jaxlm's exporter; the GGUF-loaded model → save_orbax).
Each measurement runs ``--child`` in a new interpreter: imports, then resolve_model_config +
get_model + block_until_ready on every parameter, reporting wall time and peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

logger = logging.getLogger("bench_load")


def _peak_rss_mb() -> float:
    """VmHWM: this process's own peak RSS. (ru_maxrss survives exec and would report the parent's
    peak at fork time when that is larger.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def child(path: str, load_format: str) -> dict:
    t0 = time.perf_counter()
    import jax
    from flax import nnx

    from jaxlm.attention.backends import get_attention_backend
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_model, resolve_model_config

    jax.devices()
    t_import = time.perf_counter() - t0
    base_rss = _rss_mb()
    t1 = time.perf_counter()
    lc = LoadConfig(load_format=load_format)
    mc = resolve_model_config(ModelConfig(model=path), lc)
    t_resolve = time.perf_counter() - t1
    resolved_rss = _rss_mb()  # transformers (+torch when installed) is imported by now
    t2 = time.perf_counter()
    model = get_model(mc, lc, attn_backend=get_attention_backend("xla"))
    jax.block_until_ready(nnx.state(model, nnx.Param))
    t_get_model = time.perf_counter() - t2
    t_load = time.perf_counter() - t1
    n_params = sum(v[...].size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return {
        "format": load_format, "import_s": t_import, "resolve_s": t_resolve, "get_model_s": t_get_model,
        "load_s": t_load,
        "base_rss_mb": base_rss, "resolved_rss_mb": resolved_rss, "end_rss_mb": _rss_mb(),
        "peak_rss_mb": _peak_rss_mb(), "params": n_params,
    }


def prepare(workdir: str) -> dict[str, str]:
    """GGUF path, and safetensors / orbax dirs converted from it (made once, reused)."""
    from jaxlm.config import LoadConfig, ModelConfig
    from jaxlm.model_loader import get_model, get_tokenizer, resolve_model_config, save_orbax
    from jaxlm.model_loader.export import export_safetensors
    from jaxlm.model_loader.formats import ORBAX_MARKER, default_model_path
    from jaxlm.model_loader.gguf_utils import iterate_gguf_weights, open_gguf

    gguf_path = default_model_path()
    st_dir, ob_dir = os.path.join(workdir, "safetensors"), os.path.join(workdir, "orbax")
    mc = resolve_model_config(ModelConfig(model=gguf_path), LoadConfig())
    tok = get_tokenizer(mc)
    if not os.path.isfile(os.path.join(st_dir, "config.json")):
        logger.info("converting %s → %s", gguf_path, st_dir)
        export_safetensors(iterate_gguf_weights(open_gguf(gguf_path), gguf_path), st_dir, mc.hf_config,
                           tokenizer=tok, max_shard_bytes=256 << 20)
    if not os.path.isfile(os.path.join(ob_dir, ORBAX_MARKER)):
        logger.info("saving %s as orbax → %s", gguf_path, ob_dir)
        save_orbax(get_model(mc, LoadConfig(), attn_backend=None), ob_dir, mc.hf_config, tokenizer=tok)
    return {"gguf": gguf_path, "safetensors": st_dir, "orbax": ob_dir}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/jaxlm_bench_load")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--formats", default="gguf,safetensors,orbax")
    ap.add_argument("--child", nargs=2, metavar=("FORMAT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        logging.basicConfig(level=logging.WARNING)
        print("RESULT " + json.dumps(child(args.child[1], args.child[0])), flush=True)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    paths = prepare(args.workdir)
    rows = []
    for fmt in args.formats.split(","):
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--child", fmt, paths[fmt]],
                                 capture_output=True, text=True, check=False)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{fmt} child failed:\n{out.stderr[-4000:]}")
            runs.append(json.loads(line[7:]))
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "format"}
        rows.append((fmt, med))
    print(f"\n{'format':<12} {'resolve s':>9} {'get_model s':>11} {'total s':>7} {'import s':>8} "
          f"{'base RSS MB':>11} {'resolved RSS MB':>15} {'peak RSS MB':>11} {'get_model peak+':>15} {'params':>11}")
    for fmt, m in rows:
        print(f"{fmt:<12} {m['resolve_s']:9.2f} {m['get_model_s']:11.2f} {m['load_s']:7.2f} {m['import_s']:8.2f} "
              f"{m['base_rss_mb']:11.0f} {m['resolved_rss_mb']:15.0f} {m['peak_rss_mb']:11.0f} "
              f"{m['peak_rss_mb'] - m['resolved_rss_mb']:15.0f} "
              f"{int(m['params']):11d}")


if __name__ == "__main__":
    main()
