"""A user's own training loop with `Checkpointer` and `PreemptionGuard`, on users' own models:
killed mid-save (SIGKILL) or preempted (SIGTERM), then resumed, against the run that was never
interrupted, bit for bit; and the mistakes a user makes with a checkpoint, each refused by name.

The interrupted loops are real subprocesses with this process's XLA flags (conftest's), so
their numbers compare bit for bit with the uninterrupted runs made here in-process.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlib
from tests.helpers import assert_bitwise
from shardlib import Checkpointer, build, make_layout, make_mesh
from shardlib.runtime.checkpoint import CheckpointError, CheckpointMismatchError, NonFiniteStateError

REPO = Path(__file__).resolve().parents[1]
WIDTH = 32  # a 32 x 32 kernel (1024 elements) is split by ZeRO's fallback; the rest stays whole


def _xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def vec_batch(i: int, rows: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"x": rng.standard_normal((rows, 8)).astype(np.float32), "label": rng.integers(0, 4, rows).astype(np.int32)}


# ---- NNX: BatchNorm, dropout and a counter of its own (the NNX tutorials' style)


class Count(nnx.Variable):
    pass


class NnxNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(8, WIDTH, rngs=rngs)
        self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)
        self.hidden = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(WIDTH, 4, rngs=rngs)
        self.calls = Count(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls.value += 1
        return self.out(self.drop(nnx.relu(self.hidden(nnx.relu(self.bn(self.fc1(x)))))))


def nnx_program(strategy: str, sizes: dict):
    model = shardlib.from_nnx(NnxNet, lambda m, batch: _xent(m(batch["x"]), batch))
    return build(model, optax.adamw(1e-2), make_layout(model, strategy, make_mesh(sizes)))


# ---- a plain pytree with the optimizer of a gradient-accumulating user


def mlp_init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    dense = lambda k, n, m: {"kernel": jax.random.normal(k, (n, m)) / np.sqrt(n), "bias": jnp.zeros(m)}
    return {"dense1": dense(k1, 8, WIDTH), "dense2": dense(k2, WIDTH, WIDTH), "head": dense(k3, WIDTH, 4)}


def mlp_loss(params, batch):
    h = batch["x"]
    for name in ("dense1", "dense2"):
        h = jax.nn.relu(h @ params[name]["kernel"] + params[name]["bias"])
    return _xent(h @ params["head"]["kernel"] + params["head"]["bias"], batch)


def mlp_program():
    tx = optax.MultiSteps(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), every_k_schedule=2)
    model = shardlib.from_functions(mlp_init, mlp_loss)
    return build(model, tx, make_layout(model, "zero2", make_mesh({"data": -1})))


# ---- linen: BatchNorm and dropout behind a train flag (the Flax examples' style)


class LinenCNN(nn.Module):
    width: int = 8
    second_norm: bool = False

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Conv(self.width, (3, 3))(x))
        if self.second_norm:
            x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x).mean(axis=(1, 2)))
        return nn.Dense(4)(x)


def image_batch(i: int, rows: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"image": rng.standard_normal((rows, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 4, rows).astype(np.int32)}


def linen_program(strategy: str, sizes: dict, devices=None, **module):
    model = shardlib.from_linen(LinenCNN(**module), _xent, image_batch(0),
                                inputs=lambda batch, train: ((batch["image"],), {"train": train}))
    return build(model, optax.adamw(1e-2), make_layout(model, strategy, make_mesh(sizes, devices=devices)))


# ---- helpers




def _steps(program, state, batch, first: int, last: int):
    """Steps ``first + 1`` .. ``last`` of a user's loop (batch i-1 at step i): final state, losses."""
    losses = []
    for step in range(first + 1, last + 1):
        state, metrics = program.step(state, batch(step - 1))
        losses.append(float(metrics["loss"]))
    return state, losses


def _child(script: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ)  # conftest's XLA flags: the child compiles exactly as this process
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---------------------------------------------------------------- SIGKILL mid-save, resume


_KILLED_LOOP = """
    import asyncio, sys
    import shardlib
    shardlib.simulate_cpu_devices(8)
    import jax, orbax.checkpoint as ocp
    from tests.test_user_loop_resume import nnx_program, vec_batch

    commit = ocp.path.atomicity.AtomicRenameTemporaryPath.finalize

    async def commit_all_but_6(self, *args, **kwargs):  # step 6's arrays are written; the rename is next
        if self.get_final().name != "6":
            return await commit(self, *args, **kwargs)
        print("SAVING 6", flush=True)
        await asyncio.sleep(3600)

    ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = commit_all_but_6
    program = nnx_program("zero2", {"data": -1})
    state = program.init(jax.random.key(0))
    ckpt = shardlib.Checkpointer(sys.argv[1], every=2, keep=2)
    for step in range(1, 9):
        state, metrics = program.step(state, vec_batch(step - 1))
        if ckpt.should_save(step):
            ckpt.save(step, state, data_state={"next_batch": step}, config={"model": "NnxNet"}, metrics=metrics)
"""


def test_a_user_loop_killed_mid_save_resumes_bitwise_under_another_strategy(tmp_path):
    """NNX BatchNorm, dropout and a counter, async saves every 2 steps that the next (donating)
    steps overtake, SIGKILL while step 6 is written: the restart resumes from step 4 under zero3
    and ends where 8 uninterrupted zero2 steps end, bit for bit (the masks of steps 5-8 too)."""
    proc = _child(_KILLED_LOOP, str(tmp_path / "ckpt"))
    try:
        line = proc.stdout.readline()
        assert line == "SAVING 6\n", proc.stderr.read() if proc.poll() is not None else line
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "ckpt").iterdir()) == ["2", "4", "6"]
    assert any(p.name.startswith("6.orbax-checkpoint-tmp") for p in (tmp_path / "ckpt").iterdir())

    straight = nnx_program("zero2", {"data": -1})
    expected, expected_losses = _steps(straight, straight.init(jax.random.key(0)), vec_batch, 0, 8)

    program = nnx_program("zero3", {"fsdp": -1})
    with Checkpointer(tmp_path / "ckpt", every=2, keep=2) as ckpt:  # clears the partial save before its first
        assert ckpt.all_steps() == [2, 4]
        state, data_state, config = ckpt.restore(program.abstract_state())
        assert int(state.step) == 4 and data_state == {"next_batch": 4} and config == {"model": "NnxNet"}
        for step in range(5, 9):  # the user's loop again, from the saved data position
            state, metrics = program.step(state, vec_batch(step - 1))
            assert float(metrics["loss"]) == expected_losses[step - 1]
            if ckpt.should_save(step):
                ckpt.save(step, state, data_state={"next_batch": step}, config=config, metrics=metrics)
    assert ckpt.all_steps() == [6, 8] and not list((tmp_path / "ckpt").glob("*tmp*"))
    assert_bitwise(expected, state)  # params, BatchNorm statistics, counter, Adam state, step, rng


# ---------------------------------------------------------------- SIGTERM, exit 0, resume


_PREEMPTED_LOOP = """
    import os, signal, sys
    import shardlib
    shardlib.simulate_cpu_devices(8)
    import jax
    from shardlib.runtime.checkpoint import PreemptionGuard
    from tests.test_user_loop_resume import mlp_program, vec_batch

    program = mlp_program()
    state = program.init(jax.random.key(0))
    ckpt = shardlib.Checkpointer(sys.argv[1], every=2)
    with PreemptionGuard() as guard:
        for step in range(1, 1000):
            state, metrics = program.step(state, vec_batch(step - 1))
            if ckpt.should_save(step):
                ckpt.save(step, state, data_state={"next_batch": step}, metrics=metrics)  # no config: optional
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, half-way through an accumulation
            if guard.should_stop(step):
                ckpt.save(step, state, data_state={"next_batch": step}, force=True)
                sys.exit(0)  # no ckpt.wait(): the save still in flight must commit all the same
"""


def test_a_preempted_user_loop_saves_its_step_exits_0_and_resumes_bitwise(tmp_path):
    """SIGTERM in a loop with `PreemptionGuard` (a from_functions MLP, optax.MultiSteps over
    inject_hyperparams(adam)): the step is saved half-way through an accumulation, the process
    exits 0, and its exit waits for the async save it did not wait for; resuming ends where
    6 uninterrupted steps end, bit for bit."""
    proc = _child(_PREEMPTED_LOOP, str(tmp_path / "ckpt"))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "a save was still being written when the program ended; waiting for it to commit" in err

    program = mlp_program()
    expected, expected_losses = _steps(program, program.init(jax.random.key(0)), vec_batch, 0, 6)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.all_steps() == [2, 3]
        state, data_state, _ = ckpt.restore(program.abstract_state())
    assert data_state == {"next_batch": 3} and int(state.opt_state.mini_step) == 1  # one gradient held
    state, losses = _steps(program, state, vec_batch, data_state["next_batch"], 6)
    assert losses == expected_losses[3:]
    assert_bitwise(expected, state)


# ---------------------------------------------------------------- mistakes, another device count


def test_user_checkpoint_mistakes_are_refused_by_name_and_nothing_saved_is_replaced(tmp_path):
    """A linen CNN (BatchNorm, dropout) saved on 8 devices: restored on 4 exactly (statistics and
    dropout seed included); another width, an added BatchNorm, a NaN in the statistics, a data
    position JSON cannot hold, and the uncalled ``abstract_state`` are each refused by name, and
    the checkpoint already saved is the only one left."""
    program = linen_program("zero2", {"data": -1})
    state, _ = _steps(program, program.init(jax.random.key(0)), image_batch, 0, 2)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(2, state, data_state={"epoch": 0, "index": 2}, config={"model": "LinenCNN"})
        ckpt.wait()
        four = linen_program("dp", {"data": -1}, devices=jax.devices()[:4])
        restored, data_state, _ = ckpt.restore(four.abstract_state())
        assert_bitwise(state, restored)
        assert data_state == {"epoch": 0, "index": 2}
        assert restored.model_state["batch_stats"]["BatchNorm_0"]["mean"].sharding.mesh.size == 4

        with pytest.raises(CheckpointMismatchError, match=r"params/Conv_0/kernel: checkpoint \(3, 3, 1, 8\) float32 "
                                                          r"vs target \(3, 3, 1, 16\).*'model': 'LinenCNN'"):
            ckpt.restore(linen_program("zero2", {"data": -1}, width=16).abstract_state())
        with pytest.raises(CheckpointMismatchError, match=r"model_state/batch_stats/BatchNorm_1/mean: in the target"):
            ckpt.restore(linen_program("zero2", {"data": -1}, second_norm=True).abstract_state())
        with pytest.raises(CheckpointError, match=r"abstract_state'.*call it"):
            ckpt.restore(program.abstract_state)

        poisoned = jax.tree_util.tree_map_with_path(
            lambda p, x: x.at[0].set(jnp.nan) if "mean" in jax.tree_util.keystr(p) else x, state.model_state)
        with pytest.raises(NonFiniteStateError, match=r"model_state/batch_stats/BatchNorm_0/mean.*step 2\) is kept"):
            ckpt.save(4, dataclasses.replace(state, model_state=poisoned), data_state={}, config={})
        with pytest.raises(CheckpointError, match=r"data_state\['index'\] is a numpy.int64.*int\(x\)"):
            ckpt.save(6, state, data_state={"epoch": 0, "index": np.int64(6)}, config={})
        with pytest.raises(CheckpointError, match=r"data_state\['seen'\] has the key 0 \(int\)"):
            ckpt.save(8, state, data_state={"seen": {0: 8}}, config={})
        ckpt.wait()
        assert ckpt.all_steps() == [2]
