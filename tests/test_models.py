"""Reference models on one device: shapes, parameter metadata, formulas and numerics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlib.models import CONFIGS, MLP, build, flops_per_token, generate, get_config, next_token_loss, param_count
from shardlib.models.gpt import blocked_causal_attention, causal_attention, rope_tables
from shardlib.models.mlp import regression_loss
from shardlib.model import hooks

TINY = CONFIGS["tiny"]


def make(config=TINY, seed=0):
    with nnx.use_eager_sharding(False):  # how shardlib builds models: no mesh needed
        return build(config, nnx.Rngs(seed))


def abstract(config):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build(config, nnx.Rngs(0)))


def n_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def tokens(batch=2, seq=16, seed=0, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab, dtype=jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    return make()


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_forward_shapes_and_dtypes(compute_dtype):
    model = make(dataclasses.replace(TINY, compute_dtype=compute_dtype))
    logits = model(tokens(batch=3, seq=10))
    assert logits.shape == (3, 10, TINY.vocab_size)
    assert logits.dtype == jnp.float32  # logits stay float32 whatever the compute dtype
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_matches_built_model(name):
    assert param_count(CONFIGS[name]) == n_params(make(CONFIGS[name]))


@pytest.mark.parametrize("name", ["gpt2-small", "1b", "llama-7b", "13b", "70b"])
def test_param_count_matches_abstract_model(name):
    model = abstract(CONFIGS[name])  # shapes only: nothing is allocated
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert param_count(CONFIGS[name]) == n_params(model)


def test_param_counts_of_known_shapes():
    assert param_count(CONFIGS["llama-7b"]) == 6_738_415_616  # LLaMA-7B as published
    assert param_count(CONFIGS["13b"]) == 13_015_864_320  # LLaMA-13B as published
    assert param_count(CONFIGS["70b"]) == 68_976_648_192  # Llama-2-70B (GQA, 8 kv heads) as published
    assert 1.0e9 < param_count(CONFIGS["1b"]) < 1.2e9


def test_param_count_with_grouped_query_attention():
    config = dataclasses.replace(TINY, n_kv_heads=2)
    assert param_count(config) == n_params(make(config)) < param_count(TINY)


def test_every_param_has_logical_axes():
    model = abstract(dataclasses.replace(TINY, n_kv_heads=2))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, variable in flat:
        names = variable.get_metadata().get("out_sharding")
        assert names is not None and len(names) == len(variable.shape), (path, names, variable.shape)
        assert all(isinstance(n, str) for n in names), (path, names)
        assert (names[0] == "layers") == (path[0] == "blocks"), (path, names)
        if path[0] == "blocks":
            assert variable.shape[0] == TINY.n_layers
    specs = {path: variable.get_metadata()["out_sharding"] for path, variable in flat}
    assert specs[("blocks", "attn", "wk")] == ("layers", "embed", "kv_heads", "head_dim")
    assert specs[("blocks", "attn", "wo")] == ("layers", "heads", "head_dim", "embed")
    assert specs[("blocks", "mlp", "w_gate")] == ("layers", "embed", "mlp")
    assert specs[("embedding",)] == ("vocab", "embed")
    assert specs[("lm_head",)] == ("embed", "vocab")


def test_causal(tiny):
    inputs = tokens(seq=12)
    changed = inputs.at[:, 7].set((inputs[:, 7] + 1) % TINY.vocab_size)
    before, after = tiny(inputs), tiny(changed)
    np.testing.assert_array_equal(before[:, :7], after[:, :7])
    assert not np.allclose(before[:, 7:], after[:, 7:])


def unrolled_logits(model, inputs):
    """The same model applied layer by layer in a Python loop, without scan or remat."""
    config = model.config
    x = jnp.take(model.embedding[...], inputs, axis=0)
    sin, cos = rope_tables(inputs.shape[1], config.head_dim, config.rope_theta)
    graphdef, stacked = nnx.split(model.blocks)
    for i in range(config.n_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
        x = block(x, sin, cos)
    return model.final_norm(x) @ model.lm_head[...]


def test_scan_matches_unrolled_layers(tiny):
    inputs = tokens()
    np.testing.assert_allclose(tiny(inputs), unrolled_logits(tiny, inputs), rtol=1e-5, atol=1e-5)


def test_remat_changes_nothing():
    batch = {"inputs": tokens(), "targets": tokens(seed=1)}
    results = []
    for remat in (True, False):
        model = make(dataclasses.replace(TINY, remat=remat))
        (loss, _), grads = nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch)
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_a, grads_b)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """GQA with 2 kv heads is MHA whose k/v heads are each repeated for their query group."""
    gqa = make(dataclasses.replace(TINY, n_kv_heads=2))
    mha = make(TINY)
    _, gqa_state = nnx.split(gqa)
    graphdef, mha_state = nnx.split(mha)
    groups = TINY.n_heads // 2
    repeat = lambda a: jnp.repeat(a, groups, axis=2)  # [layers, embed, kv_heads, head_dim]
    merged = jax.tree.map(lambda x: x, gqa_state)
    merged["blocks"]["attn"]["wk"] = jax.tree.map(repeat, gqa_state["blocks"]["attn"]["wk"])
    merged["blocks"]["attn"]["wv"] = jax.tree.map(repeat, gqa_state["blocks"]["attn"]["wv"])
    inputs = tokens()
    np.testing.assert_allclose(gqa(inputs), nnx.merge(graphdef, merged)(inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention, kv_heads", [("xla", 4), ("xla", 2), ("blocked", 2), ("flash", 2)])
def test_other_attention_paths_equal_the_einsum_path(attention, kv_heads):
    """attention="xla" (jax.nn.dot_product_attention, whose "cudnn" kernel GPUs run) and "blocked"
    (query blocks recomputed in the backward pass) compute the same logits and gradients as the
    written-out float32 scores, GQA included."""
    batch = {"inputs": tokens(), "targets": tokens(seed=1)}
    results = []
    for attention in ("einsum", attention):
        model = make(dataclasses.replace(TINY, n_kv_heads=kv_heads, attention=attention))
        results.append(nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch))
    ((loss_a, _), grads_a), ((loss_b, _), grads_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads_a, grads_b)


def test_blocked_attention_takes_several_blocks_and_the_causal_mask_across_them():
    """Against the written-out scores with 4 blocks of 4 queries and 2 kv heads: values and the
    gradients of q, k and v."""
    q, k, v = (jax.random.normal(key, (2, 16, 4, 8)) for key in jax.random.split(jax.random.key(0), 3))
    k, v = k[:, :, :2], v[:, :, :2]
    probe = jax.random.normal(jax.random.key(1), q.shape)
    expected, expected_vjp = jax.vjp(causal_attention, q, k, v)
    out, vjp = jax.vjp(lambda *qkv: blocked_causal_attention(*qkv, block=4), q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), vjp(probe), expected_vjp(probe))


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention='ring' is not one of"):  # an attention that does not exist
        dataclasses.replace(TINY, attention="ring")


def test_model_calls_the_shardlib_hooks(tiny):
    """Every activation constraint the model asks for has full rank and the expected names."""
    seen = []

    def activation_spec(logical_axes, shape):
        assert len(logical_axes) == len(shape)
        seen.append(tuple(logical_axes))
        return P(*([None] * len(shape)))

    ctx = hooks.ComputeContext(activation_spec=activation_spec)
    with hooks.compute_context(ctx):
        jax.eval_shape(lambda m, x: m(x), tiny, tokens())
    assert ctx.gathered == set()  # outside a step no parameter carries a shardlib spec to gather
    assert {("batch", "seq", "embed"), ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "mlp"),
            ("batch", "seq", "kv_heads", "head_dim"), ("batch", "seq", "vocab")} <= set(seen)


def test_adam_reduces_loss_on_a_repeated_batch():
    model = make()
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    batch = {"inputs": tokens(batch=4, seq=32), "targets": tokens(batch=4, seq=32, seed=1)}

    @nnx.jit
    def step(model, optimizer, batch):
        (loss, aux), grads = nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss, aux

    losses = [float(step(model, optimizer, batch)[0]) for _ in range(15)]
    assert losses[-1] < losses[0] - 1.0, losses
    _, aux = step(model, optimizer, batch)
    assert set(aux) == {"accuracy"} and aux["accuracy"].shape == ()


def test_generate(tiny):
    prompt = tokens(batch=2, seq=5)
    out = generate(tiny, prompt, 6, rng=jax.random.key(0), top_k=10)
    assert out.shape == (2, 11) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :5], prompt)
    np.testing.assert_array_equal(out, generate(tiny, prompt, 6, rng=jax.random.key(0), top_k=10))
    assert int(out.min()) >= 0 and int(out.max()) < TINY.vocab_size

    greedy = generate(tiny, prompt, 4, rng=jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(greedy[:, 5:], jnp.argmax(tiny(greedy), axis=-1)[:, 4:-1])

    with pytest.raises(ValueError, match="max_seq_len"):
        generate(tiny, prompt, TINY.max_seq_len, rng=jax.random.key(0))


def test_flops_per_token():
    config = CONFIGS["llama-7b"]
    matmul_params = param_count(config) - config.vocab_size * config.d_model
    assert flops_per_token(config, 0) == 6 * matmul_params
    assert flops_per_token(config, 2048) - flops_per_token(config, 0) == 12 * 32 * 4096 * 2048
    assert flops_per_token(config) == flops_per_token(config, config.max_seq_len)


def test_unknown_config_lists_known_names():
    assert get_config("tiny") is TINY
    with pytest.raises(ValueError, match="known configs: tiny, small"):
        get_config("gpt5")


def test_invalid_config():
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(TINY, n_kv_heads=3)


def test_mlp_metadata_and_training():
    with nnx.use_eager_sharding(False):
        model = MLP(8, 32, rngs=nnx.Rngs(0))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        assert len(variable.get_metadata()["out_sharding"]) == len(variable.shape), path
    x = jax.random.normal(jax.random.key(0), (16, 8))
    batch = {"x": x, "y": jnp.sin(x)}
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        (loss, aux), grads = nnx.value_and_grad(regression_loss, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss, aux

    first, aux = step(model, optimizer, batch)
    assert aux == {} and first.shape == () and first.dtype == jnp.float32
    for _ in range(20):
        last, _ = step(model, optimizer, batch)
    assert float(last) < 0.5 * float(first)
