"""entrypoints/chat_utils.py: messages as templates read them, and the one choice of template
(given, else the tokenizer's, else an error naming --chat-template), through LLM.chat."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jaxlm import LLM, SamplingParams
from jaxlm.engine.input_processor import InvalidRequestError
from jaxlm.entrypoints.chat_utils import NoChatTemplateError, apply_chat_template, parse_chat_messages

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=40,
              token_buckets=[16, 64], seq_buckets=[8], seed=0)
LLM_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
CALL_TEMPLATE = "{% for m in messages %}({{ m['content'] }}){% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import copy_without_chat_template, make_tiny_engine_model

    root = tmp_path_factory.mktemp("chat")
    return copy_without_chat_template(make_tiny_engine_model("llama", root / "own"), root / "base")


def test_parse_chat_messages_as_templates_read_them():
    conv = parse_chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ada"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "ignored": True},
    ])
    assert conv[0] == {"role": "user", "content": "a\nb", "name": "ada"}
    assert conv[1]["content"] == "" and conv[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert conv[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    with pytest.raises(InvalidRequestError, match="image_url") as e:
        parse_chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert e.value.param == "messages"


def test_template_given_else_the_tokenizers_else_an_error_naming_the_flag(base_model, tmp_path):
    from tests.helpers.tiny_tokenizer import CHAT_TEMPLATE

    base = AutoTokenizer.from_pretrained(base_model)
    with pytest.raises(NoChatTemplateError, match="--chat-template"):
        apply_chat_template(base, MESSAGES)
    assert apply_chat_template(base, MESSAGES, CALL_TEMPLATE) == "(Hello)"
    own = AutoTokenizer.from_pretrained(base_model.replace("base", "own"))
    assert own.chat_template == CHAT_TEMPLATE
    assert apply_chat_template(own, MESSAGES, add_generation_prompt=False) == "<s>user\nHello</s>\n"
    assert apply_chat_template(own, MESSAGES, CALL_TEMPLATE) == "(Hello)"  # the given one wins


def test_llm_chat_template_argument_and_per_call_override(base_model, tmp_path):
    path = tmp_path / "llm.jinja"
    path.write_text(LLM_TEMPLATE)
    llm = LLM(model=base_model, chat_template=str(path), **ENGINE)  # a file, as --chat-template
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [out] = llm.chat(MESSAGES, greedy, use_tqdm=False)
    assert out.prompt_token_ids == tok.encode("<Hello>", add_special_tokens=False)
    [out] = llm.chat(MESSAGES, greedy, use_tqdm=False, chat_template=CALL_TEMPLATE)
    assert out.prompt_token_ids == tok.encode("(Hello)", add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 2
