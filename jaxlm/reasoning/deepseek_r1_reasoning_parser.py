"""DeepSeek-R1: the chat template opens <think> in the prompt, so the output starts inside the
reasoning and may carry only </think>; an output with no </think> is all reasoning (cut off)."""

from __future__ import annotations

from jaxlm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from jaxlm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    requires_start_token = False
