"""Chat messages and the chat template (vLLM's chat_utils): the one place that decides which
template renders a conversation and renders it, for the server's chat completions, /tokenize
with messages, tool calling and reasoning, and for LLM.chat.

The template is the one given (--chat-template, LLM(chat_template=...) or
LLM.chat(..., chat_template=...)), else the tokenizer's; a model with neither is refused with
an error that names --chat-template (the server's 400).

Light module (no jax, no pydantic): messages come as dicts (LLM.chat) or as the server's
pydantic ChatMessage (its extra fields, e.g. tool_calls, in model_extra)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxlm.engine.input_processor import InvalidRequestError
from jaxlm.multimodal.inputs import ChatImages

NO_CHAT_TEMPLATE = ("this model's tokenizer has no chat template: give one with --chat-template (a Jinja "
                    "file or the template itself; chat_template= for LLM and LLM.chat)")


class NoChatTemplateError(InvalidRequestError):
    """Neither a template was given nor does the tokenizer have one."""

    def __init__(self) -> None:
        super().__init__("messages", NO_CHAT_TEMPLATE)


def _image_part(part: Mapping[str, Any], images: ChatImages | None) -> str:
    if images is None:
        raise InvalidRequestError("messages", "image_url content parts need a multimodal model: this model "
                                              "is text-only (it does not support multimodal inputs)")
    from jaxlm.multimodal.image import load_image_url

    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    try:
        images.images.append(load_image_url(url, images.allowed_local_media_path))
    except ValueError as e:
        raise InvalidRequestError("messages", str(e)) from None
    return images.placeholder


def content_text(content: str | list[dict[str, Any]] | None, images: ChatImages | None = None) -> str:
    """A message's content as text: OpenAI's text parts joined by newlines (as vLLM), after the
    placeholders of its image parts (whose images go to ``images``)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts, placeholders = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind == "image_url":
            placeholders.append(_image_part(part, images))
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError("messages", f"unsupported content part type {kind!r}")
        texts.append(part["text"])
    return "\n".join(placeholders + texts)


def _fields(message: Any) -> Mapping[str, Any]:
    if isinstance(message, Mapping):
        return message
    # A pydantic ChatMessage: its declared fields and the extras a client sent (tool_calls, ...).
    return {"role": message.role, "content": message.content, "name": message.name, **(message.model_extra or {})}


def message_dict(message: Any, images: ChatImages | None = None) -> dict[str, Any]:
    """A message as chat templates read it (the fields vLLM passes): role, content as text, name,
    tool calls with their arguments as objects (what HF templates expect), and the tool
    message's tool_call_id."""
    fields = _fields(message)
    out: dict[str, Any] = {"role": fields.get("role"), "content": content_text(fields.get("content"), images)}
    if fields.get("name") is not None:
        out["name"] = fields["name"]
    if fields.get("tool_calls"):
        calls = []
        for call in fields["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template gets the text
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    if fields.get("tool_call_id") is not None:
        out["tool_call_id"] = fields["tool_call_id"]
    return out


def parse_chat_messages(messages: list[Any], images: ChatImages | None = None) -> list[dict[str, Any]]:
    """The conversation a chat template renders; ``images`` collects its image parts (None: a
    text-only model, which refuses them)."""
    return [message_dict(m, images) for m in messages]


def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """The template to render with: the one given, else None for the tokenizer's own (which
    may be a dict of named templates that transformers picks from); NoChatTemplateError when
    there is neither."""
    if chat_template:
        return chat_template
    if getattr(tokenizer, "chat_template", None):
        return None
    raise NoChatTemplateError()


def apply_chat_template(tokenizer: Any, conversation: list[dict[str, Any]], chat_template: str | None = None, *,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        **kwargs: Any) -> str:
    """The prompt text of a conversation (parse_chat_messages), through the resolved template.
    kwargs: the template's extra variables (tools, chat_template_kwargs)."""
    return tokenizer.apply_chat_template(
        conversation, chat_template=resolve_chat_template(tokenizer, chat_template), tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **kwargs)
