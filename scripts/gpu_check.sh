#!/usr/bin/env bash
# jaxlm on a GPU in one command.
#
#   scripts/gpu_check.sh --prepare   # on a machine with PyPI access (CPU is fine): downloads the
#                                    # wheels a GPU machine without network lacks into .gpu_wheels/
#   scripts/gpu_check.sh             # on the GPU machine, from the repository root, with
#                                    # .gpu_wheels/ beside it: installs what is missing, then runs
#                                    # scripts/gpu_check.py: each part in its own process under a
#                                    # time box, within 450 s in all (GPU_CHECK_ARGS='--budget N'
#                                    # changes it), output streamed, the last line ONE JSON object
#                                    # of every figure (kernels and parity checks, decode tok/s and
#                                    # host vs device per step, kernel HBM bandwidth, nano-vllm's
#                                    # workload, command-buffer modes, the server under load,
#                                    # prefill, transformers, fp8). Under 8 minutes on one H100.
#   scripts/gpu_check.sh --cpu-smoke # the same run on CPU, small, to test this script.
#
# The GPU machines this project gets bring JAX with its CUDA plugin, flax, transformers, torch,
# safetensors and tokenizers, but no network: the rest of jaxlm's runtime dependencies (and
# pytest) come from the wheels --prepare fetched. Wheels are fetched for CPython 3.10-3.13 on
# x86_64 manylinux (set GPU_CHECK_PYTHONS / GPU_CHECK_PLATFORM to change that); what the GPU
# machine already has (numpy, jax, torch, ...) is left out, so the folder stays a few MB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.gpu_wheels}"
PYTHON="${PYTHON:-python3}"
PYTHONS="${GPU_CHECK_PYTHONS:-3.10 3.11 3.12 3.13}"
PLATFORM="${GPU_CHECK_PLATFORM:-x86_64}"

# What jaxlm imports that the GPU machines lack (import name=distribution name).
NEEDED=(msgspec=msgspec zmq=pyzmq llguidance=llguidance gguf=gguf psutil=psutil fastapi=fastapi
        uvicorn=uvicorn pydantic=pydantic prometheus_client=prometheus_client jinja2=jinja2
        httpx=httpx pytest=pytest pytest_timeout=pytest-timeout)
# Dependencies of those that the GPU machine brings already (big binaries among them): not fetched.
PROVIDED='^(numpy|jax|jaxlib|jax_cuda[0-9]+_(plugin|pjrt)|flax|torch|triton|nvidia_.*|transformers|tokenizers|safetensors|huggingface_hub|hf_xet|pyyaml|regex|requests|urllib3|certifi|charset_normalizer|filelock|fsspec|sympy|mpmath|networkx|ml_dtypes|opt_einsum|scipy|markupsafe|setuptools|pip)$'

prepare() {
  mkdir -p "$WHEELS"
  local tmp
  tmp="$(mktemp -d)"
  local pkgs=()
  for pair in "${NEEDED[@]}"; do pkgs+=("${pair#*=}"); done
  for py in $PYTHONS; do
    echo "gpu_check --prepare: wheels for CPython $py ($PLATFORM)"
    "$PYTHON" -m pip download --quiet --dest "$tmp" --only-binary=:all: --implementation cp \
      --python-version "$py" --platform "manylinux2014_$PLATFORM" --platform "manylinux_2_17_$PLATFORM" \
      --platform "manylinux_2_28_$PLATFORM" --platform "manylinux_2_34_$PLATFORM" "${pkgs[@]}"
  done
  local kept=0 dropped=0
  for whl in "$tmp"/*.whl; do
    local name
    name="$(basename "$whl" | cut -d- -f1 | tr 'A-Z-' 'a-z_')"
    if [[ "$name" =~ $PROVIDED ]]; then
      dropped=$((dropped + 1))
    else
      mv -f "$whl" "$WHEELS/"
      kept=$((kept + 1))
    fi
  done
  rm -rf "$tmp"
  echo "gpu_check --prepare: $kept wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1)); $dropped left out (the GPU machine has them)"
}

install_missing() {
  local missing=()
  for pair in "${NEEDED[@]}"; do
    "$PYTHON" -c "import ${pair%%=*}" 2>/dev/null || missing+=("${pair#*=}")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    echo "gpu_check: every runtime dependency is importable"
    return
  fi
  if [ ! -d "$WHEELS" ]; then
    echo "gpu_check: missing ${missing[*]} and no $WHEELS: run scripts/gpu_check.sh --prepare where PyPI is reachable, and bring .gpu_wheels/ along" >&2
    exit 2
  fi
  echo "gpu_check: installing ${missing[*]} from $WHEELS"
  "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"
}

case "${1:-}" in
  --prepare)
    prepare
    ;;
  --cpu-smoke)
    install_missing
    cd "$ROOT" && JAX_PLATFORMS=cpu PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/gpu_check.py --cpu-smoke ${GPU_CHECK_ARGS:-}
    ;;
  ""|--run)
    install_missing
    "$PYTHON" - <<'EOF' || { echo "gpu_check: JAX sees no GPU here (see above); nothing was run" >&2; exit 2; }
import jax
print("gpu_check:", jax.__version__, jax.devices())
assert jax.default_backend() == "gpu"
EOF
    cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" JAXLM_CACHE_DIR="${JAXLM_CACHE_DIR:-/tmp/jaxlm_gpu_check_cache}" \
      exec "$PYTHON" scripts/gpu_check.py ${GPU_CHECK_ARGS:-}
    ;;
  *)
    sed -n '2,21p' "$0"
    exit 2
    ;;
esac
