"""lm-eval-harness scores log-likelihoods against a real `python -m jaxlm.serve` exactly as it
does against vLLM (`local-completions`: echo + logprobs, max_tokens=1, several prompts per
request, requests in parallel), and they equal its `hf` backend on the same weights."""

from __future__ import annotations

import pytest

from tests.serve.conftest import SERVED_MODEL, SERVER_STEP_BUDGET

pytestmark = pytest.mark.timeout(900)

# A few-shot prompt much longer than the server's step budget: every prompt is prefilled over
# several steps, and four requests of four prompts run at once.
_SHOTS = ("The capital of France is Paris. The capital of Italy is Rome. "
          "The quick brown fox jumps over the lazy dog while the cat sleeps. ")
_QUESTIONS = [
    ("Hello, my name is", [" Ada", " Paris", " the fox"]),
    ("A paged KV cache holds keys and", [" values", " blocks", " cats"]),
    ("Continuous batching lets new requests join at every", [" step", " block", " program in Python"]),
    ("The capital of Italy is", [" Rome", " Paris"]),
    ("The quick brown fox jumps over the", [" lazy dog", " cat"]),
    ("I like to write programs in", [" Python", " blocks", " France"]),
]


def _instances():
    from lm_eval.api.instance import Instance

    instances = []
    for q, (question, choices) in enumerate(_QUESTIONS):
        context = _SHOTS * (1 + q % 2) + question
        for choice in choices:
            instances.append(Instance(request_type="loglikelihood", doc={"q": q}, arguments=(context, choice),
                                      idx=len(instances)))
    return instances


def test_local_completions_loglikelihood_equals_hf_backend(real_server, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    instances = _instances()
    # "auto" picks the server's own tokenizer through /tokenizer_info and /tokenize (as with vLLM).
    api = LocalCompletionsAPI(base_url=real_server.base + "/v1/completions", model=SERVED_MODEL,
                              tokenizer_backend="auto", num_concurrent=4, batch_size=4, max_retries=1)
    assert api.tokenizer_backend == "remote"
    context_ids = api.tok_encode(instances[0].arguments[0])
    assert len(context_ids) > 2 * SERVER_STEP_BUDGET
    served = api.loglikelihood(instances, disable_tqdm=True)

    # Same token ids on both sides: the remote tokenizer encodes without special tokens, while
    # `hf` would follow the tokenizer's default (this one adds <s>).
    hf = HFLM(pretrained=real_server.model_path, backend="causal", device="cpu", batch_size=4, dtype="float32",
              add_bos_token=False)
    assert hf.tok_encode(instances[0].arguments[0]) == context_ids
    reference = hf.loglikelihood(instances, disable_tqdm=True)

    assert len(served) == len(reference) == len(instances)
    for inst, (got, got_greedy), (want, want_greedy) in zip(instances, served, reference):
        assert got == pytest.approx(want, abs=1e-3), inst.arguments
        assert got_greedy == want_greedy, inst.arguments
    # The per-question decision (argmax over choices) is lm-eval's accuracy input: the same.
    by_q: dict[int, list[tuple[float, float]]] = {}
    for inst, (got, _), (want, _) in zip(instances, served, reference):
        by_q.setdefault(inst.doc["q"], []).append((got, want))
    for pairs in by_q.values():
        assert max(range(len(pairs)), key=lambda i: pairs[i][0]) == max(range(len(pairs)), key=lambda i: pairs[i][1])
