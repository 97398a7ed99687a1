"""The converted-weights cache of GGUF checkpoints (model_loader/gguf_cache.py): the first load
dequantizes and writes an entry, the next loads read it without dequantizing and place the same
weights; a damaged entry is converted again; a changed file gets a new entry; JAXLM_CACHE_DIR=""
writes nothing. The cache serves ``--quantization none`` (with ``gguf`` the kernels' block types
are read from the file as they are, tests/model_loader/test_gguf_blocks.py)."""

from __future__ import annotations

import os

import gguf
import jax
import numpy as np
import pytest
import transformers

from gguf_writer import write_gguf
from loader_helpers import load
from jaxlm.model_loader import gguf_utils


def _params(model) -> list[np.ndarray]:
    from flax import nnx

    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture
def gguf_file(tiny_llama_dir, tmp_path) -> str:
    cfg = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_gguf(tiny_llama_dir, path, cfg, gguf.GGMLQuantizationType.Q4_1)
    return path


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """The GGUF files dequantized (iterate_gguf_weights called) during the test."""
    calls: list[str] = []
    real = gguf_utils.iterate_gguf_weights

    def counting(reader, path):
        calls.append(path)
        return real(reader, path)

    monkeypatch.setattr(gguf_utils, "iterate_gguf_weights", counting)
    return calls


def _entries(cache: str) -> list[str]:
    root = os.path.join(cache, "gguf-weights")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def test_second_load_reads_the_converted_weights(gguf_file, conversions, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("JAXLM_CACHE_DIR", cache)
    first = _params(load(gguf_file, quantization="none"))
    assert conversions == [gguf_file] and len(_entries(cache)) == 1
    second = _params(load(gguf_file, quantization="none"))
    assert conversions == [gguf_file]  # not dequantized again
    assert len(first) == len(second) > 0
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)

    # A damaged entry (a truncated data file) is dropped and the file converted again.
    entry = os.path.join(cache, "gguf-weights", _entries(cache)[0])
    with open(os.path.join(entry, "weights.bin"), "r+b") as f:
        f.truncate(100)
    third = _params(load(gguf_file, quantization="none"))
    assert conversions == [gguf_file] * 2
    for a, b in zip(first, third):
        np.testing.assert_array_equal(a, b)
    assert os.path.getsize(os.path.join(entry, "weights.bin")) > 100  # rewritten whole

    # A changed file (new mtime) is a new entry; the cache off writes nothing.
    os.utime(gguf_file, ns=(1, 1))
    load(gguf_file, quantization="none")
    assert conversions == [gguf_file] * 3 and len(_entries(cache)) == 2
    monkeypatch.setenv("JAXLM_CACHE_DIR", "")
    load(gguf_file, quantization="none")
    load(gguf_file, quantization="none")
    assert conversions == [gguf_file] * 5 and len(_entries(cache)) == 2


def test_a_failing_conversion_fails_the_load_and_publishes_nothing(gguf_file, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("JAXLM_CACHE_DIR", cache)
    real = gguf_utils.iterate_gguf_weights

    def broken(reader, path):
        for i, item in enumerate(real(reader, path)):
            if i == 2:
                raise OSError("read error in the middle of the file")
            yield item

    monkeypatch.setattr(gguf_utils, "iterate_gguf_weights", broken)
    with pytest.raises(OSError, match="read error"):
        load(gguf_file, quantization="none")
    assert _entries(cache) == []  # neither an entry nor a leftover temporary directory
