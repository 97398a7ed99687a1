"""Structured outputs: constrain decoding to a JSON schema, regex, choice list or grammar.

Compiled with llguidance against the model's tokenizer.
  params.py   StructuredOutputsParams (vLLM's names), imported by SamplingParams; light: no jax,
              no llguidance, so the pure-Python core can import it (a test enforces this).
  grammar.py  params -> llguidance grammar text (JSON whitespace policy).
  manager.py  StructuredOutputManager: compile cache, per-request matchers, batched mask fill
              (host side; see its docstring for the per-step call sequence).
  bitmask.py  apply_token_bitmask: the mask applied to logits inside the jitted sampler.
Import the heavy parts from their modules, e.g. ``from jaxlm.structured_output.manager import
StructuredOutputManager``.
"""

from jaxlm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
