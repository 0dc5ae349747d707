"""shardlib's zero3 step against a hand-written plain `jax.jit` FSDP step, both compiled by the TPU compiler.

    python scripts/benchmark_tpu_program.py [--models 1b llama-7b 70b] [--topology v5p:4x4x4]
                                            [--batch-per-chip 1] [--seq-len 2048] [--remat full] [--markdown]

For each model, on every chip of a TPU slice (libtpu on this host; nothing runs):

* **shardlib**: `shardlib plan`'s zero3 candidate (bf16 compute, f32 master weights, AdamW);
* **plain jit**: the same decoder (`shardlib.models.gpt`), its parameters and AdamW moments as
  float32 `NamedSharding`s over one ``fsdp`` axis (each tensor split on its `embed` dim, else its
  largest dim the chips divide), cast to bf16 inside the loss, the residual stream's rows
  constrained to ``fsdp`` at the blocks' boundaries (how MaxText expresses FSDP: without those
  constraints XLA keeps the stream split on `embed` and every chip computes every row, 118 GB of
  temporaries for llama-7b on 64 chips), and ``jax.jit(value_and_grad)`` + optax with XLA placing
  every gather; the same compiler options (the TPU backend policy's, `shardlib.backend`).

Side by side: collective bytes a chip sends per step by kind, peak HBM a chip, and the roofline
step time and MFU on the generation's profile (`shardlib.tools.hardware`). The goal: shardlib's
bytes at most 1.0x and its peak at most 1.05x the plain program's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def plain_fsdp(config, chips, batch: int, seq_len: int):
    """The compiled plain-jit FSDP step of ``config`` on ``chips``."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from shardlib.backend import step_compiler_options
    from shardlib.models import trainable
    from shardlib.models.gpt import from_params

    n = len(chips)
    mesh = Mesh(mesh_utils.create_device_mesh((n,), chips), ("fsdp",))
    model = trainable(config)
    abstract = model.abstract()

    def spec(leaf, axes):
        dims = [i for i, name in enumerate(axes) if name == "embed" and leaf.shape[i] % n == 0]
        dims = dims or sorted((i for i, d in enumerate(leaf.shape) if d % n == 0), key=lambda i: -leaf.shape[i])
        names = [None] * leaf.ndim
        if dims:
            names[dims[0]] = "fsdp"
        return NamedSharding(mesh, P(*names))

    shardings = jax.tree.map(spec, abstract, model.logical_axes, is_leaf=lambda x: hasattr(x, "shape"))
    tx = optax.adamw(1e-4)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=s), abstract, shardings)
    opt_state = jax.eval_shape(tx.init, params)
    opt_shardings = jax.tree.map(lambda leaf: leaf.sharding if hasattr(leaf, "sharding") and leaf.sharding is not None
                                 else NamedSharding(mesh, P()), opt_state)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_state, opt_shardings)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))

    rows = NamedSharding(mesh, P("fsdp"))

    def loss(p, b):
        # The residual stream's rows stay split over fsdp at the blocks' boundaries (MaxText's
        # activation constraints); XLA then gathers each layer's weights where its matmuls need them.
        model = from_params(config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
        x = jax.lax.with_sharding_constraint(model.embed(b["inputs"]), rows)
        x = jax.lax.with_sharding_constraint(model.apply_blocks(x), rows)
        logits = model.head(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    def step(p, s, b):
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    jitted = jax.jit(step, out_shardings=(shardings, opt_shardings, NamedSharding(mesh, P())), donate_argnums=(0, 1),
                     compiler_options=step_compiler_options(chips))
    return jitted.lower(params, opt_state, {"inputs": tokens, "targets": tokens}).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-7b", "70b"])
    parser.add_argument("--topology", default="v5p:4x4x4")
    parser.add_argument("--batch-per-chip", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    from shardlib.runtime.devices import simulate_cpu_devices

    simulate_cpu_devices(1)
    from shardlib.text import format_bytes
    from shardlib.tools.hlo import collective_stats
    from shardlib.tools.memory import memory_stats, peak_bytes
    from shardlib.tools.plan import Planner

    rows = []
    for name in args.models:
        planner = Planner(name, None, precision="bf16", topology=args.topology, remat=args.remat,
                          seq_len=args.seq_len, batch_per_device=args.batch_per_chip, cache_dir=None)
        n = planner.n
        t0 = time.perf_counter()
        ours = planner.candidate("zero3", {"fsdp": n})
        if ours.error:
            print(f"{name}: shardlib's zero3 did not compile: {ours.error}")
            continue
        t1 = time.perf_counter()
        compiled = plain_fsdp(planner.config, planner.devices, planner.batch_size, planner.seq_len)
        t2 = time.perf_counter()
        stats = collective_stats(compiled.as_text(), n)
        plain_bytes = {k: v for k, v in stats.bytes_by_kind().items() if v}
        plain_peak = peak_bytes(memory_stats(compiled))
        bandwidth = planner.profile.intra_bandwidth
        compute_s = ours.compute_s
        plain_step = max(compute_s, stats.total_bytes / bandwidth)
        rows.append((name, ours, plain_bytes, stats.total_bytes, plain_peak, plain_step, t1 - t0, t2 - t1))
        print(f"{name} on {args.topology} ({n} chips), batch {planner.batch_size} x {planner.seq_len}, remat {args.remat}")
        print(f"  shardlib zero3: {dict((k, format_bytes(v)) for k, v in (ours.collective_bytes or {}).items() if v)}, "
              f"peak {format_bytes(ours.peak_bytes)}, step {ours.step_s * 1e3:.1f} ms, MFU {ours.mfu:.0%} ({t1 - t0:.0f} s)")
        print(f"  plain jit fsdp: {dict((k, format_bytes(v)) for k, v in plain_bytes.items())}, "
              f"peak {format_bytes(plain_peak)}, step {plain_step * 1e3:.1f} ms, MFU {ours.mfu * ours.step_s / plain_step:.0%} "
              f"({t2 - t1:.0f} s)")
        print(f"  shardlib / plain: bytes {ours.collective_total_bytes / stats.total_bytes:.2f}x, "
              f"peak {ours.peak_bytes / plain_peak:.2f}x", flush=True)
    if args.markdown and rows:
        print("\n| model | program | collective bytes a chip by kind | total | peak HBM a chip | roofline step | MFU | compile |")
        print("|---|---|---|---|---|---|---|---|")
        for name, ours, plain_bytes, plain_total, plain_peak, plain_step, ta, tb in rows:
            kinds = lambda d: ", ".join(f"{k} {format_bytes(v)}" for k, v in d.items() if v)
            print(f"| {name} | shardlib zero3 | {kinds(ours.collective_bytes or {})} | {format_bytes(ours.collective_total_bytes)} "
                  f"| {format_bytes(ours.peak_bytes)} | {ours.step_s * 1e3:.1f} ms | {ours.mfu:.0%} | {ta:.0f} s |")
            print(f"| {name} | plain jit FSDP | {kinds(plain_bytes)} | {format_bytes(plain_total)} | {format_bytes(plain_peak)} "
                  f"| {plain_step * 1e3:.1f} ms | {ours.mfu * ours.step_s / plain_step:.0%} | {tb:.0f} s |")
            print(f"| {name} | ratio | | {ours.collective_total_bytes / plain_total:.2f}x | {ours.peak_bytes / plain_peak:.2f}x | | | |")


if __name__ == "__main__":
    main()
