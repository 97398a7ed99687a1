"""jaxlm: LLM inference and serving on JAX/XLA with vLLM's architecture and API."""

from jaxlm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxlm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "EngineArgs", "LLMEngine", "__version__"]


def __getattr__(name: str):
    # Engine classes import jax; keep `import jaxlm` light for the core and the CLI's --help.
    if name == "LLM":
        from jaxlm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxlm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from jaxlm.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'jaxlm' has no attribute {name!r}")
