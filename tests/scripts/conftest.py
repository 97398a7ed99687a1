from tests.helpers.cpu_kernels import cpu_kernels  # noqa: F401
