"""ZeRO-3's peak a device and FLOPs on unrolled models that never call `gather_layer`, with dp as the reference.

An unrolled 8-block NNX transformer (`Net`, d=256, mlp 1024, 4 heads, vocab 256, 24.6 MiB of f32
parameters) and a linen lm1b-style model of the same shapes (`LNet`), batch 16 x 64 tokens, 8
devices (`fsdp=8` / `data=8`), AdamW. Each model is compiled under dp, under zero3 with its blocks
gathered per call (``blocks="auto"``, the default) whose backward re-gathers the weights and keeps
the matmuls' outputs (``block_recompute="weights"``, the default) or reruns each block ("block"),
and with the whole model gathered at the top of the step (``blocks=()``). Figures are the compiled
step's `memory_analysis` and `cost_analysis` (nothing runs; on TPU the peak is the compiler's heap
simulation of HBM, `shardlib.tools.memory.peak_bytes`).

The goals (issue 44): zero3's FLOPs at most 1.05 x dp's, and its peak at most 1.1 x (its state
shards + its gradient shards + one block's full parameters + the activations dp keeps), the
activations measured on a plain jax.jit of the same model's gradient on one device with its share
of the rows, nothing rematerialised (`activations`).

  TOPOLOGY=v5e:2x4 python scripts/measure_zero3_peak.py nnx linen  # the TPU compiler, no TPU needed
  python scripts/measure_zero3_peak.py nnx                         # XLA:CPU, 8 simulated devices
  LAYERS=4 ...                                                     # blocks (default 8)

XLA:CPU drops the optimization barriers of remat, so there the per-block gather saves nothing.
"""
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx, linen as nn
import shardlib
from shardlib.tools.memory import memory_stats, peak_bytes

D, FF, V, T, B, H = 256, 1024, 256, 64, 16, 4
L = int(os.environ.get("LAYERS", 8))

class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, FF, rngs=rngs)
        self.down = nnx.Linear(FF, D, rngs=rngs)
    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))

class Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)
    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.norm(x))

def nnx_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"]), batch["targets"]).mean()

class LBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        li = lambda names: nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, kernel_init=li(("embed", "heads", "kv")),
                                            out_kernel_init=li(("heads", "kv", "embed")))(y, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(FF, kernel_init=li(("embed", "mlp")))(y)
        return x + nn.Dense(D, kernel_init=li(("mlp", "embed")))(nn.gelu(y))

class LNet(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")))(tokens)
        for _ in range(L):
            x = LBlock()(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(V, kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "vocab")))(x)

def linen_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

def linen_model(blocks="auto"):
    example = {"inputs": np.zeros((B, T), np.int32), "targets": np.zeros((B, T), np.int32)}
    return shardlib.from_linen(LNet(), linen_loss, example, inputs=lambda b, train: ((b["inputs"],), {}), blocks=blocks)

def measure(make, strategy, recompute="weights"):
    model = make()
    mesh = shardlib.make_mesh({"data": 8} if strategy == "dp" else {"fsdp": 8}, devices=chips())
    program = shardlib.build(model, optax.adamw(1e-3), shardlib.make_layout(model, strategy, mesh),
                             block_recompute=recompute)
    batch = program.abstract_batch({k: ((B, T), np.int32) for k in ("inputs", "targets")})
    compiled = program.compile_step(program.abstract_state(), batch)
    params = sum(x.size * 4 for x in jax.tree.leaves(model.abstract()))
    return memory_stats(compiled), params, compiled.cost_analysis()["flops"]

def chips():
    if not os.environ.get("TOPOLOGY"):
        return None
    from shardlib.runtime.devices import topology_devices
    return topology_devices(os.environ["TOPOLOGY"])


def activations():
    """The reference for activations: a plain jax.jit of the loss's gradient on one device, nothing
    rematerialised (what dp keeps), compiled for B/8 rows and for twice that; activations grow
    with the rows and nothing else does, so the difference is B/8 rows' worth."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
    one = jax.sharding.SingleDeviceSharding((chips() or jax.devices())[0])
    place = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
    grad = jax.jit(jax.grad(lambda p, batch: nnx_loss(nnx.merge(graphdef, p), batch)))
    abstract = jax.tree.map(lambda x: place(x.shape, x.dtype), params)
    peak = lambda rows: peak_bytes(memory_stats(grad.lower(abstract, {k: place((rows, T), np.int32)
                                                                      for k in ("inputs", "targets")}).compile()))
    return peak(2 * B // 8) - peak(B // 8)


def mib(n):
    return f"{n / 2**20:.2f} MiB"


def block_bytes():
    return sum(x.size * 4 for x in jax.tree.leaves(nnx.state(Block(nnx.Rngs(0)), nnx.Param)))


MODELS = {"nnx": lambda blocks: shardlib.from_nnx(Net, nnx_loss, blocks=blocks),
          "linen": lambda blocks: linen_model(blocks)}

if __name__ == "__main__":
    acts = activations()
    for kind in sys.argv[1:] or ["nnx", "linen"]:
        dp, params, dp_flops = measure(lambda: MODELS[kind]("auto"), "dp")
        print(f"{kind} ({L} blocks, {mib(params)} of parameters, one block {mib(block_bytes())}, "
              f"{os.environ.get('TOPOLOGY') or 'XLA:CPU'}):")
        print(f"  dp: arguments {mib(dp.argument_bytes)}, peak {mib(peak_bytes(dp))}, {dp_flops:.4g} FLOPs; "
              f"activations {mib(acts)} (plain jax.jit, one device's rows, nothing rematerialised)")
        for blocks, recompute, name in (("auto", "weights", "zero3, blocks per call, re-gathering the weights"),
                                        ("auto", "block", "zero3, blocks per call, rerunning each block"),
                                        ((), "weights", "zero3, whole model gathered")):
            z3, _, flops = measure(lambda: MODELS[kind](blocks), "zero3", recompute)
            goal = z3.argument_bytes + params / 8 + block_bytes() + acts
            print(f"  {name}: arguments {mib(z3.argument_bytes)}, peak {mib(peak_bytes(z3))}, "
                  f"{peak_bytes(z3) / goal:.2f}x shards + gradient shards + one block + activations ({mib(goal)}); "
                  f"FLOPs {flops / dp_flops:.3f}x dp's")
