"""Choosing the attention backend: auto on CPU takes the C++ kernel when it builds and says why
when it does not; an explicit cpu fails with the compiler's reason, and only runs on CPU."""

import logging

import pytest

from jaxlm.attention.backends import get_attention_backend, resolve_backend_name
from kernels_cpu import KernelBuildError


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("JAXLM_CACHE_DIR", str(tmp_path / "cache"))  # a build directory seen by no one


def test_auto_on_cpu_is_the_kernel_when_it_builds(cpu_kernels):
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert get_attention_backend("cpu").name == "cpu"


def test_auto_falls_back_to_xla_and_says_why(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxlm.attention.backends"):
        assert resolve_backend_name("auto", "cpu") == "xla"
    assert "no-such-g++" in caplog.text and "C++ decode kernel is not available" in caplog.text


def test_explicit_cpu_without_a_compiler_names_it(no_compiler):
    with pytest.raises(KernelBuildError, match="no-such-g\\+\\+"):
        get_attention_backend("cpu")


def test_cpu_backend_is_refused_on_a_gpu():
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend_name("cpu", "cuda")
    assert resolve_backend_name("auto", "cuda") == "pallas"
