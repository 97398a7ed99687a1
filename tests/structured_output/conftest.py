"""Fixtures: the tiny byte-level BPE tokenizer (384 ids) and a manager for a padded model vocab."""

import pytest

from tests.structured_output.so_helpers import MODEL_VOCAB, tiny_bpe_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return tiny_bpe_tokenizer(tmp_path_factory.mktemp("so_tok"))


@pytest.fixture(scope="session")
def manager(tokenizer):
    from jaxlm.structured_output.manager import StructuredOutputManager

    return StructuredOutputManager(tokenizer, MODEL_VOCAB, num_threads=2)
