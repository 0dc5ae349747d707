"""Bad input is refused with a message that names the tensor, axis or batch and says what to do."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib.models import GPTConfig, trainable
from shardlib import ReplicationWarning, RuleError, build, from_functions, make_layout, make_mesh, sharding_report
from shardlib.sharding.strategies import get_strategy


def test_indivisible_dimension_when_replication_is_forbidden():
    # d_model=36 cannot be split over 8 fsdp devices; the mlp/heads fallbacks take over for
    # matrices, but the norm scales (36,) have nothing else to shard and stay replicated.
    model = trainable(GPTConfig(vocab_size=256, d_model=36, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16))
    mesh = make_mesh({"fsdp": 8})
    with pytest.warns(ReplicationWarning, match=r"zero3 on fsdp=8 keeps 4 tensor\(s\) whole on every device:\n"
                                                r"  blocks/attn/wk \(1, 36, 2, 18\) .*no free dimension"):
        layout = make_layout(model, "zero3", mesh)  # allowed by default, warned about, and reported
    assert "not divisible by fsdp=8" in layout.report()
    with pytest.raises(RuleError, match=r"final_norm/scale \(36,\): dim 0 \(embed=36\) not divisible by fsdp=8"):
        make_layout(model, "zero3", mesh, max_replicated_bytes=0)


def test_batch_not_divisible_by_the_data_axes():
    model = from_functions(lambda key: {"w": jnp.zeros((4, 4))}, lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
                           logical_axes={"w": ("embed", "mlp")})
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": 8})))
    state = program.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch 'x' has 12 rows.*multiple of 8: 8 or 16"):
        program.step(state, {"x": np.ones((12, 4), np.float32)})


@pytest.mark.parametrize("constant", [1.0, np.float32(1.0)])
def test_a_loss_that_is_a_python_or_numpy_number_is_named(constant):
    """float(...), .item() or np.mean in a loss cut it off from the parameters: nothing would train."""
    model = from_functions(lambda key: {"w": jnp.zeros((4,))}, lambda p, b: constant)
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", make_mesh({"data": 8})))
    with pytest.raises(TypeError, match=r"returned a (float|float32) .*nothing would train.*jnp expression"):
        program.step(program.init(jax.random.key(0)), {"x": np.ones((8, 4), np.float32)})


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; choose one of dp, zero1"):
        get_strategy("zero4")


def test_model_that_does_not_gather_what_it_declares():
    """A model claiming to gather its own weights but skipping one is caught when the step traces."""
    from flax import nnx

    class Forgetful(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((8, 8)), out_sharding=("embed", "mlp"))

        def __call__(self, x):
            return x @ self.w[...]

    from shardlib import from_nnx

    model = from_nnx(Forgetful, lambda m, b: jnp.mean(m(b["x"])), gathers_params=True)
    program = build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    state = program.init(jax.random.key(0))
    with pytest.raises(ValueError, match="never passed w through shardlib.model.hooks.gather_layer"):
        program.step(state, {"x": np.ones((8, 8), np.float32)})


def test_a_models_own_error_is_not_hidden_behind_the_gather_check():
    """Under zero3 a loss that fails before its first layer (a batch key the user misspelt) raises
    its own error, not the gather check's, though no layer has gathered its weights yet."""
    from flax import linen as nn

    from shardlib import from_linen

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64)(x)  # 2048 weights: split over fsdp

    example = {"image": np.ones((8, 32), np.float32)}
    model = from_linen(Net(), lambda out, b: jnp.mean(out), example, inputs=lambda b, train: ((b["image"],), {}))
    program = build(model, optax.sgd(0.1), make_layout(model, "zero3", make_mesh({"fsdp": 8})))
    with pytest.raises(KeyError, match="image") as raised:
        program.step(program.init(jax.random.key(0)), {"img": example["image"]})
    assert any("raised before the model (gathers_params=True) passed" in note for note in raised.value.__notes__)


def _matrix_model():
    return from_functions(lambda key: {"w": jnp.zeros((64, 64))}, lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
                          logical_axes={"w": ("embed", "mlp")})


@pytest.mark.parametrize("strategy,sizes,message", [
    ("tp", {"fsdp": 8}, r"strategy 'tp' shards over mesh axis tensor, which has one device on the mesh fsdp=8: "
                        r"nothing would be split; use a mesh such as --mesh tensor=8, or a strategy for this mesh: "
                        r"zero1, zero2, zero3, hsdp"),
    ("fsdp_tp", {"fsdp": 8}, r"'fsdp_tp' shards over mesh axis tensor, .* --mesh fsdp=4,tensor=2"),
    ("fsdp_tp", {"tensor": 8}, r"'fsdp_tp' shards over mesh axis fsdp, .* --mesh fsdp=4,tensor=2, or a strategy for this mesh: tp"),
    ("zero3", {"tensor": 8}, r"'zero3' shards over mesh axes data x fsdp, which have one device in all on the mesh tensor=8: .* --mesh fsdp=8, "
                             r"or a strategy for this mesh: tp$"),
    ("hsdp", {"data": 8}, r"'hsdp' shards over mesh axis fsdp, .* on the mesh data=8: .* --mesh data=2,fsdp=4"),
    ("zero1", {"tensor": 8}, r"'zero1' shards over mesh axes data x fsdp, .* --mesh data=8"),
])
def test_strategy_on_a_mesh_without_its_axes_names_the_mesh_to_use(strategy, sizes, message):
    with pytest.raises(RuleError, match=message):
        make_layout(_matrix_model(), strategy, make_mesh(sizes))


def test_one_device_and_hsdp_without_data_are_allowed():
    """One device: every strategy is the same placement. hsdp with data=1 is zero3 over fsdp."""
    model = _matrix_model()
    for strategy in ("zero3", "tp", "fsdp_tp", "hsdp"):
        with pytest.warns(ReplicationWarning, match=rf"strategy '{strategy}' on a one-device mesh splits nothing"):
            make_layout(model, strategy, make_mesh({}, devices=jax.devices()[:1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_layout(model, "dp", make_mesh({}, devices=jax.devices()[:1]))
    hsdp, zero3 = (make_layout(model, s, make_mesh({"fsdp": 8})) for s in ("hsdp", "zero3"))
    assert hsdp.params["w"].spec == zero3.params["w"].spec == jax.sharding.PartitionSpec("fsdp", None)


def test_rules_that_name_none_of_the_models_axes_are_warned_about():
    model = from_functions(lambda key: {"w": jnp.zeros((64, 64))}, lambda p, b: jnp.mean(b["x"] @ p["w"]),
                           logical_axes={"w": ("fsdp", "tensor")})
    with pytest.warns(ReplicationWarning, match=r"strategy 'tp' has no rule for any of the model's axis names "
                                                r"\(fsdp, tensor\); these look like mesh axes: strategy 'as_annotated'"):
        make_layout(model, "tp", make_mesh({"fsdp": 2, "tensor": 4}))


def test_dp_over_a_pipeline_is_not_told_to_add_rules():
    """dp keeps every tensor whole by design; over pipe x data its only rule is the stack's split over
    pipe, which the mesh adds: no 'has no rule for the model's axis names' advice (it would make dp ZeRO-3)."""
    import warnings

    from shardlib.models import get_config, trainable

    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        layout = make_layout(trainable(get_config("tiny")), "dp", make_mesh({"pipe": 2, "data": 4}))
    assert layout.params["blocks"]["attn"]["wq"].spec[0] == "pipe"


def test_unknown_names_hint_a_rule_and_a_stacks_layers_name_is_not_the_users():
    """Flax's guide writes (None, "model"): the hint maps it, rather than naming the strategy that just
    failed; the "layers" name the adapters give an nn.scan stack is no name the user wrote."""
    import warnings

    model = from_functions(lambda key: {"w": jnp.zeros((64, 64))}, lambda p, b: 0.0, logical_axes={"w": (None, "model")})
    with pytest.warns(ReplicationWarning, match=r"\(model\); map them onto mesh axes, e\.g\. get_strategy\('tp'\)"
                                                r"\.with_rules\(param_rules=\(\('model', 'tensor'\),\)") as seen:
        make_layout(model, "tp", make_mesh({"tensor": 8}))
    assert all("use a strategy whose rules name them" not in str(w.message) for w in seen)
    stack = from_functions(lambda key: {"w": jnp.zeros((4, 64, 64))}, lambda p, b: 0.0,
                           logical_axes={"w": ("layers", None, None)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        make_layout(stack, "zero3", make_mesh({"fsdp": 8}))


def test_unwrapped_modules_and_an_nnx_optimizer_name_what_to_pass():
    """The NNX tutorial's objects handed straight over: the module, then nnx.Optimizer."""
    from flax import linen as nn
    from flax import nnx

    mesh = make_mesh({"data": 8})
    module = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    for given, adapter in ((module, "from_nnx"), (nn.Dense(4), "from_linen"), ({"w": np.ones(3)}, "from_functions")):
        with pytest.raises(TypeError, match=rf"make_layout takes a shardlib.Model, got .*: "
                                            rf"wrap it with shardlib.{adapter}\("):
            make_layout(given, "dp", mesh)
    model = _matrix_model()
    with pytest.raises(TypeError, match=r"got flax\.nnx.*Optimizer: pass its optax transformation \(optimizer\.tx\)"):
        build(model, nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param), make_layout(model, "dp", mesh))
    with pytest.raises(TypeError, match=r"takes a Layout as its third argument, got str: make one with"):
        build(model, optax.sgd(0.1), "dp")


def test_every_adapter_names_axis_names_that_no_strategy_knows():
    """The Flax guide's mesh name "model" (NNX) and a rules-context name "hidden" (linen) are placed
    as if unnamed by every strategy: make_layout says so with the tensor and dim, whichever adapter."""
    from flax import linen as nn
    from flax import nnx

    from shardlib import from_linen, from_nnx

    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
    make = lambda rngs: nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
    with pytest.warns(UserWarning, match=r"no strategy has a rule .*: kernel \(8, 16\) dim 1 'model'"):
        make_layout(from_nnx(make, lambda m, b: m(b["x"]).mean()), "zero3", make_mesh({"fsdp": 8}))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            kernel_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "hidden"))
            return nn.Dense(16, kernel_init=kernel_init)(x)

    with pytest.warns(UserWarning, match=r"no strategy has a rule .*: Dense_0/kernel \(8, 16\) dim 1 'hidden'"):
        make_layout(from_linen(Net(), lambda out, b: out.mean(), {"x": np.ones((2, 8), np.float32)},
                               inputs=lambda b, train: ((b["x"],), {})), "zero3", make_mesh({"fsdp": 8}))


def test_a_models_own_sharding_constraint_on_a_batch_axis_is_explained():
    """MaxText-style jax.lax.with_sharding_constraint(x, P("data", None)) in the model: JAX refuses a
    manual axis inside the step; the error says why the axis is manual and what to write instead."""
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh({"data": 8})
    model = from_functions(lambda key: {"w": jnp.zeros((64, 64))},
                           lambda p, b: jnp.mean(jax.lax.with_sharding_constraint(b["x"] @ p["w"], P("data", None))))
    program = build(model, optax.sgd(0.1), make_layout(model, "dp", mesh))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="can only refer to Auto axes") as raised:
        program.step(program.init(jax.random.key(0)), {"x": np.ones((8, 64), np.float32)})
    assert any("the batch axes ('data',) are manual" in note and "shardlib.constrain(x, logical_names)" in note
               for note in raised.value.__notes__)


def test_sharding_report_takes_the_layout():
    layout = make_layout(_matrix_model(), "zero1", make_mesh({"data": 8}))
    text = sharding_report(layout)
    assert "optimizer state:" in text and "replicated against the strategy: none" in text
    assert sharding_report(layout.params, layout.mesh).splitlines()[0] == text.splitlines()[0]
    with pytest.raises(TypeError, match="needs its mesh"):
        sharding_report(layout.params)


def test_inspect_refuses_a_strategy_the_mesh_cannot_apply_and_totals_the_replicated(capsys):
    from shardlib.cli import main

    assert main(["inspect", "--model", "tiny", "--strategy", "tp", "--devices", "8", "--mesh", "fsdp=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardlib inspect: error: strategy 'tp' shards over mesh axis tensor") and "--mesh tensor=8" in err
    assert main(["inspect", "--model", "tiny", "--strategy", "zero3", "--devices", "8"]) == 0
    assert "replicated against the strategy: none" in capsys.readouterr().out


def test_a_state_of_another_program_is_named_by_the_paths_that_differ():
    model = _matrix_model()
    layout = make_layout(model, "zero1", make_mesh({"data": 8}))
    adam, momentum = build(model, optax.adam(1e-3), layout), build(model, optax.sgd(1e-3, momentum=0.9), layout)
    batch = {"x": np.ones((8, 64), np.float32)}
    with pytest.raises(ValueError, match=r"the state given was not made by this program .*opt_state/0/mu/w: in the "
                                         r"state given, not in this program's.*opt_state/0/trace/w: in this program's "
                                         r"state, not in the one given; make it with this program's init"):
        momentum.step(adam.init(jax.random.key(0)), batch)
    with pytest.raises(TypeError, match=r"step takes the TrainState this program's init .* made, got dict"):
        adam.step({"w": np.zeros((64, 64), np.float32)}, batch)
