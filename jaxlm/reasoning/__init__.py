"""Reasoning parsers: split a reasoning model's ``<think>...</think>`` text from its answer
(the server's --reasoning-parser; vLLM's names).

  abs_reasoning_parsers.py  ReasoningParser (abstract), ReasoningParserManager (registry), ReasoningDelta
  basic_parsers.py          BaseThinkingReasoningParser: start/end tokens, text and token ids
  qwen3_reasoning_parser.py, deepseek_r1_reasoning_parser.py   the registered parsers

Light (no jax, no server): the parsers see text and token ids only.
"""

from jaxlm.reasoning.abs_reasoning_parsers import ReasoningDelta, ReasoningParser, ReasoningParserManager
from jaxlm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from jaxlm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningDelta", "ReasoningParser",
           "ReasoningParserManager"]
