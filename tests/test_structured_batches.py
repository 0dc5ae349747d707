"""Batches that are not rows of images or tokens, written as their users write them.

A graph network in the jraph / Flax ogbg-molpcba style: a padded ``GraphsTuple`` whose leaves count
nodes, edges and graphs apart, message passing with ``jax.ops.segment_sum``, a loss masked by a
graph mask. No row split keeps such a batch whole, so the user pads one batch per device and
passes the stack as `shardlib.step.batch.per_device`, as a ``jax.pmap`` loop does; a plain ``GraphsTuple`` is
refused, and so are int64 values (hashed ids) that JAX would wrap to int32 without a word. A PPO
actor-critic (purejaxrl style) normalises its advantages over the whole batch, which each device
sees a part of: `shardlib.gather_batch` makes the statistics the batch's.

Each is compared with a plain ``jax.jit(jax.value_and_grad)`` + optax loop on one device
(`tests.zoo.plain_steps`) over every device's data, with no shardlib code.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import shardlib
from shardlib import build, from_functions, from_linen, make_layout, make_mesh
from shardlib.step.batch import per_device
from tests import zoo
from tests.helpers import optimizer  # AdamW, lr 3e-3, eps=1e-5

STEPS, DEVICES = 3, 8
N_NODE, N_EDGE, N_GRAPH = 16, 24, 4  # each device's padded sizes
pytestmark = pytest.mark.filterwarnings("ignore::shardlib.ReplicationWarning")


# ---- a graph network, as jraph users write it ---------------------------------------------------

class GraphsTuple(NamedTuple):  # jraph's fields
    nodes: np.ndarray
    edges: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    globals: np.ndarray
    n_node: np.ndarray
    n_edge: np.ndarray


def padded_graphs(rng: np.random.Generator) -> GraphsTuple:
    """1 to 3 real graphs, empty graphs, and a last padding graph holding the leftover nodes and edges."""
    real = int(rng.integers(1, N_GRAPH))
    n_node = np.zeros(N_GRAPH, np.int32)
    n_edge = np.zeros(N_GRAPH, np.int32)
    n_node[:real], n_edge[:real] = rng.integers(2, 5, real), rng.integers(1, 7, real)
    n_node[-1], n_edge[-1] = N_NODE - n_node.sum(), N_EDGE - n_edge.sum()
    first = np.repeat(np.cumsum(n_node) - n_node, n_edge)
    size = np.maximum(np.repeat(n_node, n_edge), 1)
    senders, receivers = (first + rng.integers(0, 1 << 20, N_EDGE) % size for _ in range(2))
    return GraphsTuple(rng.normal(size=(N_NODE, 6)).astype(np.float32), rng.normal(size=(N_EDGE, 3)).astype(np.float32),
                       senders.astype(np.int32), receivers.astype(np.int32),
                       rng.normal(size=(N_GRAPH, 2)).astype(np.float32), n_node, n_edge)


class GraphNet(nn.Module):
    latent: int = 16

    @nn.compact
    def __call__(self, graphs: GraphsTuple):
        n_node, n_graph = graphs.nodes.shape[0], graphs.n_node.shape[0]
        h = nn.Dense(self.latent)(graphs.nodes)
        for _ in range(2):
            messages = nn.Dense(self.latent)(jnp.concatenate([h[graphs.senders], graphs.edges], -1))
            received = jax.ops.segment_sum(messages, graphs.receivers, num_segments=n_node)
            h = nn.relu(nn.Dense(self.latent)(jnp.concatenate([h, received], -1)))
        graph_of_node = jnp.repeat(jnp.arange(n_graph), graphs.n_node, total_repeat_length=n_node)
        pooled = jax.ops.segment_sum(h, graph_of_node, num_segments=n_graph)
        return nn.Dense(1)(jnp.concatenate([pooled, graphs.globals], -1))[:, 0]


GNN = GraphNet()


def graph_mask(graphs: GraphsTuple) -> jax.Array:
    """Graphs with nodes, less the last (padding) one."""
    return (graphs.n_node > 0) & (jnp.arange(graphs.n_node.shape[0]) < graphs.n_node.shape[0] - 1)


def graph_errors(params, graphs: GraphsTuple) -> jax.Array:
    return (GNN.apply({"params": params}, graphs) - jnp.tanh(graphs.globals[:, 0])) ** 2


def gnn_loss(params, graphs: GraphsTuple):  # one device's graphs; the mean over the batch's real graphs
    return shardlib.global_mean(graph_errors(params, graphs), graph_mask(graphs))


def stacked_graphs(step: int, entries: int) -> GraphsTuple:
    """One padded GraphsTuple per device (x microbatches), stacked: the pmap loop's batch."""
    rng = np.random.default_rng(step)
    return jax.tree.map(lambda *xs: np.stack(xs), *[padded_graphs(rng) for _ in range(entries)])


def each_devices_graphs_loss(params, stacked: GraphsTuple, grad_accum: int) -> jax.Array:
    """One device over every device's graphs: microbatch i is entry d * K + i of each device d, its
    loss the mean over its real graphs; the step's loss is the mean of the K microbatches'."""
    errors = jax.vmap(graph_errors, in_axes=(None, 0))(params, stacked).reshape(DEVICES, grad_accum, N_GRAPH)
    masks = jax.vmap(graph_mask)(stacked).reshape(DEVICES, grad_accum, N_GRAPH)
    return jnp.mean(jnp.sum(errors * masks, (0, 2)) / jnp.sum(masks, (0, 2)))


@pytest.mark.parametrize("strategy, sizes, grad_accum", [("dp", {"data": DEVICES}, 2), ("zero2", {"fsdp": DEVICES}, 1)])
def test_padded_graphs_per_device_train_like_one_device_and_broken_batches_are_refused(strategy, sizes, grad_accum):
    model = from_functions(lambda key: GNN.init(key, padded_graphs(np.random.default_rng(9)))["params"], gnn_loss)
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(sizes)), grad_accum=grad_accum)
    state = program.init(jax.random.key(0))
    params0 = jax.tree.map(np.asarray, state.params)
    batches = [stacked_graphs(step, DEVICES * grad_accum) for step in range(STEPS)]
    losses = []
    for graphs in batches:
        state, metrics = program.step(state, per_device(graphs))
        losses.append(float(metrics["loss"]))

    ref_params, ref_losses = zoo.plain_steps(lambda p, b: each_devices_graphs_loss(p, b, grad_accum), params0,
                                             optimizer(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    evaluation = program.evaluate(state.params, per_device(stacked_graphs(0, DEVICES)))  # one entry a device
    np.testing.assert_allclose(float(evaluation["loss"]),
                               float(jax.jit(each_devices_graphs_loss, static_argnums=2)(ref_params, stacked_graphs(0, DEVICES), 1)),
                               rtol=1e-5)

    with pytest.raises(ValueError, match=r"graph batch .*shardlib.step.batch.per_device\(graphs\)"):  # one global GraphsTuple
        program.step(state, padded_graphs(np.random.default_rng(0)))
    with pytest.raises(ValueError, match=rf"per_device batch 'nodes' has shape \(4, {N_NODE}, 6\).* {DEVICES * grad_accum} "):
        program.step(state, per_device(stacked_graphs(0, 4)))
    hashed = batches[0]._replace(n_edge=batches[0].n_edge.astype(np.int64) + 5_000_000_000)  # int64 ids, as hashed
    with pytest.raises(ValueError, match=r"'n_edge' holds int64 values such as 5000000\d+, which JAX stores as int32"):
        program.step(state, per_device(hashed))


# ---- PPO, as purejaxrl writes it -------------------------------------------------------------

class ActorCritic(nn.Module):
    actions: int = 4

    @nn.compact
    def __call__(self, obs):
        x = nn.tanh(nn.Dense(32, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(obs))
        logits = nn.Dense(self.actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
        return logits, nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)[:, 0]


def trajectories(step: int, rows: int = 32) -> dict[str, np.ndarray]:
    """Advantages whose scale differs along the batch, as rollouts of different envs give."""
    rng = np.random.default_rng(step)
    return {"obs": rng.normal(size=(rows, 5)).astype(np.float32), "actions": rng.integers(0, 4, rows).astype(np.int32),
            "log_probs": np.full(rows, np.log(0.25), np.float32) + 0.1 * rng.normal(size=rows).astype(np.float32),
            "advantages": (1.0 + rng.normal(size=rows) * np.arange(1, rows + 1)).astype(np.float32),
            "returns": rng.normal(size=rows).astype(np.float32)}


def ppo_loss(out, batch, gather=shardlib.gather_batch):
    logits, value = out
    advantages = gather(batch["advantages"])  # the whole batch's statistics, as one device has them
    adv = (batch["advantages"] - advantages.mean()) / (advantages.std() + 1e-8)
    log_probs = jax.nn.log_softmax(logits)
    ratio = jnp.exp(jnp.take_along_axis(log_probs, batch["actions"][:, None], -1)[:, 0] - batch["log_probs"])
    actor = -jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv).mean()
    critic = 0.5 * jnp.mean((value - batch["returns"]) ** 2)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, -1).mean()
    return actor + 0.5 * critic - 0.01 * entropy, {"actor": actor, "critic": critic, "entropy": entropy}


def test_ppo_advantages_normalised_over_the_gathered_batch_train_like_one_device():
    batches = [trajectories(step) for step in range(STEPS)]
    programs = {name: build(model, optimizer(), make_layout(model, "dp", make_mesh({"data": DEVICES})))
                for name, loss in [("gathered", ppo_loss), ("per_device", lambda o, b: ppo_loss(o, b, gather=lambda x: x))]
                for model in [from_linen(ActorCritic(), loss, batches[0], inputs=lambda b, train: ((b["obs"],), {}))]}
    params0 = jax.tree.map(np.asarray, programs["gathered"].init(jax.random.key(0)).params)
    losses = {}
    for name, program in programs.items():
        state, losses[name] = program.init_from(params0), []
        for batch in batches:
            state, metrics = program.step(state, batch)
            losses[name].append(float(metrics["loss"]))

    plain = lambda p, b: ppo_loss(ActorCritic().apply({"params": p}, b["obs"]), b)[0]
    _, ref_losses = zoo.plain_steps(plain, params0, optimizer(), batches)
    np.testing.assert_allclose(losses["gathered"], ref_losses, rtol=1e-5)
    # each device normalising its own rows' advantages is another objective, silently
    assert np.max(np.abs(np.array(losses["per_device"][1:]) - ref_losses[1:])) > 1e-3
