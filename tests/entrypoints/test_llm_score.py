"""LLM.score / classify / reward: cross-encoders against sentence-transformers' CrossEncoder,
embedding models' scores against the cosine of sentence-transformers' vectors, decoder
classifier heads against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.helpers.pooling_models import make_tiny_cross_encoder, make_tiny_decoder_pooler, make_tiny_encoder

pytestmark = pytest.mark.timeout(600)

KW = dict(max_model_len=32, max_num_batched_tokens=128, max_num_seqs=16)
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat is a dog", "music in the city", "river bank money",
        "a word", "the tower of paris"]


@pytest.mark.parametrize("family", ["bert", "xlmr"])
def test_cross_encoder_scores_equal_cross_encoder_predict(tmp_path, family):
    from sentence_transformers import CrossEncoder
    from jaxlm import LLM

    path = make_tiny_cross_encoder(tmp_path / family, family)
    llm = LLM(path, **KW)  # *ForSequenceClassification: the pooling runner without asking
    outs = llm.score(QUERY, DOCS)
    ref = CrossEncoder(path, device="cpu").predict([(QUERY, d) for d in DOCS])
    ours = np.array([o.outputs.score for o in outs])
    assert np.abs(ours - ref).max() < 1e-5, (ours, ref)
    # N x N pairs, and the same pair scores the same in either call.
    nn = llm.score([QUERY, "the cat"], [DOCS[0], DOCS[1]])
    assert abs(nn[0].outputs.score - ours[0]) < 1e-6
    ref_nn = CrossEncoder(path, device="cpu").predict([("the cat", DOCS[1])])
    assert abs(nn[1].outputs.score - ref_nn[0]) < 1e-5
    if family == "bert":  # the pair's second text has token type 1
        assert llm.llm_engine.runner.model.uses_token_types
    with pytest.raises(ValueError, match="one text with many, or N texts with N"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="embedding model|not supported"):
        llm.embed("hello")
    assert llm.llm_engine.num_compiles_after_warmup == 0


def test_rerank_order_follows_scores(tmp_path):
    from sentence_transformers import CrossEncoder
    from jaxlm import LLM

    path = make_tiny_cross_encoder(tmp_path / "ce", "bert", seed=3)
    llm = LLM(path, **KW)
    ours = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    ranked = CrossEncoder(path, device="cpu").rank(QUERY, DOCS, top_k=3)
    assert [r["corpus_id"] for r in ranked] == list(np.argsort(ours)[::-1][:3])


def test_embedding_model_scores_by_cosine(tmp_path):
    from sentence_transformers import SentenceTransformer
    from jaxlm import LLM

    path = make_tiny_encoder(tmp_path / "emb", "bert", pooling="mean")
    llm = LLM(path, **KW)
    outs = llm.score(QUERY, DOCS)
    st = SentenceTransformer(path, device="cpu")
    q = st.encode([QUERY])[0]
    d = st.encode(DOCS)
    ref = d @ q / (np.linalg.norm(d, axis=1) * np.linalg.norm(q))
    assert np.abs(np.array([o.outputs.score for o in outs]) - ref).max() < 1e-5


@pytest.mark.parametrize("family,num_labels", [("qwen2", 3), ("llama", 1)])
def test_decoder_classifier_heads(tmp_path, family, num_labels):
    from jaxlm import LLM, PoolingParams

    path = make_tiny_decoder_pooler(tmp_path / family, family, head="classify", num_labels=num_labels)
    llm = LLM(path, **KW)
    texts = ["hello world", "a", "the quick brown fox"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    probs = llm.classify(texts)
    raw = llm.classify(texts, PoolingParams(activation=False))
    rewards = llm.reward(texts)
    for text, p, r, w in zip(texts, probs, raw, rewards):
        with torch.no_grad():
            logits = model(**tok(text, return_tensors="pt")).logits[0]
        ref_p = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
        assert p.outputs.num_classes == num_labels
        assert np.abs(np.array(p.outputs.probs) - ref_p.numpy()).max() < 1e-5
        assert np.abs(np.array(r.outputs.probs) - logits.numpy()).max() < 1e-4
        assert np.abs(w.outputs.data - logits.numpy()).max() < 1e-4
    if num_labels == 1:
        with torch.no_grad():
            ref = float(torch.sigmoid(model(**tok("hello", "world", return_tensors="pt")).logits[0, 0]))
        assert abs(llm.score("hello", "world")[0].outputs.score - ref) < 1e-5
    else:
        with pytest.raises(ValueError, match="not supported by this model"):
            llm.score("hello", "world")
