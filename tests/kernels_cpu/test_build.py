"""Loading the C++ kernels leaves the process' floating point alone: a library linked with
-ffast-math turns on flush-to-zero for the whole process (subnormals read as 0 in numpy and XLA)."""

import subprocess
import sys


def test_loading_keeps_subnormals(cpu_kernels):
    # A fresh process: the flag is per thread, set by the library's constructor at load.
    code = (f"import ctypes, numpy as np; ctypes.cdll.LoadLibrary({cpu_kernels!r}); "
            "x = np.float32(1e-40); assert x * np.float32(1) != 0 and 5e-324 * 1.0 != 0, 'flushed'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_included_header_is_hashed():
    """The library's file name hashes the sources and the headers they include (build._HEADERS):
    a header missing there would leave a stale build in place after it changed."""
    import os
    import re

    from kernels_cpu import build

    included = set()
    for path in build._SOURCES + build._HEADERS:
        with open(path) as f:
            included.update(re.findall(r'^#include "([^"/]+)"', f.read(), re.M))
    assert included == {os.path.basename(h) for h in build._HEADERS}
