"""Chat-template rendering for the server: off the event loop, and for templates a request
carries (vLLM's `chat_template` field and `chat_template_kwargs={"chat_template": ...}`) only
with --trust-request-chat-template, in a Jinja sandbox with a time limit.

A request's template runs in `ImmutableSandboxedEnvironment` (no attribute tricks, no mutation
of the inputs), with `*` and `**` checked so one expression cannot allocate gigabytes, and under
a per-thread trace hook that raises once the render runs past its deadline: a template looping
10^8 times fails that request after --chat-template-timeout seconds and frees its thread. The
model's own template (trusted, set by the operator) renders through the tokenizer as before,
on a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from jaxlm.entrypoints.chat_utils import parse_chat_messages
from jaxlm.serve.errors import OpenAIError

T = TypeVar("T")

TRUST_FLAG = "--trust-request-chat-template"
# The largest string/list one `*` may build and the largest exponent of `**` in a request template.
_MAX_REPEAT_ITEMS = 1 << 20
_MAX_EXPONENT = 64


@dataclasses.dataclass(frozen=True)
class ChatTemplatePolicy:
    """What the server allows a request's chat template (the server flags)."""

    trust_request_chat_template: bool = False
    timeout_s: float = 5.0


class TemplateTimeoutError(RuntimeError):
    """A request's chat template ran past its time limit."""


def request_template(request: Any) -> str | None:
    """The template a chat request carries: the `chat_template` field or
    chat_template_kwargs["chat_template"], as vLLM reads them."""
    template = getattr(request, "chat_template", None)
    kwargs = getattr(request, "chat_template_kwargs", None) or {}
    if template is None and "chat_template" in kwargs:
        template = kwargs["chat_template"]
    if template is not None and not isinstance(template, str):
        raise OpenAIError("chat_template must be a string", 400, "chat_template")
    return template


def template_kwargs(request: Any) -> dict[str, Any]:
    """chat_template_kwargs without the template itself, and the request's tools (as OpenAI
    sends them: {"type": "function", "function": {...}}) whatever its tool_choice, as vLLM."""
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    kwargs.pop("chat_template", None)
    tools = getattr(request, "tools", None)
    if tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    return kwargs


async def render_chat_request(serving: Any, request: Any) -> Any:
    """A chat request's prompt (a ProcessedPrompt: template + tokenization, and a multimodal
    model's image features), computed on a worker thread.
    serving: OpenAIServingChat (its render/encode/tokenizer); its `template_policy` attribute,
    set by the server, says what a request's template may do (refused by default)."""
    serving.require_tokenizer("messages", "a chat template")
    policy: ChatTemplatePolicy = getattr(serving, "template_policy", None) or ChatTemplatePolicy()
    template = request_template(request)
    kwargs = template_kwargs(request)
    add_generation_prompt = getattr(request, "add_generation_prompt", True)
    continue_final = getattr(request, "continue_final_message", False)
    add_special_tokens = getattr(request, "add_special_tokens", False)
    if template is None:
        return await asyncio.to_thread(serving.render, request.messages, add_generation_prompt,
                                       continue_final, kwargs, add_special_tokens)
    if not policy.trust_request_chat_template:
        raise OpenAIError(f"chat templates in requests are refused unless the server runs with {TRUST_FLAG}",
                          400, "chat_template")
    images = serving.input_processor.chat_images()  # None: a text-only model refuses image parts
    # On a worker thread: image URLs are fetched while the messages are parsed.
    conversation = await asyncio.to_thread(parse_chat_messages, request.messages, images)
    variables = {**_special_tokens(serving.tokenizer), **kwargs, "messages": conversation,
                 "add_generation_prompt": add_generation_prompt and not continue_final}

    def work() -> Any:
        text = render_sandboxed(template, variables, policy.timeout_s)
        if continue_final and conversation:
            text = _cut_after_final_message(text, conversation[-1]["content"])
        return serving.prompt_of(text, images, add_special_tokens)

    try:
        # The thread stops itself at the deadline; wait_for is the backstop for a C-level call.
        return await asyncio.wait_for(asyncio.to_thread(work), policy.timeout_s + 1.0)
    except (TemplateTimeoutError, asyncio.TimeoutError) as e:
        raise OpenAIError(f"the request's chat template ran longer than {policy.timeout_s:g} s", 400,
                          "chat_template") from e


def render_sandboxed(template: str, variables: dict[str, Any], timeout_s: float) -> str:
    """Renders a request's template in the sandbox on this thread; TemplateTimeoutError past
    timeout_s, OpenAIError(400) for a template that fails or breaks the sandbox's rules."""
    import jinja2
    from jinja2.sandbox import SecurityError

    try:
        compiled = _sandbox().from_string(template)
    except jinja2.TemplateError as e:
        raise OpenAIError(f"chat template does not compile: {e}", 400, "chat_template") from e
    try:
        return run_with_deadline(lambda: compiled.render(**variables), time.monotonic() + timeout_s)
    except TemplateTimeoutError:
        raise
    except (SecurityError, jinja2.TemplateError, ValueError, TypeError, ArithmeticError, LookupError,
            MemoryError, RecursionError) as e:
        raise OpenAIError(f"chat template failed: {type(e).__name__}: {e}", 400, "chat_template") from e


def run_with_deadline(fn: Callable[[], T], deadline: float) -> T:
    """Runs fn on this thread with a trace hook that raises TemplateTimeoutError past the
    deadline: checked on every Python call, and on every line of compiled template code."""

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeoutError("chat template render timed out")
        return trace if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def _sandbox() -> Any:
    """An ImmutableSandboxedEnvironment with transformers' chat-template conventions
    (trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson, strftime_now)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
                raise SecurityError(f"exponent {right} is above {_MAX_EXPONENT}")
            if operator == "*":
                seq, count = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > _MAX_REPEAT_ITEMS:
                    raise SecurityError(f"repetition of {len(seq) * count} items is above {_MAX_REPEAT_ITEMS}")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, **kw)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


def _cut_after_final_message(text: str, final_content: str) -> str:
    """continue_final_message: the render ends right after the last message's content."""
    at = text.rfind(final_content.strip()) if final_content.strip() else -1
    return text if at < 0 else text[: at + len(final_content.strip())]
