"""The suite's process keeps the environment it started with: test modules import helpers that
run as their own 8-device processes, and those must not change XLA_FLAGS for everything after."""

from __future__ import annotations

import os

import pytest

from tests.helpers.suite_env import XLA_FLAGS_AT_START


def pytest_configure(config: pytest.Config) -> None:
    config.stash[XLA_FLAGS_AT_START] = os.environ.get("XLA_FLAGS", "")
