"""The C++ kernels as a pytest fixture (imported by the conftests that use it)."""

import pytest

from kernels_cpu import KernelBuildError, load_cpu_kernels


@pytest.fixture(scope="session")
def cpu_kernels(tmp_path_factory) -> str:
    """The C++ kernels built into a fresh directory (a test of the build too); skips, saying why,
    on a machine without a C++ compiler."""
    try:
        return load_cpu_kernels(str(tmp_path_factory.mktemp("kernels")))
    except KernelBuildError as e:
        pytest.skip(f"the C++ kernels cannot be built here: {e}")
