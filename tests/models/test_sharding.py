"""Params carry PartitionSpecs from construction; load_weights places them on a mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm.attention.backends import get_attention_backend
from jaxlm.models import get_param_partition_spec
from jaxlm.models.gpt2 import GPT2LMHeadModel
from jaxlm.models.llama import Qwen2ForCausalLM
from jaxlm.models.opt import OPTForCausalLM
from tests.helpers import tiny_models as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _abstract(cls, config):
    return nnx.eval_shape(
        lambda: cls(config, dtype=jnp.float32, attn_backend=get_attention_backend("xla"), rngs=nnx.Rngs(0))
    )


def test_llama_family_specs() -> None:
    m = _abstract(Qwen2ForCausalLM, tm.tiny_config("qwen2"))
    layer = m.model.layers[0]
    col, row, rep = P(None, "model"), P("model", None), P(None)
    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
        assert get_param_partition_spec(lin.weight) == col
    assert get_param_partition_spec(layer.self_attn.q_proj.bias) == P("model")
    for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert get_param_partition_spec(lin.weight) == row
    assert get_param_partition_spec(m.model.embed_tokens.weight) == P("model", None)  # vocab split
    assert get_param_partition_spec(m.lm_head.weight) == P(None, "model")  # [hidden, vocab]
    assert get_param_partition_spec(layer.input_layernorm.weight) == rep
    assert get_param_partition_spec(m.model.norm.weight) == rep
    # flax's own view of the annotations agrees.
    specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
    assert specs["model"]["layers"][0]["self_attn"]["o_proj"]["weight"].get_value() == row
    assert m.partition_specs()["model.layers.1.mlp.up_proj.weight"] == col


def test_opt_and_gpt2_specs() -> None:
    o = _abstract(OPTForCausalLM, tm.tiny_config("opt", word_embed_proj_dim=32))
    d = o.model.decoder
    assert get_param_partition_spec(d.layers[0].fc1.weight) == P(None, "model")
    assert get_param_partition_spec(d.layers[0].fc2.weight) == P("model", None)
    assert get_param_partition_spec(d.layers[0].self_attn.out_proj.weight) == P("model", None)
    assert get_param_partition_spec(d.embed_positions.weight) == P(None, None)
    assert get_param_partition_spec(d.project_in.weight) == P(None, None)
    g = _abstract(GPT2LMHeadModel, tm.tiny_config("gpt2"))
    a = g.transformer.h[0].attn
    assert get_param_partition_spec(a.q_proj.weight) == P(None, "model")
    assert get_param_partition_spec(a.c_proj.weight) == P("model", None)
    assert get_param_partition_spec(g.transformer.wte.weight) == P("model", None)
    # Every Param of every family carries an annotation of its own rank.
    for m in (o, g):
        for name, spec in m.partition_specs().items():
            assert spec is not None, name


_MESH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np, jax, jax.numpy as jnp, transformers
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from safetensors.numpy import load_file
    from jaxlm.attention.backends import get_attention_backend
    from jaxlm.models import get_model_architecture
    from tests.helpers.paged_batch import PagedBatchBuilder, make_kv_caches

    path = sys.argv[1]
    assert len(jax.devices()) == 2
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "model"))
    config = transformers.AutoConfig.from_pretrained(path)
    cls = get_model_architecture(config)
    weights = load_file(os.path.join(path, "model.safetensors"))

    def build(mesh):
        m = nnx.eval_shape(lambda: cls(config, dtype=jnp.float32, attn_backend=get_attention_backend("xla"),
                                       rngs=nnx.Rngs(0), mesh=mesh))
        m.load_weights(weights.items())
        return m

    sharded, single = build(mesh), build(None)
    q = sharded.model.layers[0].self_attn.q_proj.weight.get_value()
    assert q.sharding == NamedSharding(mesh, P(None, "model")), q.sharding
    assert q.addressable_shards[0].data.shape == (64, 32), q.addressable_shards[0].data.shape
    e = sharded.model.embed_tokens.weight.get_value()
    assert e.addressable_shards[0].data.shape == (160, 64)
    n = sharded.model.norm.weight.get_value()
    assert n.sharding.is_fully_replicated

    def logits(m):
        pb = PagedBatchBuilder(32, 4, 8)
        ids, pos, md = pb.step({0: list(range(3, 14)), 1: list(range(40, 45))})
        caches = make_kv_caches(cls.get_kv_cache_spec(config), 32, 4)
        g, s = nnx.split(m)
        @jax.jit
        def f(s, ids, pos, caches, md):
            mm = nnx.merge(g, s)
            h, _ = mm(ids, pos, caches, md)
            return mm.compute_logits(h)
        return np.asarray(f(s, ids, pos, caches, md))

    diff = np.abs(logits(sharded) - logits(single)).max()
    assert diff < 1e-5, diff
    print("MESH_OK", diff)
    """
)


def test_load_onto_a_two_device_mesh_matches_single_device(tmp_path) -> None:
    path = tm.make_tiny_llama(tmp_path / "llama")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, path], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "MESH_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
