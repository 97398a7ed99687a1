"""Interpret-mode kernels are XLA-compiled loops over the grid; compiling them dominates the
cost of these tests, and XLA's optimisation passes buy nothing at these tiny shapes."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _fast_compile():
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)
