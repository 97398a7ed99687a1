"""Test-only fault injection for a `python -m jaxlm.serve` subprocess (see server_process.py):
imported by the test's launcher before the server starts, it reads JAXLM_TEST_FAULT and patches
the engine so that a request whose id contains a marker triggers the fault:
  * "poison" in the id: building that request's sampling inputs raises (a per-request fault);
  * "kill" in the id: the model step raises (an engine fault);
  * "slow" in JAXLM_TEST_FAULT: every model step takes 50 ms longer (streams that outlast a
    request sent after their first token, however busy the machine).
Nothing in jaxlm reads this variable; production servers cannot be made to fail this way."""

from __future__ import annotations

import os
import time

from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.worker.model_runner import ModelRunner

_FAULTS = set(filter(None, os.environ.get("JAXLM_TEST_FAULT", "").split(",")))

if "poison" in _FAULTS:
    _real_add = SamplingInputBuilder.add_request

    def _add_request(self, req_id, params, *args, **kwargs):
        if "poison" in req_id and params.max_tokens != 1:  # not the runner's stand-in
            raise RuntimeError("injected fault: poisoned sampling inputs")
        return _real_add(self, req_id, params, *args, **kwargs)

    SamplingInputBuilder.add_request = _add_request

if "kill" in _FAULTS or "slow" in _FAULTS:
    _real_execute = ModelRunner.execute_model

    def _execute_model(self, so, **kw):
        if "kill" in _FAULTS and any("kill" in r.req_id for r in so.scheduled_new_reqs):
            raise RuntimeError("injected fault: the model step failed")
        if "slow" in _FAULTS:
            time.sleep(0.05)
        return _real_execute(self, so, **kw)

    ModelRunner.execute_model = _execute_model
