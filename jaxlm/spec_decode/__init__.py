"""Speculative decoding (vLLM's speculative_config): proposers, the verify step's runner and
output, the rejection sampler, metrics. The scheduler's part is jaxlm/core/spec_decode.py."""
