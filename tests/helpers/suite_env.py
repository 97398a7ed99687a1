"""The key under which tests/conftest.py keeps XLA_FLAGS as the suite started (one module object
for both the conftest and tests/test_suite_env.py)."""

import pytest

XLA_FLAGS_AT_START = pytest.StashKey[str]()
