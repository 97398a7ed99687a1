"""Shared tiny pooling models and engines: built once per module, small programs
(max_model_len 64, token budget 256) so warm-up stays short."""

from __future__ import annotations

import pytest

# Small bucket grid for every test engine: 14 programs.
ENGINE_KW = dict(max_model_len=64, max_num_batched_tokens=256, max_num_seqs=32)
