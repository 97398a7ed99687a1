"""`python -m jaxlm.serve --speculative-config ...` over real HTTP: the official client gets the
greedy tokens transformers gives, streamed or not, and /metrics counts the drafts."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.helpers.tiny_models import make_tiny_engine_model
from tests.serve.server_process import ServerProcess

# The bucket geometry of test_spec_engine.py: its compiled programs are reused from the cache.
FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--token-buckets", "32", "--seq-buckets", "32",
         "--num-gpu-blocks-override", "14", "--speculative-config",
         json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})]
PROMPT = [17, 201, 33, 9, 305, 66, 12, 140, 77, 250, 8, 19]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_engine_model("llama", tmp_path_factory.mktemp("spec_server"))
    srv = ServerProcess(path, FLAGS)
    yield srv
    srv.stop()


def test_completions_and_metrics(server):
    model = transformers.AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(server.model_path)
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    client = server.client()
    name = client.models.list().data[0].id
    full = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0.0,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0)
    assert [int(t.removeprefix("token_id:")) for t in full.choices[0].logprobs.tokens] == ids
    stream = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == tok.decode(ids)
    metrics = server.metrics()
    drafts = next(v for k, v in metrics.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = next(v for k, v in metrics.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    per_pos = {k: v for k, v in metrics.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert drafts > 0 and accepted > 0
    assert len(per_pos) == 3 and sum(per_pos.values()) == accepted
    assert any('position="2"' in k for k in per_pos)
