"""LLM(..., runner="pooling").embed / encode against sentence-transformers and transformers on
the same tiny random weights: every pooling type, normalization on and off, BERT, XLM-RoBERTa
and decoders as embedders; a text's vector does not depend on its batch; 0 compiles after
warm-up; bad input names the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.helpers.pooling_models import make_tiny_decoder_pooler, make_tiny_encoder

pytestmark = pytest.mark.timeout(600)

# A small bucket grid: 8 programs per engine.
KW = dict(max_model_len=32, max_num_batched_tokens=128, max_num_seqs=16)
TEXTS = ["the cat is on the bank of the river", "hello", "paris is the capital of france and has a tower",
         "a dog", "what is the word for money in the city, said she"]


def _cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _close(ours, ref):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    assert _cosine(ours, ref) >= 0.99999


@pytest.fixture(scope="module")
def st_models(tmp_path_factory):
    """(family, pooling) -> sentence-transformers checkpoint."""
    out = {}
    for family, pooling in [("bert", "mean"), ("bert", "cls"), ("bert", "lasttoken"), ("xlmr", "mean"),
                            ("xlmr", "cls")]:
        out[family, pooling] = make_tiny_encoder(tmp_path_factory.mktemp(f"{family}_{pooling}"), family,
                                                 pooling=pooling, normalize=False)
    return out


@pytest.fixture(scope="module")
def engines(st_models):
    from jaxlm import LLM

    return {key: LLM(path, runner="pooling", **KW) for key, path in st_models.items()}


@pytest.mark.parametrize("key", [("bert", "mean"), ("bert", "cls"), ("bert", "lasttoken"), ("xlmr", "mean"),
                                 ("xlmr", "cls")])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_equal_sentence_transformers(engines, st_models, key, normalize):
    from sentence_transformers import SentenceTransformer
    from jaxlm import PoolingParams

    llm = engines[key]
    outs = llm.embed(TEXTS, PoolingParams(normalize=normalize))
    st = SentenceTransformer(st_models[key], device="cpu")
    ref = st.encode(TEXTS, normalize_embeddings=normalize, convert_to_numpy=True)
    for out, r in zip(outs, ref):
        _close(out.outputs.embedding, r)
        assert out.outputs.hidden_size == 32
    assert llm.llm_engine.num_compiles_after_warmup == 0


def test_pooling_type_comes_from_the_checkpoint(engines):
    assert {k: e.llm_engine.spec.pooling_type for k, e in engines.items()} == {
        ("bert", "mean"): "MEAN", ("bert", "cls"): "CLS", ("bert", "lasttoken"): "LAST", ("xlmr", "mean"): "MEAN",
        ("xlmr", "cls"): "CLS"}


def test_all_pooling_returns_every_tokens_hidden_state(st_models):
    from jaxlm import LLM

    path = st_models["bert", "cls"]
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": "ALL"}, **KW)
    from jaxlm import PoolingParams

    raw, normed = llm.encode(TEXTS[:3], PoolingParams(normalize=False)), llm.encode(TEXTS[:3])
    model = transformers.AutoModel.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    for text, out, out_n in zip(TEXTS[:3], raw, normed):
        with torch.no_grad():
            ref = model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert out.outputs.data.shape == ref.shape
        assert np.abs(out.outputs.data - ref).max() < 1e-4
        ref_n = ref / np.linalg.norm(ref, axis=-1, keepdims=True)  # each token's vector normalized
        assert np.abs(out_n.outputs.data - ref_n).max() < 1e-4
    with pytest.raises(ValueError, match="not supported by this model"):
        llm.embed("hello")


def test_a_text_alone_equals_it_in_a_batch_of_30_mixed_lengths(engines):
    llm = engines["bert", "mean"]
    rng = np.random.default_rng(0)
    words = "the cat dog river bank money city paris music word".split()
    batch = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 28, size=30)]
    target = batch[17]
    alone = np.asarray(llm.embed(target)[0].outputs.embedding)
    together = llm.embed(batch)
    assert np.abs(np.asarray(together[17].outputs.embedding) - alone).max() < 1e-5
    assert len({len(o.prompt_token_ids) for o in together}) > 10  # really mixed lengths
    assert llm.llm_engine.num_compiles_after_warmup == 0


def test_dimensions_truncate_then_normalize(engines):
    from jaxlm import PoolingParams

    llm = engines["bert", "mean"]
    full = np.asarray(llm.embed("a dog", PoolingParams(normalize=False))[0].outputs.embedding)
    cut = np.asarray(llm.embed("a dog", PoolingParams(dimensions=8))[0].outputs.embedding)
    assert cut.shape == (8,)
    _close(cut, full[:8] / np.linalg.norm(full[:8]))
    with pytest.raises(ValueError, match="dimensions=33 is larger than the model's embedding size 32"):
        llm.embed("a dog", PoolingParams(dimensions=33))
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)


def test_bad_inputs_are_refused_and_the_engine_serves_on(engines):
    from jaxlm import PoolingParams

    llm = engines["bert", "mean"]
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="more than max_model_len=32"):
        llm.embed("the cat " * 40)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.embed([[5, 10**6]])
    with pytest.raises(ValueError, match="needs a pooling model|generates text"):
        llm.generate("hello")
    # Truncation keeps what fits; token ids and text mix in one call.
    outs = llm.embed(["the cat " * 40, [0, 50, 51, 2]], PoolingParams(truncate_prompt_tokens=-1))
    assert len(outs[0].prompt_token_ids) == 32 and outs[1].prompt_token_ids == [0, 50, 51, 2]
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.embed(TEXTS)) == len(TEXTS)


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral"])
def test_decoders_embed_with_last_token_pooling(tmp_path, family):
    from jaxlm import LLM, PoolingParams

    path = make_tiny_decoder_pooler(tmp_path / family, family, head="embed")
    llm = LLM(path, **KW)  # *Model: the pooling runner without asking
    texts = ["hello world", "a", "the quick brown fox jumps"]
    model = transformers.AutoModel.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    for normalize in (True, False):
        outs = llm.embed(texts, PoolingParams(normalize=normalize))
        for text, out in zip(texts, outs):
            with torch.no_grad():
                ref = model(**tok(text, return_tensors="pt")).last_hidden_state[0, -1].numpy()
            if normalize:
                ref = ref / np.linalg.norm(ref)
            _close(out.outputs.embedding, ref)
    assert llm.llm_engine.spec.pooling_type == "LAST" and llm.llm_engine.runner.model.causal


def test_runner_convert_and_task_flags(tmp_path, st_models):
    """--runner generate on an encoder is refused; a *ForCausalLM checkpoint embeds under
    --task embed or --convert embed (its LM head left unread), as its base model's last token."""
    from jaxlm import LLM

    with pytest.raises(ValueError, match="is a pooling model.*--runner pooling"):
        LLM(st_models["bert", "mean"], runner="generate", **KW)
    path = make_tiny_decoder_pooler(tmp_path / "causal", "qwen3", head="causal")
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval().model
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        ref = base(**tok("hello world", return_tensors="pt")).last_hidden_state[0, -1].numpy()
    ref = ref / np.linalg.norm(ref)
    for flags in (dict(task="embed"), dict(convert="embed")):
        llm = LLM(path, **flags, **KW)
        _close(llm.embed("hello world")[0].outputs.embedding, ref)
    with pytest.raises(ValueError, match="needs a pooling model"):
        llm_gen = object.__new__(LLM)
        llm_gen.llm_engine = None
        llm_gen.embed("x")


def test_xlmr_context_stops_at_its_position_table(st_models):
    """XLM-R's positions start after the padding index: a 130-row table holds 128 prompt
    positions, so max_model_len defaults to 128 (not 130) and the 128th token still matches."""
    from sentence_transformers import SentenceTransformer
    from jaxlm import LLM

    path = st_models["xlmr", "mean"]
    llm = LLM(path, runner="pooling", max_num_batched_tokens=128, max_num_seqs=4)
    assert llm.llm_engine.max_model_len == 128
    text = " ".join(["cat"] * 126)  # [CLS] + 126 + [SEP] = 128 tokens
    out = llm.embed(text)[0]
    assert len(out.prompt_token_ids) == 128
    _close(out.outputs.embedding, SentenceTransformer(path, device="cpu").encode([text], normalize_embeddings=True)[0])
    with pytest.raises(ValueError, match="more than max_model_len=128"):
        llm.embed(text + " cat")
