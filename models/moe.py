"""A mixture-of-experts GPT: `models.gpt`'s decoder whose MLPs are top-k routed SwiGLU experts.

Routing is per sequence (GShard's groups are the rows): each expert takes at most ``capacity``
tokens of a row, first choices before second ones, earlier tokens first; the assignments past
that are dropped and the token keeps only its residual. A row's routing depends on that row
alone, so it is the same on one device and on any split of the batch. The slots are found by
sorting the assignments by expert and the tokens scattered into them (memory and work linear in
tokens x top_k, not GShard's one-hot ``[T, E, C]``); ``dropless`` keeps every assignment and runs
the experts as grouped matmuls over sorted groups. The experts' weights are
stacked on a leading ``"experts"`` axis, which the ``expert`` mesh axis splits; tokens reach them
by all-to-all (`shardlib.model.experts`). docs/moe.md has the formulas. The gates are renormalised
or not as `MoEConfig.norm_topk_prob` says, and a shared expert with a sigmoid gate may run beside the
routed ones (`MoEConfig.shared_d_ff`): Mixtral's, Qwen2-MoE's and Qwen3-MoE's layers (`shardlib.hf`).

The loss adds the Switch/GShard load-balancing loss, ``E * sum_e f_e P_e`` per row (f_e the
fraction of the row's tokens whose first choice is e, P_e its mean router probability), and the
ST-MoE router z-loss, the mean squared log-partition of the router logits; each summed over the
layers. The metrics show the balance: tokens routed to each expert (all layers), their
min / max / coefficient of variation over the experts of each layer, the assignments dropped
at capacity, and both losses.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .configs import MoEConfig
from .gpt import GPT, RESIDUAL, Attention, Block, GatedMLP, RMSNorm, fan_in_init, logits_loss, named_param
from shardlib.model import experts as experts_lib
from shardlib.model.hooks import batch_sum, constrain, global_mean, global_sum


class Experts(nnx.Module):
    """``n_experts`` SwiGLU MLPs, stacked on a leading ``"experts"`` axis."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        e, d, f = config.n_experts, config.d_model, config.d_ff
        names = ("experts", "embed", "mlp")
        self.w_gate = named_param(rngs, fan_in_init(1, 2), (e, d, f), names)
        self.w_up = named_param(rngs, fan_in_init(1, 2), (e, d, f), names)
        self.w_down = named_param(rngs, fan_in_init(1, 2, scale=1.0 / (2 * config.n_layers)), (e, f, d), ("experts", "mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[experts held here, tokens, d]`` -> the same shape, each expert on its own tokens."""
        dtype = x.dtype
        gate = jnp.einsum("end,edf->enf", x, self.w_gate[...].astype(dtype))
        up = jnp.einsum("end,edf->enf", x, self.w_up[...].astype(dtype))
        return jnp.einsum("enf,efd->end", jax.nn.silu(gate) * up, self.w_down[...].astype(dtype))

    def grouped(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``[tokens, d]`` sorted by expert, ``group_sizes[e]`` of them expert e's -> the same shape:
        one grouped matmul per weight, however unevenly the tokens fall."""
        dtype = x.dtype
        matmul = lambda a, w: jax.lax.ragged_dot(a, w[...].astype(dtype), group_sizes)
        return matmul(jax.nn.silu(matmul(x, self.w_gate)) * matmul(x, self.w_up), self.w_down)


class Routing(nnx.Module):
    """The router: float32 logits over the experts, top-k choices, and each assignment's slot in
    its expert's capacity, found by sorting (never a one-hot ``[T, E, C]`` tensor)."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.w_router = named_param(rngs, fan_in_init(0, 1), (config.d_model, config.n_experts), ("embed", None))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        """x [B, T, d] -> (expert int32[B, k*T], slot int32[B, k*T], gate float32[B, k*T], stats of
        the rows). The k*T assignments of a row are in priority order (every token's first choice,
        then its second ...); ``slot`` is the assignment's place in its expert's capacity, equal to
        the capacity where it is dropped."""
        config = self.config
        e, k, capacity = config.n_experts, config.top_k, self.capacity(x.shape[1])
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.w_router[...])
        probs = jax.nn.softmax(logits, axis=-1)
        gates, choice = jax.lax.top_k(probs, k)  # [B, T, k]
        if config.renormalizes:  # GShard, Mixtral: the chosen experts' weights sum to 1
            gates = gates / gates.sum(axis=-1, keepdims=True)
        expert = choice.swapaxes(1, 2).reshape(x.shape[0], -1)  # [B, k*T], priority order
        position, counts = jax.vmap(lambda row: _rank_in_group(row, e))(expert)
        kept = position < capacity
        first = jax.nn.one_hot(choice[:, :, 0], e, dtype=jnp.float32)  # [B, T, E]
        stats = {
            "routed": counts.sum(axis=0).astype(jnp.float32),  # [E] assignments before capacity
            "dropped": (~kept).sum().astype(jnp.float32),
            "aux": e * (first.mean(axis=1) * probs.mean(axis=1)).sum(axis=-1),  # [B] per row
            "z": jax.nn.logsumexp(logits, axis=-1) ** 2,  # [B, T]
        }
        return expert, jnp.where(kept, position, capacity), gates.swapaxes(1, 2).reshape(expert.shape), stats

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per row: `MoEConfig.capacity`, or the whole row when dropless (a token
        takes an expert at most once, so nothing reaches it)."""
        return seq_len if self.config.dropless else self.config.capacity(seq_len)


def _rank_in_group(expert: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """For assignments to ``expert`` (int[N], priority order): how many earlier ones chose the
    same expert, and the count per expert. A stable sort groups them, O(N log N) time and O(N)
    memory where GShard's cumsum of one-hots takes O(N E)."""
    order = jnp.argsort(expert, stable=True)
    counts = jnp.zeros(n_experts, jnp.int32).at[expert].add(1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(expert.shape[0], dtype=jnp.int32) - starts[expert[order]]
    return jnp.zeros_like(expert).at[order].set(ranked), counts


class MoE(nnx.Module):
    """Route, dispatch to the experts (over the ``expert`` axis), combine weighted by the gates."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        self.router = Routing(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs)
        if config.shared_d_ff:  # Qwen2-MoE: a SwiGLU every token takes, scaled by a sigmoid gate
            self.shared = GatedMLP(config, rngs=rngs, d_ff=config.shared_d_ff)
            self.shared_gate = named_param(rngs, fan_in_init(0, 1), (config.d_model, 1), ("embed", None))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        batch, seq, d = x.shape
        expert, slot, gate, stats = self.router(x)
        tokens = x[:, jnp.tile(jnp.arange(seq), expert.shape[1] // seq)]  # [B, k*T, d]
        if self.router.config.dropless:
            picked, stats["grouped_rows"] = self._dropless(tokens, expert, slot)
        else:
            picked = self._capacity(tokens, expert, slot)
        weighted = (gate[..., None].astype(x.dtype) * picked).reshape(batch, -1, seq, d)
        out = weighted.sum(axis=1)
        if hasattr(self, "shared"):
            shared_gate = jax.nn.sigmoid(jnp.einsum("btd,dz->btz", x, self.shared_gate[...].astype(x.dtype)))
            out = out + shared_gate * self.shared(x)
        return out, stats

    def _capacity(self, tokens: jax.Array, expert: jax.Array, slot: jax.Array) -> jax.Array:
        """Each kept assignment's token scattered into its slot of ``[E, rows, capacity, d]`` (a
        dropped one's slot is out of range), sent to its expert's device, and its output gathered
        back (zero where dropped)."""
        batch, assignments, d = tokens.shape
        e, k = self.router.config.n_experts, self.router.config.top_k
        capacity = self.router.capacity(assignments // k)
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], expert.shape)
        buffer = jnp.zeros((e, batch, capacity, d), tokens.dtype).at[expert, rows, slot].set(tokens, mode="drop")
        out = experts_lib.combine(self.experts(experts_lib.dispatch(buffer.reshape(e, batch * capacity, d))))
        return out.reshape(e, batch, capacity, d).at[expert, rows, slot].get(mode="fill", fill_value=0)

    def _dropless(self, tokens: jax.Array, expert: jax.Array, slot: jax.Array) -> jax.Array:
        """Every assignment of every row, sorted by expert, sent in variable-sized groups to its
        expert's device (`experts.dispatch_sorted`), through the experts' grouped matmul, and
        put back in order; and the rows the grouped matmul computed (the group sizes' sum)."""
        flat = expert.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros(self.router.config.n_experts, jnp.int32).at[flat].add(1)
        rows, groups, plan = experts_lib.dispatch_sorted(tokens.reshape(-1, tokens.shape[-1])[order], sizes)
        out = experts_lib.combine_sorted(self.experts.grouped(rows, groups), plan)
        return jnp.zeros_like(out).at[order].set(out).reshape(tokens.shape), groups.sum()


class MoEBlock(Block):
    """Pre-norm decoder block: attention (the dense block's, with its windows and options), then the
    mixture of experts; returns the routing stats beside the stream."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, config.d_model, eps=config.norm_eps, offset=config.norm_offset, rngs=rngs)
        self.attn_norm = norm()
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = norm()
        self.moe = MoE(config, rngs=rngs)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array,
                 window: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        x = constrain(x + self.attn(self.attn_norm(x), sin, cos, window), RESIDUAL)
        y, stats = self.moe(self.mlp_norm(x))
        return constrain(x + y, RESIDUAL), stats

    def cached(self, x: jax.Array, sin: jax.Array, cos: jax.Array, attend: Any,
               window: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """`Block.cached` (generation, `models.decoding`) with the experts as the MLP."""
        attended, carry = self.attn.cached(self.attn_norm(x), sin, cos, attend, window)
        x = x + attended
        return x + self.moe(self.mlp_norm(x))[0], carry


class MoEGPT(GPT):
    """`models.gpt.GPT` with MoE blocks; ``apply_blocks`` also returns the layers' routing stats.
    Everything else (rope and its scalings, windows, q/k norms, biases, the KV cache's decoding) is
    the dense decoder's."""

    block = MoEBlock

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.routed(tokens)[0])

    def routed(self, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Tokens -> (residual stream after the blocks, routing stats stacked over the layers)."""
        return self.apply_blocks(self.embed(tokens))

    def apply_blocks(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self.scan_blocks(x)


def build(config: MoEConfig, rngs: nnx.Rngs | int = 0) -> MoEGPT:
    """A freshly initialised MoE model (an int seed is turned into ``nnx.Rngs``)."""
    with nnx.use_eager_sharding(False):  # shardlib places the parameters (no mesh needed here)
        return MoEGPT(config, rngs=nnx.Rngs(rngs) if isinstance(rngs, int) else rngs)


def moe_loss(model: MoEGPT, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy + ``aux_loss_coef`` * load-balancing loss + ``z_loss_coef`` * router z-loss
    (each summed over layers); the aux metrics report the balance (`balance_metrics`). With a
    ``batch["loss_mask"]`` the cross-entropy is the mean over the counted targets, as
    `models.gpt.next_token_loss`."""
    config = model.config
    x, stats = model.routed(batch["inputs"])
    loss, aux = logits_loss(model.head(x), batch["targets"], batch.get("loss_mask"))
    balance = global_mean(stats["aux"].mean(axis=0))  # per row, averaged over the layers
    z_loss = global_mean(stats["z"].mean(axis=0))
    total = loss + config.n_layers * (config.aux_loss_coef * balance + config.z_loss_coef * z_loss)
    return total, {**aux, "ce_loss": loss, "aux_loss": balance, "z_loss": z_loss, **balance_metrics(stats)}


def balance_metrics(stats: dict[str, Any]) -> dict[str, jax.Array]:
    """The routing counts over the whole batch: ``expert_tokens/i`` (assignments to expert i, all
    layers), the min / max of one layer's expert over its mean (worst layer), the coefficient of
    variation (mean over layers), and ``tokens_dropped`` at capacity (all layers)."""
    routed = jax.lax.stop_gradient(batch_sum(stats["routed"]))  # [L, E] over every device's rows
    mean = routed.mean(axis=-1)
    cv = routed.std(axis=-1) / mean
    per_expert = jax.lax.stop_gradient(stats["routed"]).sum(axis=0)
    return {
        "expert_min_over_mean": (routed.min(axis=-1) / mean).min(),
        "expert_max_over_mean": (routed.max(axis=-1) / mean).max(),
        "expert_cv": cv.mean(),
        "tokens_dropped": global_sum(jax.lax.stop_gradient(stats["dropped"]).sum()),
        **{f"expert_tokens/{i}": global_sum(per_expert[i]) for i in range(per_expert.shape[0])},
        # dropless: the rows the experts' grouped matmuls computed, all layers: the assignments, no padding
        **({"expert_rows_computed": global_sum(stats["grouped_rows"].sum())} if "grouped_rows" in stats else {}),
    }


def trainable(config: MoEConfig) -> Any:
    """The MoE decoder as a `shardlib.Model` that gathers its own weights one layer at a time."""
    from shardlib.model import from_nnx

    return from_nnx(lambda rngs: MoEGPT(config, rngs=rngs), moe_loss, gathers_params=True)
