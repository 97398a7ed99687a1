"""Tool-call parsers for tool_choice="auto" (--enable-auto-tool-choice --tool-call-parser NAME),
vLLM's names: ToolParser (abstract), ToolParserManager (registry), hermes, llama3_json.
json_spans.py locates (possibly partial) JSON calls in text for every parser."""

from jaxlm.serve.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)
from jaxlm.serve.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from jaxlm.serve.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser

__all__ = ["ExtractedToolCallInformation", "Hermes2ProToolParser", "Llama3JsonToolParser", "ToolParser",
           "ToolParserManager"]
