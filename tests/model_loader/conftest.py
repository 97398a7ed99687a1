"""Fixtures for the loader tests: tiny HF checkpoints and a way to read params back by HF name."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def tiny_copy(tiny_llama_dir, tmp_path) -> str:
    """A private, writable copy of the tiny llama checkpoint (tests that damage it)."""
    dst = tmp_path / "llama"
    shutil.copytree(tiny_llama_dir, dst)
    return str(dst)
