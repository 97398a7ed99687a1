"""On-device sampling: SamplingMetadata (+ its host builder) and the jit-compatible sampler."""

from jaxlm.sample.builder import SamplingInputBuilder
from jaxlm.sample.metadata import (
    ALL_VARIANTS, SERVING_VARIANTS, SamplerOutput, SamplerVariant, SamplingMetadata, covering_variant)
from jaxlm.sample.sampler import compute_prompt_logprobs, compute_prompt_logprobs_jit, sample, sample_jit, to_host

__all__ = ["SamplingInputBuilder", "SamplingMetadata", "SamplerVariant", "SamplerOutput",
           "ALL_VARIANTS", "SERVING_VARIANTS", "covering_variant", "sample", "sample_jit",
           "compute_prompt_logprobs", "compute_prompt_logprobs_jit", "to_host"]
