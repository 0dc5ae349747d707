"""Step time and memory of shardlib's train step against a plain `jax.jit` step, for users' models.

`scripts/benchmark.py` does this for shardlib's own GPT. Here the models are written as Flax
users write them, without logical names: a big_vision-style linen ViT (patch-embedding Conv,
``cls`` token, ``nn.MultiHeadDotProductAttention``, MLP, LayerNorm; the encoder either
``nn.scan(nn.remat(Block))`` or a Python loop of blocks) through ``shardlib.from_linen``, and an
NNX-tutorial-style classifier (``nnx.MultiHeadAttention``, blocks in an ``nnx.List``) through
``shardlib.from_nnx``. Only tp / fsdp_tp get names, by ``path_rules=`` (Megatron's split of
Flax's layers), since without them nothing would split over ``tensor``.

The baseline is the step such a user writes: ``jax.jit`` of ``value_and_grad`` of *their own*
loss (``module.apply`` for linen, ``nnx.merge`` for NNX) plus the same optax update, with
shardlib's layout's input/output shardings and donation. Both programs run interleaved with
alternating order after a warm-up (`benchmark.py`'s protocol); the ratio is the median of the
per-repeat ratios shardlib / jit. Also printed per program: per-device peak bytes, collective
bytes sent per device per step and collectives per step, from the compiled programs.

  python scripts/benchmark_user_models.py --markdown --repeats 9
  python scripts/benchmark_user_models.py --models vit_scan --strategies dp --repeats 1 --warmup 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import load, machine  # noqa: E402
from benchmark import _figures, _time, render  # noqa: E402

MODELS = ("vit_scan", "vit_loop", "nnx")
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "fsdp_tp")
NAMED_STRATEGIES = ("tp", "fsdp_tp")  # the ones that get path_rules=


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="M")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES, metavar="S")
    parser.add_argument("--width", type=int, default=192, help="model width (default: 192)")
    parser.add_argument("--depth", type=int, default=6, help="encoder blocks (default: 6)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads; tp splits them (default: 4)")
    parser.add_argument("--image-size", type=int, default=32, help="square image side, 8x8 patches (default: 32)")
    parser.add_argument("--batch-size", type=int, default=64, help="global images per step (default: 64)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per program (default: 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per program (default: 2)")
    parser.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                        help="shardlib's bucket_bytes in MiB (0: one collective per tensor; default: build's)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for BENCHMARKS.md)")
    return parser.parse_args(argv)


# ---- the users' models ----------------------------------------------------------------------------

def linen_vit(width: int, depth: int, heads: int, scan: bool) -> Any:
    """A big_vision-style ViT classifier (10 classes), built from the flags."""
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    inits = dict(kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))

    class MlpBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(width, **inits)(nn.gelu(nn.Dense(4 * width, **inits)(x)))

    class Encoder1DBlock(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=True):
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=heads, kernel_init=nn.initializers.xavier_uniform(),
                                                deterministic=deterministic)(y, y)
            x = x + y
            return x + MlpBlock()(nn.LayerNorm()(x)), None  # (carry, out) for nn.scan

    class ViT(nn.Module):
        @nn.compact
        def __call__(self, image, *, train=False):
            x = nn.Conv(width, (8, 8), strides=(8, 8), padding="VALID", name="embedding")(image)
            n, h, w, c = x.shape
            x = x.reshape(n, h * w, c)
            cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
            x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
            x = x + self.param("pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(c)), (1, x.shape[1], c))
            if scan:
                block = nn.scan(nn.remat(Encoder1DBlock, prevent_cse=False, static_argnums=(2,)),
                                variable_axes={"params": 0}, split_rngs={"params": True},
                                in_axes=nn.broadcast, length=depth)
                x, _ = block(name="encoderblock")(x, not train)
            else:
                for i in range(depth):
                    x, _ = Encoder1DBlock(name=f"encoderblock_{i}")(x, not train)
            x = nn.LayerNorm(name="encoder_norm")(x)
            return nn.Dense(10, kernel_init=nn.initializers.zeros, name="head")(x[:, 0])

    return ViT()


def nnx_classifier(width: int, depth: int, heads: int, rngs: Any) -> Any:
    """An NNX-tutorial-style transformer classifier over 8x8 patches (10 classes)."""
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(width, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class Classifier(nnx.Module):
        def __init__(self, rngs):
            self.patches = nnx.Conv(3, width, kernel_size=(8, 8), strides=(8, 8), padding="VALID", rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.head = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, image):
            x = self.patches(image)
            x = x.reshape(x.shape[0], -1, x.shape[-1])
            for block in self.blocks:
                x = block(x)
            return self.head(jnp.mean(self.norm(x), axis=1))

    return Classifier(rngs)


def smoothed_loss(logits: Any, batch: dict) -> Any:
    """big_vision's label-smoothed softmax cross-entropy on an {"image", "label"} batch."""
    import jax
    import optax

    soft = optax.smooth_labels(jax.nn.one_hot(batch["label"], logits.shape[-1]), 0.1)
    return optax.softmax_cross_entropy(logits, soft).mean()


# Megatron's split of Flax's own layers, by path: column-parallel q/k/v and MLP-in, row-parallel
# out and MLP-out (the names shardlib's tp rules map to ``tensor``).
ATTENTION_RULES = [
    (r"/(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"/(query|key|value)/bias$", ("heads", "head_dim")),
    (r"/out/kernel$", ("heads", "head_dim", "embed")),
]
LINEN_RULES = ATTENTION_RULES + [
    (r"MlpBlock_0/Dense_0/kernel$", ("embed", "mlp")),
    (r"MlpBlock_0/Dense_0/bias$", ("mlp",)),
    (r"MlpBlock_0/Dense_1/kernel$", ("mlp", "embed")),
]
NNX_RULES = ATTENTION_RULES + [(r"/up/kernel$", ("embed", "mlp")), (r"/up/bias$", ("mlp",)), (r"/down/kernel$", ("mlp", "embed"))]


def user_model(name: str, args: argparse.Namespace, example: dict, named: bool) -> tuple[Any, Callable]:
    """(shardlib Model, the user's own ``loss(params, batch)`` for the jit baseline)."""
    import jax
    from flax import nnx

    import shardlib

    if name.startswith("vit"):
        module = linen_vit(args.width, args.depth, args.heads, scan=name == "vit_scan")
        model = shardlib.from_linen(module, smoothed_loss, example, path_rules=LINEN_RULES if named else (),
                                    inputs=lambda batch, train: ((batch["image"],), {"train": train}))
        return model, lambda p, batch: smoothed_loss(module.apply({"params": p}, batch["image"], train=True), batch)

    def make(rngs):
        return nnx_classifier(args.width, args.depth, args.heads, rngs)

    model = shardlib.from_nnx(make, lambda module, batch: smoothed_loss(module(batch["image"]), batch),
                              path_rules=NNX_RULES if named else ())
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    return model, lambda p, batch: smoothed_loss(nnx.merge(graphdef, nnx.State(p))(batch["image"]), batch)


# ---- the programs ---------------------------------------------------------------------------------

def baseline_step(loss: Callable, tx: Any, program: Any, batch_sharding: Any) -> Any:
    """The user's step: jit(value_and_grad(their loss) + optax update) with shardlib's shardings."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    def step(state: Any, batch: dict) -> tuple[Any, dict]:
        value, grads = jax.value_and_grad(loss)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state), {"loss": value}

    replicated = NamedSharding(program.mesh, P())
    return jax.jit(step, in_shardings=(program.state_sharding, batch_sharding),
                   out_shardings=(program.state_sharding, replicated), donate_argnums=(0,))


def interleaved(fns: dict[str, Any], states: dict[str, Any], batch: Any, warmup: int, repeats: int) -> dict:
    """Seconds per step of each program, run in turn with the order alternating per repeat."""
    names = list(fns)
    times: dict[str, list[float]] = {key: [] for key in names}
    for repeat in range(warmup + repeats):
        for key in names if repeat % 2 == 0 else names[::-1]:
            states[key], seconds = _time(fns[key], states[key], batch)
            if repeat >= warmup:
                times[key].append(seconds)
    return times


def check_same_training(fns: dict[str, Any], states: dict[str, Any], batch: Any) -> None:
    """One more step of each: equal losses say the two programs train the same model the same way,
    so the timings compare like with like (a wrong baseline would otherwise look like a speed-up)."""
    import numpy as np

    losses = {key: float(fn(states[key], batch)[1]["loss"]) for key, fn in fns.items()}
    if not np.isclose(losses["shardlib"], losses["jit"], rtol=1e-3):
        raise SystemExit(f"benchmark_user_models: after the timed steps shardlib's loss is {losses['shardlib']:.6g} and "
                         f"the jit step's {losses['jit']:.6g}: the two programs do not compute the same step")


def bench(name: str, strategy: str, args: argparse.Namespace, batch_np: dict) -> dict[str, Any]:
    """Compile shardlib's step and the user's jit step for one model and strategy, then time them."""
    import jax
    import optax

    from shardlib import build, make_layout, make_mesh
    from shardlib.tools.plan_candidates import default_mesh

    model, loss = user_model(name, args, batch_np, named=strategy in NAMED_STRATEGIES)
    sizes = default_mesh(strategy, 8, argparse.Namespace(n_heads=args.heads, n_kv_heads=args.heads))
    mesh = make_mesh(sizes, devices=jax.devices()[:8])
    layout = make_layout(model, strategy, mesh)
    tx = optax.adamw(1e-3)
    program = build(model, tx, layout, **({} if args.bucket_mb is None else {"bucket_bytes": int(args.bucket_mb * 2**20)}))
    batch = jax.device_put(batch_np, layout.batch_sharding(batch_np))
    states = {"shardlib": program.init(jax.random.key(0)), "jit": program.init(jax.random.key(0))}
    fns = {"shardlib": program.step.lower(states["shardlib"], batch).compile(),
           "jit": baseline_step(loss, tx, program, layout.batch_sharding(batch_np)).lower(states["jit"], batch).compile()}
    times = interleaved(fns, states, batch, args.warmup, args.repeats)
    check_same_training(fns, states, batch)
    ratios = [a / b for a, b in zip(times["shardlib"], times["jit"])]
    return {"strategy": f"{name} {strategy}", "mesh": ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1),
            "shardlib_s": statistics.median(times["shardlib"]), "baseline_s": statistics.median(times["jit"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            **{f"shardlib_{k}": v for k, v in _figures(fns["shardlib"], 8).items()},
            **{f"baseline_{k}": v for k, v in _figures(fns["jit"], 8).items()}}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from shardlib.tools.plan_candidates import setup_devices

    setup_devices(8)
    import numpy as np

    rng = np.random.default_rng(0)
    side = args.image_size
    batch_np = {"image": rng.normal(size=(args.batch_size, side, side, 3)).astype(np.float32),
                "label": rng.integers(0, 10, size=(args.batch_size,)).astype(np.int32)}
    print(f"# width {args.width}, {args.depth} blocks, {args.heads} heads, {side}x{side}x3 images in 8x8 patches, "
          f"global batch {args.batch_size}, AdamW; {args.repeats} timed steps per program after {args.warmup} "
          f"warm-up; {machine()}", flush=True)
    rows = []
    for name in args.models:
        for strategy in args.strategies:
            rows.append(bench(name, strategy, args, batch_np))
            print(f"  {rows[-1]['strategy']}: ratio {rows[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
    print(f"# at the end: {load()}")
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
