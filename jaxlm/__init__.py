"""jaxlm: LLM inference and serving on JAX/XLA with vLLM's architecture and API."""

from importlib import metadata as _metadata

from jaxlm.engine.arg_utils import EngineArgs  # light: the configs only
from jaxlm.lora.request import LoRARequest
from jaxlm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxlm.outputs_pooling import (
    ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
    PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxlm.pooling_params import PoolingParams
from jaxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

try:  # the one version: pyproject.toml's, through the installed package's metadata
    __version__ = _metadata.version("jaxlm")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "EngineArgs", "LLMEngine", "LoRARequest", "__version__", "PoolingParams",
           "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"]


def __getattr__(name: str):
    # Engine classes import jax; keep `import jaxlm` light for the core and the CLI's --help.
    if name == "LLM":
        from jaxlm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxlm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'jaxlm' has no attribute {name!r}")
