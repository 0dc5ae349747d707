"""Models with several inputs and padding, written as HuggingFace-Flax, T5 and pure-JAX users write
them, and the inputs those users get wrong.

A BERT masked-LM in linen (word / position / type embeddings, vocab 30522 that 8 does not divide,
LayerNorm eps 1e-12, a pooler, labels -100 where ignored, a token-weighted loss), a T5-style
encoder-decoder (shared embedding, a relative-position bias table, encoder and decoder of different
lengths) fed a dict keyed by the call's argument names or a tuple, and a pure-JAX tagger (a dict of
dicts, ``init(key)`` / ``apply(params, batch)``). Each trains against an independent reference: the
same loss in a plain one-device ``jax.jit(jax.value_and_grad)`` + optax step (`tests.zoo.plain_steps`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import AxisType

import shardlib
from shardlib import Checkpointer, MeshError, build, from_functions, from_linen, make_layout, make_mesh
from shardlib.tools.export import load_exported
from tests import zoo
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5
from tests.test_user_models import _train  # (state, per-step losses) of program.step over batches

ROWS, STEPS, D = 16, 3, 16
LAYERS = 1  # per stack (a T5 stack's first layer holds its relative-position bias table)
FSDP8, DATA2_FSDP4, DATA2_TENSOR4 = {"fsdp": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "tensor": 4}


def _padding(rng, rows: int, length: int) -> np.ndarray:
    """An int32 attention mask: each row's tokens then padding (2..length tokens)."""
    return (np.arange(length)[None] < rng.integers(2, length + 1, rows)[:, None]).astype(np.int32)


# ---------------------------------------------------------------- BERT, HuggingFace-Flax style


class BertLayer(nn.Module):
    heads: int = 2
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, h, attention_mask, deterministic: bool = True):
        q, k, v = (nn.Dense(D, name=n)(h).reshape(*h.shape[:2], self.heads, -1) for n in ("query", "key", "value"))
        bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(h.dtype).min)
        weights = nn.dot_product_attention_weights(q, k, bias=bias)
        attended = jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(h.shape)
        attended = nn.Dropout(self.dropout_rate)(nn.Dense(D, name="attention_output")(attended), deterministic)
        h = nn.LayerNorm(epsilon=1e-12, name="attention_LayerNorm")(h + attended)
        out = nn.Dense(D, name="output")(nn.gelu(nn.Dense(4 * D, name="intermediate")(h)))
        out = nn.Dropout(self.dropout_rate)(out, deterministic)
        return nn.LayerNorm(epsilon=1e-12, name="output_LayerNorm")(h + out)


class BertForPreTraining(nn.Module):
    vocab_size: int = 30522
    dropout_rate: float = 0.1  # hidden_dropout_prob

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids, deterministic: bool = True):
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        words = nn.Embed(self.vocab_size, D, embedding_init=nn.initializers.normal(0.02), name="word_embeddings")
        h = (words(input_ids) + nn.Embed(64, D, name="position_embeddings")(positions)
             + nn.Embed(2, D, name="token_type_embeddings")(token_type_ids))
        h = nn.Dropout(self.dropout_rate)(nn.LayerNorm(epsilon=1e-12, name="embeddings_LayerNorm")(h), deterministic)
        for i in range(LAYERS):
            h = BertLayer(dropout_rate=self.dropout_rate, name=f"layer_{i}")(h, attention_mask, deterministic)
        pooled = jnp.tanh(nn.Dense(D, name="pooler")(h[:, 0]))
        transformed = nn.gelu(nn.Dense(D, name="transform")(h))
        transformed = nn.LayerNorm(epsilon=1e-12, name="predictions_LayerNorm")(transformed)
        mlm = words.attend(transformed) + self.param("predictions_bias", nn.initializers.zeros, (self.vocab_size,))
        return mlm, nn.Dense(2, name="seq_relationship")(pooled)


BERT = BertForPreTraining(dropout_rate=0.0)  # a config without dropout: the reference is deterministic


def bert_batch(seed: int, rows: int = 8, length: int = 8) -> dict[str, np.ndarray]:
    """A tokenizer's padded output, with MLM labels (-100 where ignored: padding and unmasked tokens)."""
    rng = np.random.default_rng(seed)
    mask = _padding(rng, rows, length)
    ids = rng.integers(0, 30522, (rows, length)).astype(np.int32) * mask
    return {"input_ids": ids, "attention_mask": mask,
            "token_type_ids": (np.arange(length)[None] >= length // 2).astype(np.int32) * mask,
            "labels": np.where((rng.random((rows, length)) < 0.3) & (mask > 0), ids, -100).astype(np.int32),
            "next_sentence_label": rng.integers(0, 2, rows).astype(np.int32)}


def bert_inputs(batch, train):
    return (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]), {"deterministic": not train}


def pretraining_loss(outputs, batch):
    """The MLM loss averaged over the labelled tokens of the whole batch, plus the NSP loss."""
    mlm_logits, nsp_logits = outputs
    labelled = batch["labels"] != -100
    ce = optax.softmax_cross_entropy_with_integer_labels(mlm_logits, jnp.where(labelled, batch["labels"], 0))
    nsp = optax.softmax_cross_entropy_with_integer_labels(nsp_logits, batch["next_sentence_label"]).mean()
    return shardlib.global_mean(ce, labelled) + nsp


def _plain_bert_loss(params, batch):
    return pretraining_loss(BERT.apply({"params": params}, *bert_inputs(batch, False)[0]), batch)


def test_bert_pretraining_with_padding_trains_like_one_device_restores_onto_tp_and_exports(tmp_path):
    """zero3 on 8 devices equals plain jit on one (loss, evaluation); the checkpoint restores bit for
    bit under tp, where the 30522-row tables stay whole, and exports to what BERT.apply takes."""
    model = from_linen(BERT, pretraining_loss, bert_batch(0), inputs=bert_inputs)
    program = build(model, optimizer(), make_layout(model, "zero3", make_mesh(FSDP8)))
    state = program.init(jax.random.key(0))
    params0 = jax.tree.map(np.asarray, state.params)
    batches = [bert_batch(i) for i in range(STEPS)]
    state, losses = _train(program, state, batches)
    ref_params, ref_losses = zoo.plain_steps(_plain_bert_loss, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    evaluation = float(program.evaluate(state.params, bert_batch(9))["loss"])
    plain_loss = jax.jit(_plain_bert_loss)
    np.testing.assert_allclose(evaluation, float(plain_loss(ref_params, bert_batch(9))), rtol=1e-5)

    with pytest.warns(shardlib.ReplicationWarning, match=r"word_embeddings/embedding \(30522, 16\)"):
        target = build(model, optimizer(), make_layout(model, "tp", make_mesh(DATA2_TENSOR4)))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(STEPS, state, data_state={}, config={}, force=True)
        ckpt.wait()
        restored, _, _ = ckpt.restore(target.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, state))
    from shardlib.tools.export import export_params

    export_params(tmp_path / "ckpt", tmp_path / "bert.npz")
    exported = load_exported(tmp_path / "bert.npz")
    jax.tree.map(np.testing.assert_array_equal, exported, jax.tree.map(np.asarray, state.params))
    np.testing.assert_allclose(float(plain_loss(exported, bert_batch(9))), evaluation, rtol=1e-5)


# ---------------------------------------------------------------- T5-style encoder-decoder


class T5Attention(nn.Module):
    causal: bool = False
    relative_bias: bool = False  # the first layer of each stack owns the bucketed bias table

    @nn.compact
    def __call__(self, x, kv, kv_mask, *, deterministic):
        q, k, v = (nn.Dense(D, use_bias=False, name=n)(y).reshape(*y.shape[:2], 2, -1)
                   for n, y in (("q", x), ("k", kv), ("v", kv)))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if self.relative_bias:
            relative = jnp.arange(kv.shape[1])[None, :] - jnp.arange(x.shape[1])[:, None]
            table = self.param("relative_attention_bias", nn.initializers.normal(1.0), (8, 2))
            scores = scores + table[jnp.clip(relative, -4, 3) + 4].transpose(2, 0, 1)[None]
        allowed = kv_mask[:, None, None, :] > 0
        if self.causal:
            allowed = allowed & jnp.tril(jnp.ones((x.shape[1], kv.shape[1]), bool))
        weights = nn.Dropout(0.0)(jax.nn.softmax(jnp.where(allowed, scores, -1e9)), deterministic=deterministic)
        return nn.Dense(D, use_bias=False, name="o")(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape))


class T5(nn.Module):
    @nn.compact
    def __call__(self, encoder_input_ids, decoder_input_ids, encoder_mask, decoder_mask, *, deterministic):
        shared = nn.Embed(100, D, name="shared")
        norm = lambda name: nn.RMSNorm(epsilon=1e-6, name=name)
        x = shared(encoder_input_ids)
        for i in range(LAYERS):
            h = norm(f"encoder_{i}_norm")(x)
            x = x + T5Attention(relative_bias=i == 0, name=f"encoder_{i}")(h, h, encoder_mask,
                                                                         deterministic=deterministic)
        encoded = norm("encoder_final_norm")(x)
        y = shared(decoder_input_ids)
        for i in range(LAYERS):
            h = norm(f"decoder_{i}_norm")(y)
            y = y + T5Attention(causal=True, relative_bias=i == 0, name=f"decoder_{i}_self")(
                h, h, decoder_mask, deterministic=deterministic)
            y = y + T5Attention(name=f"decoder_{i}_cross")(norm(f"decoder_{i}_cross_norm")(y), encoded, encoder_mask,
                                                          deterministic=deterministic)
        return shared.attend(norm("decoder_final_norm")(y) * D ** -0.5)


T5_ARGS = ("encoder_input_ids", "decoder_input_ids", "encoder_mask", "decoder_mask")


def t5_batch(seed: int, rows: int = ROWS) -> dict[str, np.ndarray]:
    """Encoder rows of 12 tokens, decoder rows of 7, each padded; labels shifted into the decoder input."""
    rng = np.random.default_rng(seed)
    encoder_mask, decoder_mask = _padding(rng, rows, 12), _padding(rng, rows, 7)
    labels = rng.integers(1, 100, (rows, 7)).astype(np.int32) * decoder_mask
    return {"encoder_input_ids": rng.integers(1, 100, (rows, 12)).astype(np.int32) * encoder_mask,
            "decoder_input_ids": np.pad(labels[:, :-1], ((0, 0), (1, 0))), "encoder_mask": encoder_mask,
            "decoder_mask": decoder_mask, "labels": labels}


def _seq2seq_loss(logits, labels, decoder_mask):
    return shardlib.global_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels), decoder_mask)


# batch form -> (batch from the dict, inputs=, loss_fn over (logits, batch))
T5_FORMS = {
    "dict": (lambda b: b, lambda b, train: ((), {**{k: b[k] for k in T5_ARGS}, "deterministic": not train}),
             lambda logits, b: _seq2seq_loss(logits, b["labels"], b["decoder_mask"])),
    "tuple": (lambda b: tuple(b[k] for k in (*T5_ARGS, "labels")),
              lambda b, train: (b[:4], {"deterministic": not train}),
              lambda logits, b: _seq2seq_loss(logits, b[4], b[3])),
}


def _microbatch(batch, i: int, k: int, devices: int):
    """Microbatch i of k: rows i*h .. (i+1)*h of each device's block of rows (docs/training-loop.md)."""
    per_device = ROWS // devices
    h = per_device // k
    rows = np.concatenate([np.arange(d * per_device + i * h, d * per_device + (i + 1) * h) for d in range(devices)])
    return jax.tree.map(lambda x: x[rows], batch)


@pytest.mark.parametrize("form, strategy, sizes, grad_accum", [
    ("dict", "hsdp", DATA2_FSDP4, 1),
    ("tuple", "zero2", FSDP8, 2),  # global_mean per microbatch, the step averaging the two
])
def test_t5_encoder_decoder_trains_like_one_device_from_a_dict_or_a_tuple(form, strategy, sizes, grad_accum):
    as_form, inputs, loss_fn = T5_FORMS[form]
    model = from_linen(T5(), loss_fn, as_form(t5_batch(0)), inputs=inputs)
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(sizes)), grad_accum=grad_accum)
    state = program.init(jax.random.key(0))
    params0 = jax.tree.map(np.asarray, state.params)
    batches = [as_form(t5_batch(i)) for i in range(STEPS)]
    state, losses = _train(program, state, batches)

    def one_device(params, batch):
        args, kwargs = inputs(batch, False)
        return loss_fn(T5().apply({"params": params}, *args, **kwargs), batch)

    def reference(params, batch):
        return sum(one_device(params, _microbatch(batch, i, grad_accum, 8)) for i in range(grad_accum)) / grad_accum

    _, ref_losses = zoo.plain_steps(reference, params0, optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


# ---------------------------------------------------------------- what users get wrong


def tagger_init(key):
    """A pure-JAX token tagger: a dict of dicts, as written without Flax."""
    k1, k2 = jax.random.split(key)
    return {"embed": {"table": jax.random.normal(k1, (50, D)) * 0.1},
            "head": {"w": jax.random.normal(k2, (D, 5)) * 0.1, "b": jnp.zeros((5,))}}


def tagger_loss(params, batch):
    logits = jnp.tanh(params["embed"]["table"][batch["ids"]]) @ params["head"]["w"] + params["head"]["b"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"])
    return shardlib.global_mean(ce, batch["mask"])


class EvalOnlyBranch(nn.Module):
    @nn.compact
    def __call__(self, x, mask, *, train: bool):
        h = nn.Dense(64)(x) * mask
        return h + nn.Dense(64, name="calibration")(x) if not train else h  # created by init (train=False)


def test_bad_inputs_are_refused_naming_the_leaf_and_what_to_do():
    rng = np.random.default_rng(0)
    batch = {"ids": rng.integers(0, 50, (ROWS, 10)), "tags": rng.integers(0, 5, (ROWS, 10)),  # int64, as numpy makes
             "mask": _padding(rng, ROWS, 10)}
    model = from_functions(tagger_init, tagger_loss)
    program = build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh(FSDP8)))
    first = program.init(jax.random.key(0))
    state, _ = program.step(first, batch)
    with pytest.raises(ValueError, match=r"state 'step' \(and \d+ more\): donated to an earlier program.step"):
        program.step(first, batch)  # jaxlib 0.10.2 segfaults on a donated buffer, on XLA:CPU
    with pytest.raises(TypeError, match=r"batch 'ids' is a python list \(shape \(16, 10\)\); .* np.asarray"):
        program.step(state, {**batch, "ids": batch["ids"].tolist()})
    tensor = type("Tensor", (), {"shape": (ROWS, 10), "dtype": "torch.int64"})()  # a torch tensor, to the step
    with pytest.raises(TypeError, match=r"batch 'ids' is a \S*Tensor; .*x.numpy\(\) for a torch"):
        program.step(state, {**batch, "ids": tensor})
    with pytest.raises(ValueError, match=r"different row counts: .* batch 'rng' looks like a random key: .* call.key"):
        program.step(state, {**batch, "rng": jax.random.PRNGKey(1)})  # uint32[2]: read as 2 rows
    with pytest.warns(UserWarning, match=r"batch 'rng' looks like a random key: .*the same dropout mask on every"):
        state, _ = program.step(state, {**batch, "rng": jax.random.key(1)})  # a scalar: every device gets it whole
    with pytest.raises(TypeError, match=r"batch 'text' is a numpy array of dtype <U4, which JAX cannot hold"):
        program.step(state, {**batch, "text": np.array(["text"] * ROWS)})  # a datasets column left in
    ragged = [row[:n].tolist() for row, n in zip(batch["ids"], batch["mask"].sum(1))]
    with pytest.raises(TypeError, match=r"batch 'ids' is a python list of rows of different lengths; .* pad"):
        program.evaluate(state.params, {**batch, "ids": ragged})
    with pytest.raises(ValueError, match="Incompatible shapes") as shorter:
        program.step(state, {**batch, "tags": batch["tags"][:, :7]})
    assert "'tags' int32[2,7]" in shorter.value.__notes__[0]  # this device's rows of the leaf the message means
    with pytest.raises(ValueError, match=r"global_mean: weights of shape \(10,\) do not fit values of shape \(16, 10"):
        shardlib.global_mean(jnp.ones((ROWS, 10)), batch["mask"][0])  # numpy would align it with each row
    with pytest.raises(MeshError, match=r"mesh axis 'model' .* shardlib.make_mesh\(\{'data': 2, 'tensor': 4\}\)"):
        make_layout(model, "zero3", jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2))

    # linen gathers each weight as a layer reads it: one that training never reads is not "ungathered",
    # and an input of the wrong length fails with its own message, not the gather check's
    example = {"x": np.ones((ROWS, 8), np.float32), "mask": np.ones((ROWS, 64), np.float32)}
    linen = from_linen(EvalOnlyBranch(), lambda out, b: jnp.mean(out ** 2), example,
                       inputs=lambda b, train: ((b["x"], b["mask"]), {"train": train}), rng_streams=())
    program = build(linen, optax.sgd(0.1), make_layout(linen, "zero3", make_mesh(FSDP8)))
    state, metrics = program.step(program.init(jax.random.key(0)), example)
    assert int(metrics["skipped"]) == 0
    with pytest.raises(TypeError, match="mul got incompatible shapes") as wrong:
        program.step(state, {**example, "mask": example["mask"][:, :32]})
    assert "'mask' float32[2,32]" in wrong.value.__notes__[0]
