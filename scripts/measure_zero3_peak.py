"""ZeRO-3's peak a device on unrolled models that never call `gather_layer`, with dp as the reference.

Issue 36, section 2: an unrolled 8-block NNX transformer (`Net`, d=256, mlp 1024, 4 heads, vocab
256, 24.6 MiB of f32 parameters) and a linen lm1b-style model of the same shapes (`LNet`), batch
16 x 64 tokens, 8 devices (`fsdp=8` / `data=8`); also the NNX model gathering each block itself
(`GNet`: `gather_layer`, `MANUAL=1`) and with `nnx.remat` around each gathered block (`RNet`,
`REMAT=1`). Figures are the compiled step's `memory_analysis` (nothing runs).

  python scripts/measure_zero3_peak.py nnx linen            # XLA:CPU, 8 simulated devices
  TOPOLOGY=v5e:2x4 python scripts/measure_zero3_peak.py nnx  # the TPU compiler, no TPU needed
  LAYERS=4 ...                                              # blocks (default 8)
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

def linen_model():
    example = {"inputs": np.zeros((B, T), np.int32), "targets": np.zeros((B, T), np.int32)}
    return shardlib.from_linen(LNet(), linen_loss, example, inputs=lambda b, train: ((b["inputs"],), {}))

def measure(make, strategy):
    model = make()
    devices = None
    if os.environ.get("TOPOLOGY"):
        from shardlib.runtime.devices import topology_devices
        devices = topology_devices(os.environ["TOPOLOGY"])
    mesh = shardlib.make_mesh({"data": 8} if strategy == "dp" else {"fsdp": 8}, devices=devices)
    program = shardlib.build(model, optax.adamw(1e-3), shardlib.make_layout(model, strategy, mesh))
    batch = program.abstract_batch({k: ((B, T), np.int32) for k in ("inputs", "targets")})
    mem = memory_stats(program.compile_step(program.abstract_state(), batch))
    params = sum(x.size * 4 for x in jax.tree.leaves(model.abstract()))
    return mem, params

class GNet(Net):
    def __call__(self, tokens):
        g = shardlib.gather_layer
        mask = nnx.make_causal_mask(tokens)
        x = g(self.embed)(tokens)
        for b in self.blocks:
            x = g(b)(x, mask)
        return g(self.head)(g(self.norm)(x))

class RNet(Net):
    def __call__(self, tokens):
        g = shardlib.gather_layer
        mask = nnx.make_causal_mask(tokens)
        x = g(self.embed)(tokens)
        step = nnx.remat(lambda blk, x: g(blk)(x, mask))
        for b in self.blocks:
            x = step(b, x)
        return g(self.head)(g(self.norm)(x))



def mib(n):
    return f"{n / 2**20:.2f} MiB"


def report(name, mem):
    print(f"  {name}: arguments {mib(mem.argument_bytes)}, temporaries {mib(mem.temp_bytes)}, peak {mib(peak_bytes(mem))}")


VARIANTS = {"nnx": lambda: shardlib.from_nnx(Net, nnx_loss),
            "nnx, gather_layer per block": lambda: shardlib.from_nnx(GNet, nnx_loss, gathers_params=True),
            "nnx, gather_layer + nnx.remat per block": lambda: shardlib.from_nnx(RNet, nnx_loss, gathers_params=True),
            "linen": lambda: linen_model()}

if __name__ == "__main__":
    for kind in sys.argv[1:] or ["nnx", "linen"]:
        names = [k for k in VARIANTS if k.startswith(kind)]
        for name in names:
            (dp, params), (z3, _) = measure(VARIANTS[name], "dp"), measure(VARIANTS[name], "zero3")
            print(f"{name} ({L} blocks, {mib(params)} of parameters, {os.environ.get('TOPOLOGY') or 'XLA:CPU'}):")
            report("dp", dp)
            report("zero3", z3)
