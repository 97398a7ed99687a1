"""Test-only: started with JAXLM_TEST_FAULT, every Python process of a test server (the front end
and its spawned engine-core processes, which inherit PYTHONPATH) imports fault_patch first, so
the faults fire where the model runs. Python imports `sitecustomize` at start-up by itself.
multiprocessing's resource tracker never runs the model: it is left without jax, whose import
and exit would slow it (tests time how fast a server's children go)."""

import os
import sys

if os.environ.get("JAXLM_TEST_FAULT") and "multiprocessing.resource_tracker" not in " ".join(sys.orig_argv):
    import fault_patch  # noqa: F401
