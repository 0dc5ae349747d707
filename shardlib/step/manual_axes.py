"""JAX's refusals that come from the train step's manual batch axes, explained.

Inside the step each device runs the model on its own rows in a ``shard_map`` whose batch axes
(`data`, `fsdp`) are manual and type-checked: values computed from the rows or the step's key vary
over them, constants do not. Code that is fine on one device then meets JAX errors about axis
types that name neither the cause nor the fix; `note` adds both to the error.
"""

from __future__ import annotations


def note(err: Exception, batch_axes: tuple[str, ...]) -> None:
    """JAX's refusals that come from the batch axes being manual in the step, with why and what to
    write (`_note_text`)."""
    text = _note_text(err, batch_axes)
    if text:
        err.add_note(text)


def _note_text(err: Exception, batch_axes: tuple[str, ...]) -> str | None:
    """The note for: a ``with_sharding_constraint`` over a batch axis in the model's own code
    (MaxText-style ``P("data", None)``); a loop carry or a cond/switch branch built from constants
    where the other comes out varying with the rows; and jax 0.10's ``jnp.searchsorted`` failing
    on row values in a shard_map that leaves axes to the compiler (a bare ``AssertionError``)."""
    message = str(err)
    if "can only refer to Auto axes" in message:
        return (f"shardlib: inside the train step the batch axes {batch_axes} are manual (each device computes on "
                "its own rows), so a jax.lax.with_sharding_constraint in the model may name only the other mesh "
                "axes ('tensor'); write shardlib.constrain(x, logical_names) or nn.with_logical_constraint, whose "
                "batch entries the step drops, or leave the batch axes out of the spec")
    if "manual axis types do not match" in message and "carry" in message:
        return (f"shardlib: inside the train step this device's rows vary over the batch axes {batch_axes}, so a "
                "lax.scan / fori_loop / while_loop whose initial carry is built from constants (zeros) but takes the "
                "rows up in its body changes type; start it from shardlib.batch_varying(initial_carry), the cast JAX "
                "suggests over those axes (the identity outside a step). Flax's RNN cells (nn.RNN, nnx.RNN) get it "
                "already. A loop inside jax.random (jax.random.poisson from a constant rate and the step's key) "
                "takes the cast on its parameter: jax.random.poisson(key, shardlib.batch_varying(rate), shape)")
    if "manual axis types do not match" in message and "branches" in message:
        return (f"shardlib: inside the train step this device's rows vary over the batch axes {batch_axes}, so a "
                "lax.cond / lax.switch branch that returns a constant (jnp.float32(0.0), zeros) where another "
                "returns a value computed from the rows or the step's key has another type; return "
                "shardlib.batch_varying(constant) from that branch (the identity outside a step), or select with "
                "jnp.where, which needs no cast")
    if isinstance(err, AssertionError) and message.startswith("ManualAxisType("):
        return (f"shardlib: jax's jnp.searchsorted raises this on values that vary over the manual batch axes "
                f"{batch_axes} in a shard_map that leaves other mesh axes to the compiler, as the train step does; "
                "jax.random.choice(key, n, shape, p=probs), jnp.interp and jnp.digitize call it. Draw with "
                "jax.random.categorical(key, jnp.log(probs), shape=shape) instead of choice with p, index a table "
                "with integers (schedule[t]) instead of jnp.interp, and count edges, (x[..., None] >= edges).sum(-1), "
                "instead of jnp.digitize / searchsorted(side='right')")
    return None
