"""The pooling endpoints through a real `python -m jaxlm.serve`: the openai client's
embeddings.create (float, base64, dimensions), /pooling, /classify, /score and /rerank in
Jina's and Cohere's shapes against sentence-transformers; hostile inputs get a 400 and the
server serves on; a generating server beside a pooling one: each refuses the other's requests."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.helpers.pooling_models import make_tiny_cross_encoder, make_tiny_encoder
from tests.helpers.tiny_models import make_tiny_engine_model
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)

# Small pooling programs (after the shared tiny flags: the last value wins).
POOLING_FLAGS = ["--max-model-len", "32", "--max-num-batched-tokens", "128", "--max-num-seqs", "16"]
TEXTS = ["the cat is on the bank of the river", "hello", "paris is the capital of france"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat is a dog", "music in the city", "river bank money"]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("emb"), "bert", pooling="mean")


@pytest.fixture(scope="module")
def embed_server(embed_model):
    srv = ServerProcess(embed_model, POOLING_FLAGS + ["--served-model-name", "emb"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rerank_model(tmp_path_factory):
    return make_tiny_cross_encoder(tmp_path_factory.mktemp("ce"), "bert", seed=1)


@pytest.fixture(scope="module")
def rerank_server(rerank_model):
    srv = ServerProcess(rerank_model, POOLING_FLAGS + ["--served-model-name", "rr"])
    yield srv
    srv.stop()


def _st(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def test_openai_client_embeddings_float_base64_and_dimensions(embed_server, embed_model):
    client = embed_server.client()
    ref = _st(embed_model).encode(TEXTS, normalize_embeddings=True)
    res = client.embeddings.create(model="emb", input=TEXTS)
    got = np.array([d.embedding for d in res.data])
    assert np.abs(got - ref).max() < 1e-5
    assert [d.index for d in res.data] == [0, 1, 2]
    tok = _st(embed_model).tokenizer
    assert res.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS) == res.usage.total_tokens
    # The client asks for base64 on the wire when no encoding_format is given and decodes it
    # itself (the call above); asked for explicitly, it hands back the string.
    res64 = client.embeddings.create(model="emb", input=TEXTS, encoding_format="base64")
    raw = httpx.post(embed_server.base + "/v1/embeddings",
                     json={"model": "emb", "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    assert np.abs(decoded - ref[0]).max() < 1e-5
    assert np.abs(np.frombuffer(base64.b64decode(res64.data[1].embedding), np.float32) - ref[1]).max() < 1e-5
    floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert np.abs(np.array(floats.data[2].embedding) - ref[2]).max() < 1e-5
    cut = client.embeddings.create(model="emb", input=TEXTS[0], dimensions=8).data[0].embedding
    raw_full = _st(embed_model).encode(TEXTS[:1])[0][:8]
    assert len(cut) == 8 and np.abs(np.array(cut) - raw_full / np.linalg.norm(raw_full)).max() < 1e-5


def test_input_shapes_token_ids_and_pooling_endpoint(embed_server):
    client = embed_server.client()
    by_text = client.embeddings.create(model="emb", input="hello").data[0].embedding
    ids = httpx.post(embed_server.base + "/tokenize", json={"prompt": "hello"})  # refused: a pooling server
    assert ids.status_code == 400
    tok_ids = [0, 46, 43, 50, 50, 53, 2]  # any in-vocabulary ids
    one = client.embeddings.create(model="emb", input=tok_ids).data
    many = client.embeddings.create(model="emb", input=[tok_ids, tok_ids[:3]]).data
    assert len(one) == 1 and len(many) == 2 and np.allclose(one[0].embedding, many[0].embedding, atol=1e-6)
    assert len(by_text) == 32
    pooled = httpx.post(embed_server.base + "/pooling", json={"input": ["hello"], "normalize": False}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert len(pooled["data"][0]["data"]) == 32 and abs(np.linalg.norm(pooled["data"][0]["data"]) - 1) > 1e-3


def test_x_request_id_names_pooling_responses(embed_server):
    """vLLM's _base_request_id on the pooling routes too (issue 43); the header is bounded."""
    r = httpx.post(embed_server.base + "/v1/embeddings", json={"input": "hello"}, headers={"X-Request-Id": "gw-7"})
    assert r.status_code == 200 and r.json()["id"] == "embd-gw-7"
    r = httpx.post(embed_server.base + "/pooling", json={"input": ["hello"]}, headers={"X-Request-Id": "gw-8"})
    assert r.json()["id"] == "pool-gw-8"
    assert httpx.post(embed_server.base + "/v1/embeddings", json={"input": "hello"}).json()["id"].startswith("embd-")
    long = httpx.post(embed_server.base + "/v1/embeddings", json={"input": "hello"}, headers={"X-Request-Id": "x" * 257})
    assert long.status_code == 400 and "X-Request-Id" in long.json()["error"]["message"]


def test_embedding_model_scores_by_cosine(embed_server, embed_model):
    r = httpx.post(embed_server.base + "/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    st = _st(embed_model)
    q, d = st.encode([QUERY])[0], st.encode(DOCS)
    ref = d @ q / (np.linalg.norm(d, axis=1) * np.linalg.norm(q))
    assert np.abs(np.array([x["score"] for x in r["data"]]) - ref).max() < 1e-5


@pytest.mark.parametrize("body,needle", [
    ({"input": ""}, "empty"),
    ({"input": []}, "empty"),
    ({"input": [[]]}, "empty"),
    ({"input": ["a"] * 10_000}, "at most 2048"),
    ({"input": "the cat " * 40}, "max_model_len=32"),
    ({"input": "a dog", "dimensions": 0}, "dimensions"),
    ({"input": "a dog", "dimensions": 33}, "larger than the model's embedding size 32"),
    ({"input": ["a dog", [5, 6, 7]]}, "input"),
    ({"input": [5, 10**7]}, "out of the vocabulary"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
])
def test_hostile_inputs_get_400_and_the_server_serves_on(embed_server, body, needle):
    r = httpx.post(embed_server.base + "/v1/embeddings", json={"model": "emb", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param"), err
    assert err["type"] == "BadRequestError"
    ok = httpx.post(embed_server.base + "/v1/embeddings", json={"input": "a dog"}, timeout=60)
    assert ok.status_code == 200


def test_truncation_serves_an_over_long_text(embed_server):
    r = httpx.post(embed_server.base + "/v1/embeddings",
                   json={"input": "the cat " * 40, "truncate_prompt_tokens": -1}).json()
    assert r["usage"]["prompt_tokens"] == 32


def test_generation_on_a_pooling_server_is_a_400_and_metrics_count_pooling(embed_server):
    r = httpx.post(embed_server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"]
    r = httpx.post(embed_server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    before = embed_server.metrics().get('vllm:request_success_total{engine="0",finished_reason="stop",model_name="emb"}',
                                        0.0)
    httpx.post(embed_server.base + "/v1/embeddings", json={"input": TEXTS}).raise_for_status()
    after = embed_server.metrics()
    key = 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="emb"}'
    assert after[key] == before + 3
    assert after['vllm:prompt_tokens_total{engine="0",model_name="emb"}'] > 0


def test_rerank_cohere_and_jina_shapes(rerank_server, rerank_model):
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(rerank_model, device="cpu").predict([(QUERY, d) for d in DOCS])
    order = list(np.argsort(-ref))
    for path in ("/rerank", "/v1/rerank"):  # Jina: documents as strings, top_n, documents returned
        r = httpx.post(rerank_server.base + path, json={"model": "rr", "query": QUERY, "documents": DOCS,
                                                        "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == order[:2]
        assert r["results"][0]["document"]["text"] == DOCS[order[0]]
        assert abs(r["results"][0]["relevance_score"] - ref[order[0]]) < 1e-5
        assert r["usage"]["total_tokens"] > 0 and r["model"] == "rr"
    # Cohere: documents as {"text": ...}, return_documents false, no top_n: all, ranked.
    r = httpx.post(rerank_server.base + "/v2/rerank", json={
        "model": "rr", "query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False}).json()
    assert [x["index"] for x in r["results"]] == order
    assert all(x.get("document") is None for x in r["results"])
    bad = httpx.post(rerank_server.base + "/rerank", json={"query": QUERY, "documents": []})
    assert bad.status_code == 400


def test_score_one_to_many_and_many_to_many(rerank_server, rerank_model):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(rerank_model, device="cpu")
    r = httpx.post(rerank_server.base + "/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert np.abs(np.array([x["score"] for x in r["data"]]) - ce.predict([(QUERY, d) for d in DOCS])).max() < 1e-5
    left = ["the cat", "paris", "music"]
    r = httpx.post(rerank_server.base + "/v1/score", json={"text_1": left, "text_2": DOCS[:3]}).json()
    assert np.abs(np.array([x["score"] for x in r["data"]]) - ce.predict(list(zip(left, DOCS[:3])))).max() < 1e-5
    bad = httpx.post(rerank_server.base + "/score", json={"text_1": left, "text_2": DOCS})
    assert bad.status_code == 400 and "N texts with N" in bad.json()["error"]["message"]
    cls = httpx.post(rerank_server.base + "/classify", json={"input": ["paris"]}).json()
    assert cls["data"][0]["num_classes"] == 1 and 0 < cls["data"][0]["probs"][0] < 1
    assert httpx.post(rerank_server.base + "/v1/embeddings", json={"input": "x"}).status_code == 400


def test_a_generating_server_beside_a_pooling_one(embed_server, tmp_path):
    gen = ServerProcess(make_tiny_engine_model("llama", tmp_path / "llama"), [])
    try:
        out = gen.client().completions.create(model=gen.model_path, prompt="Hello", max_tokens=3)
        assert out.usage.completion_tokens == 3
        r = httpx.post(gen.base + "/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
        for path in ("/rerank", "/score", "/classify", "/pooling"):
            assert httpx.post(gen.base + path, json={"input": "x", "query": "q", "documents": ["d"],
                                                     "text_1": "a", "text_2": "b"}).status_code == 400
        assert len(embed_server.client().embeddings.create(model="emb", input="hello").data[0].embedding) == 32
    finally:
        gen.stop()
