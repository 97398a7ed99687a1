"""Test-only: started with JAXLM_TEST_FAULT, every Python process of a test server (the front end
and its spawned engine-core processes, which inherit PYTHONPATH) imports fault_patch first, so
the faults fire where the model runs. Python imports `sitecustomize` at start-up by itself."""

import os

if os.environ.get("JAXLM_TEST_FAULT"):
    import fault_patch  # noqa: F401
