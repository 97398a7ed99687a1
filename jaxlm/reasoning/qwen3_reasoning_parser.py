"""Qwen3: the output opens with <think> when the model thinks; an output that does not is all
answer (thinking disabled). A thinking output cut off before </think> is all reasoning."""

from __future__ import annotations

from jaxlm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from jaxlm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    requires_start_token = True
