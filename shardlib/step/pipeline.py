"""Pipeline parallelism over the ``pipe`` mesh axis: GPipe and 1F1B schedules as data.

The layer stack (leading logical axis ``"layers"``) is split into S contiguous stages along the
``pipe`` axis, so each stage stores and updates only its own layers. The global batch of each
data-parallel device is cut into M microbatches that stream through the stages; activations
move forward and cotangents backward with ``ppermute`` (collective-permutes of one microbatch's
residual stream). The embedding and the head are replicated over ``pipe``: the first stage
embeds, the last one computes the head and the loss, and their gradients are summed over
``pipe`` once per step. With ``branch=True`` the other stages skip that work (a ``lax.cond`` on
the stage index); that is only safe when the embedding and the head need no collective (no
ZeRO-3 gather, no tensor parallelism): XLA:CPU was seen to deadlock on a ZeRO-3 step whose
all-gathers sat inside such a branch, taken by one stage and not the other. Otherwise every
stage computes them and keeps the result only where it applies.

Everything runs in lockstep *ticks*. In one tick every stage may run one forward (microbatch
``f_t - s`` on stage ``s``) and one backward (microbatch ``b_t - (S - 1 - s)``), then pass its
output one stage on. A schedule is a list of phases, each a run of ticks that do forwards,
backwards or both:

  gpipe   all M forwards, then all M backwards; keeps the inputs of all M microbatches
  1f1b    S - 1 forwards, then M ticks of one forward + one backward, then S - 1 backwards;
          keeps at most 2S - 1 microbatch inputs per stage, however large M grows

Both take (M + S - 1) forward and backward ticks, so their bubble is (S - 1) / (M + S - 1).
A stage keeps only its inputs and recomputes its forward for the backward pass (stage-level
rematerialisation), which is what bounds 1F1B's activation memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from shardlib.model import Stages
from shardlib.sharding.strategies import PIPE_AXIS
from shardlib.registry import lookup


@dataclasses.dataclass(frozen=True)
class Phase:
    """``ticks`` lockstep ticks; forwards enter stage 0 from microbatch ``forward_from`` on, and
    backwards leave the last stage from microbatch ``backward_from`` on (None: no such work)."""

    ticks: int
    forward_from: int | None
    backward_from: int | None


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    phases: Callable[[int, int], tuple[Phase, ...]]  # (stages, microbatches) -> phases
    kept_inputs: Callable[[int, int], int]  # (stages, microbatches) -> microbatch inputs a stage keeps
    kept_cotangents: Callable[[int, int], int]  # output cotangents the last stage keeps until their backward
    summary: str


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("gpipe", lambda S, M: (Phase(M + S - 1, 0, None), Phase(M + S - 1, None, 0)),
                 lambda S, M: M, lambda S, M: M, "all forwards, then all backwards (activations of M microbatches)"),
        # The last stage runs a microbatch's backward in the tick of its forward: one cotangent.
        Schedule("1f1b", lambda S, M: (Phase(S - 1, 0, None), Phase(M, S - 1, 0), Phase(S - 1, None, M)),
                 lambda S, M: min(M, 2 * S - 1), lambda S, M: 1,
                 "one forward, one backward (activations of <= 2S-1 microbatches)"),
    )
}


def get_schedule(name: str | Schedule) -> Schedule:
    """The named preset, or the object itself; an unknown name lists the known ones."""
    return lookup(SCHEDULES, name, Schedule, "pipeline schedule")


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a stage's time under GPipe or 1F1B: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class _Cut:
    """One device's view of the pipeline: its slice of the stack, the replicated rest, its
    microbatches, and the model's three pieces as functions of what each differentiates."""

    stages: Stages
    stack: Any
    rest: Any
    micro: dict[str, jax.Array]  # [M, rows / M, ...] per batch entry
    active: jax.Array | None = None  # uneven stages: which slots of the padded stack hold a layer here
    branch: bool = False  # padded slots skipped in a lax.cond (else computed and discarded)

    def rows(self, i: jax.Array) -> dict[str, jax.Array]:
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), self.micro)

    def embed(self, rest: Any, rows: Any) -> jax.Array:
        return self.stages.embed({**rest, self.stages.stacked: self.stack}, rows)

    def stage(self, stack: Any, x: jax.Array) -> jax.Array:
        run = lambda layers, x: self.stages.stage({**self.rest, self.stages.stacked: layers}, x)
        if self.active is None:
            return run(stack, x)

        def slot(x, layer_and_active):  # one layer of the padded stack; a padded slot passes x on
            layer, active = layer_and_active
            one = jax.tree.map(lambda a: a[None], layer)
            return _when(active, lambda: run(one, x), lambda: x, self.branch), None

        return jax.lax.scan(slot, x, (stack, self.active))[0]

    def head_loss(self, rest: Any, x: jax.Array, rows: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self.stages.head_loss({**rest, self.stages.stacked: self.stack}, x, rows)


def _cut(stages: Stages, params: Mapping[str, Any], batch: Mapping[str, jax.Array], m: int) -> _Cut:
    if stages.stacked not in params:
        raise ValueError(f"the pipeline's layer stack {stages.stacked!r} is not a top-level parameter entry ({', '.join(params)})")
    rest = {k: v for k, v in params.items() if k != stages.stacked}
    micro = {k: x.reshape(m, x.shape[0] // m, *x.shape[1:]) for k, x in batch.items()}
    return _Cut(stages, params[stages.stacked], rest, micro)


def _shift(x: jax.Array, stages: int, direction: int) -> jax.Array:
    """Send ``x`` one stage down (+1) or up (-1) the pipe; the end stage receives zeros."""
    pairs = [(i, i + direction) for i in range(stages) if 0 <= i + direction < stages]
    return jax.lax.ppermute(x, PIPE_AXIS, pairs)


def _zero_outputs(cut: _Cut) -> tuple[Any, Any, Any]:
    """Zeros like the residual stream, the loss and the aux metrics (traced, not evaluated:
    they carry the same varying-over-axes type as the real values; XLA drops the probes)."""
    rows = cut.rows(0)
    x = cut.embed(cut.rest, rows)
    loss, aux = cut.head_loss(cut.rest, x, rows)
    zeros = lambda v: _vary(jnp.zeros_like(v, jnp.float32 if v is loss else None))
    return zeros(x), zeros(loss), jax.tree.map(zeros, aux)


def _vary(x: jax.Array) -> jax.Array:
    """``x`` typed as varying over ``pipe`` (each stage's copy of a carry is its own)."""
    return x if PIPE_AXIS in jax.typeof(x).manual_axis_type.varying else jax.lax.pcast(x, (PIPE_AXIS,), to="varying")


def _when(pred: jax.Array, fn: Callable, otherwise: Callable, branch: bool) -> Any:
    """``fn()`` where ``pred`` holds, else ``otherwise()``: a ``lax.cond`` when ``branch`` (the work
    is skipped), else both computed and selected (``fn`` may then hold collectives)."""
    if branch:
        return jax.lax.cond(pred, fn, otherwise)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), fn(), otherwise())


def _add(total: Any, value: Any) -> Any:
    return jax.tree.map(jnp.add, total, value)


def _tick_gradient(value: Any) -> Any:
    """A tick's gradient, behind an optimization barrier before it joins the carried sum.

    Under ZeRO-3 a gradient leaves the tick as autodiff's reduce-scatter of the gathered weight's
    cotangent. When the weights are cast to a lower compute dtype before the gather (bf16 on
    TPU / GPU), that is reduce-scatter(bf16) -> convert(f32) -> select(keep, ., 0) -> add into
    the float32 carry. XLA's WhileLoopAllReduceCodeMotion accepts that chain as movable but, when
    it rewrites the loop, expects the reduce-scatter's user to be the select or the add, not the
    convert: XLA:TPU stops with ``RET_CHECK ... user->opcode() == HloOpcode::kAdd``
    (while_loop_all_reduce_code_motion.cc; jaxlib 0.10.2 / libtpu 0.0.42). The barrier is a user
    the pass does not look through, so each tick's reduce-scatter stays in the tick (as
    docs/pipeline.md describes ZeRO-3's per-microbatch reduce-scatter) and the values, an
    identity, are unchanged."""
    return jax.lax.optimization_barrier(value)


def _masked_add(total: Any, value: Any, keep: jax.Array) -> Any:
    return jax.tree.map(lambda t, v: t + jnp.where(keep, v, jnp.zeros_like(v)), total, value)


def _slot(buffer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buffer, i % buffer.shape[0], keepdims=False)


def _store(buffer: jax.Array, i: jax.Array, value: jax.Array, keep: jax.Array) -> jax.Array:
    value = jnp.where(keep, value, _slot(buffer, i))
    return jax.lax.dynamic_update_index_in_dim(buffer, value, i % buffer.shape[0], 0)


@dataclasses.dataclass(frozen=True)
class _Ticks:
    """One stage's work in a tick of a training schedule, as functions of the carry (what travels
    from tick to tick: the shifted activations and cotangents, kept inputs, gradient sums)."""

    cut: _Cut
    n_stages: int
    microbatches: int
    stage_index: jax.Array
    first: jax.Array  # this is the first stage
    last: jax.Array  # this is the last stage
    zero_loss: jax.Array
    zero_aux: Any
    weight: jax.Array  # the cotangent of each microbatch loss: seed * loss_weight
    loss_weight: float
    branch: bool

    def forward(self, c: dict[str, Any], f_t: jax.Array) -> dict[str, Any]:
        """Microbatch ``f_t - s`` through stage s; the last stage also runs the head's forward and backward."""
        cut, rest, S, M = self.cut, self.cut.rest, self.n_stages, self.microbatches
        f = f_t - self.stage_index
        valid = (f >= 0) & (f < M)
        f = jnp.clip(f, 0, M - 1)
        rows = cut.rows(f)
        x = _when(self.first, lambda: cut.embed(rest, rows), lambda: c["fwd_in"], self.branch)
        y = cut.stage(cut.stack, x)
        at_loss = valid & self.last

        def head_grads():
            (loss, aux), head_vjp = jax.vjp(lambda r, y: cut.head_loss(r, y, rows), rest, y)
            return (loss, aux, *head_vjp((jnp.ones_like(loss) * self.weight, jax.tree.map(jnp.zeros_like, aux))))

        # Only the last stage's real microbatches use the head (as large as several layers for a
        # big vocabulary): a branch where it is safe, else computed everywhere and selected.
        loss, aux, g_rest, dy = _when(
            at_loss, head_grads,
            lambda: (self.zero_loss, self.zero_aux, jax.tree.map(jnp.zeros_like, rest), jnp.zeros_like(y)), self.branch)
        return dict(
            c, fwd_in=_shift(y, S, +1),
            inputs=_store(c["inputs"], f, x, valid),
            cotangents=_store(c["cotangents"], f, dy.astype(x.dtype), at_loss),
            grad_rest=_add(c["grad_rest"], _tick_gradient(g_rest)),  # zeros off the last stage's real microbatches
            loss=c["loss"] + loss * self.loss_weight,
            aux=_add(c["aux"], jax.tree.map(lambda a: a * self.loss_weight, aux)),
        )

    def backward(self, c: dict[str, Any], b_t: jax.Array) -> dict[str, Any]:
        """Microbatch ``b_t - (S - 1 - s)`` back through stage s (recomputing its forward); the
        first stage also runs the embedding's backward."""
        cut, rest, S, M = self.cut, self.cut.rest, self.n_stages, self.microbatches
        b = b_t - (S - 1 - self.stage_index)
        valid = (b >= 0) & (b < M)
        b = jnp.clip(b, 0, M - 1)
        x = _slot(c["inputs"], b)
        cotangent = jnp.where(self.last, _slot(c["cotangents"], b), c["bwd_in"])
        _, stage_vjp = jax.vjp(cut.stage, cut.stack, x)
        g_stack, dx = stage_vjp(cotangent)
        rows = cut.rows(b)

        def embed_grads():
            return jax.vjp(lambda r: cut.embed(r, rows), rest)[1](dx)[0]

        g_embed = _when(valid & self.first, embed_grads, lambda: jax.tree.map(jnp.zeros_like, rest), self.branch)
        return dict(
            c, bwd_in=_shift(dx, S, -1),
            grad_stack=_masked_add(c["grad_stack"], _tick_gradient(g_stack), valid),
            grad_rest=_add(c["grad_rest"], _tick_gradient(g_embed)),  # zeros off the first stage's real microbatches
        )

    def tick(self, phase: Phase, c: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
        if phase.forward_from is not None:
            c = self.forward(c, phase.forward_from + t)
        if phase.backward_from is not None:
            c = self.backward(c, phase.backward_from + t)
        return c, None


def _initial_carry(cut: _Cut, schedule: Schedule, S: int, M: int, zeros: tuple[Any, Any, Any]) -> dict[str, Any]:
    zeros_x, zero_loss, zero_aux = zeros
    return dict(
        fwd_in=zeros_x, bwd_in=zeros_x,
        inputs=jnp.stack([zeros_x] * schedule.kept_inputs(S, M)),  # stage inputs kept for the backward
        cotangents=jnp.stack([zeros_x] * schedule.kept_cotangents(S, M)),  # last stage: d loss / d its output
        grad_stack=jax.tree.map(jnp.zeros_like, cut.stack), grad_rest=jax.tree.map(jnp.zeros_like, cut.rest),
        loss=zero_loss, aux=zero_aux,
    )


def _compute_stack(stack: Any, split: tuple[int, ...], stage_index: jax.Array) -> Any:
    """This stage's compute layers, padded to ``max(split)`` slots, from the even storage split:
    layers stored on another stage arrive by ``ppermute``, one collective per (slot, distance);
    autodiff's transpose sends their gradients back. Padded slots hold zeros."""
    S, stored = len(split), jax.tree.leaves(stack)[0].shape[0]
    starts = [sum(split[:s]) for s in range(S)]
    slots = []
    for j in range(max(split)):
        by_distance: dict[int, list[tuple[int, int, int]]] = {}  # source - target -> (source, target, offset)
        for s in range(S):
            if j < split[s]:
                layer = starts[s] + j
                by_distance.setdefault(layer // stored - s, []).append((layer // stored, s, layer % stored))
        slot = jax.tree.map(lambda a: jnp.zeros_like(a[0]), stack)
        for distance, moves in by_distance.items():
            offsets = [0] * S
            for source, _, offset in moves:
                offsets[source] = offset
            row = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.asarray(offsets)[stage_index], keepdims=False), stack)
            if distance:
                row = jax.lax.ppermute(row, PIPE_AXIS, [(source, target) for source, target, _ in moves])
            here = jnp.isin(stage_index, jnp.asarray([target for _, target, _ in moves]))
            slot = jax.tree.map(lambda new, old: jnp.where(here, new, old), row, slot)
        slots.append(slot)
    return jax.tree.map(lambda *rows: jnp.stack(rows), *slots)


def _uneven(cut: _Cut, split: tuple[int, ...] | None, stage_index: jax.Array, branch: bool):
    """(cut with this stage's padded compute stack, its transpose back to storage); the cut
    unchanged and None when the split is the even one the storage already holds."""
    if split is None or len(set(split)) == 1:
        return cut, None
    stack, to_storage = jax.vjp(lambda st: _compute_stack(st, split, stage_index), cut.stack)
    active = jnp.arange(max(split)) < jnp.asarray(split)[stage_index]
    return dataclasses.replace(cut, stack=stack, active=active, branch=branch), to_storage


@dataclasses.dataclass(frozen=True)
class Rows:
    """How one device's rows run through the stages: ``n_stages`` S and ``microbatches`` M; each
    microbatch's loss counts ``loss_weight``; ``branch``: skip the embedding / head on the stages
    that do not use them (only when they hold no collective)."""

    n_stages: int
    microbatches: int
    loss_weight: float = 1.0
    branch: bool = False
    stage_layers: tuple[int, ...] | None = None  # layers each stage computes (None: the even split)


def value_and_grad(stages: Stages, params: Mapping[str, Any], batch: Mapping[str, jax.Array], rows: Rows, *,
                   schedule: str | Schedule = "1f1b",
                   seed: jax.Array | float = 1.0) -> tuple[tuple[jax.Array, dict[str, jax.Array]], Any]:
    """Pipelined loss and gradients of this device's rows; call inside ``shard_map`` with ``pipe`` manual.

    ``params`` holds this stage's slice of the layer stack and the full embedding / head.
    Returns ((loss, aux), grads): ``loss_weight`` times the sum of the microbatch losses (the
    same on every stage), and the gradient of ``seed * loss`` (``seed``: a loss scale); the
    stack's gradients are this stage's, the others' already summed over ``pipe``.
    """
    schedule = get_schedule(schedule)
    S, M, loss_weight, branch = rows.n_stages, rows.microbatches, rows.loss_weight, rows.branch
    cut = _cut(stages, params, batch, M)
    stage_index = jax.lax.axis_index(PIPE_AXIS)
    cut, to_storage = _uneven(cut, rows.stage_layers, stage_index, branch)
    first, last = stage_index == 0, stage_index == S - 1
    zeros = _zero_outputs(cut)
    carry = _initial_carry(cut, schedule, S, M, zeros)
    ticks = _Ticks(cut, S, M, stage_index, first, last, zeros[1], zeros[2],
                   jnp.asarray(seed, jnp.float32) * loss_weight, loss_weight, branch)
    for phase in schedule.phases(S, M):
        if phase.ticks:
            carry, _ = jax.lax.scan(functools.partial(ticks.tick, phase), carry, jnp.arange(phase.ticks))

    # Only the first / last stage holds the embedding's / head's gradient and the loss: share them.
    grad_rest, loss, aux = jax.lax.psum((carry["grad_rest"], carry["loss"], carry["aux"]), PIPE_AXIS)
    grad_stack = carry["grad_stack"] if to_storage is None else to_storage(carry["grad_stack"])[0]
    grads = {**grad_rest, stages.stacked: grad_stack}
    return (loss, aux), {k: grads[k] for k in params}


def loss(stages: Stages, params: Mapping[str, Any], batch: Mapping[str, jax.Array],
         rows: Rows) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Forward-only pipelined loss (evaluation): M + S - 1 forward ticks, nothing kept."""
    S, M, loss_weight, branch = rows.n_stages, rows.microbatches, rows.loss_weight, rows.branch
    cut = _cut(stages, params, batch, M)
    cut = dataclasses.replace(cut, rest=jax.tree.map(_vary, cut.rest))  # each stage's copy is its own
    stage_index = jax.lax.axis_index(PIPE_AXIS)
    cut, _ = _uneven(cut, rows.stage_layers, stage_index, branch)
    zeros_x, zero_loss, zero_aux = _zero_outputs(cut)

    def tick(c, t):
        fwd_in, total, aux_total = c
        f = t - stage_index
        at_loss = (f >= 0) & (f < M) & (stage_index == S - 1)
        rows = cut.rows(jnp.clip(f, 0, M - 1))
        x = _when(stage_index == 0, lambda: cut.embed(cut.rest, rows), lambda: fwd_in, branch)
        y = cut.stage(cut.stack, x)
        loss, aux = _when(at_loss, lambda: cut.head_loss(cut.rest, y, rows), lambda: (zero_loss, zero_aux), branch)
        total = total + loss * loss_weight
        aux_total = _add(aux_total, jax.tree.map(lambda a: a * loss_weight, aux))
        return (_shift(y, S, +1), total, aux_total), None

    (_, total, aux_total), _ = jax.lax.scan(tick, (zeros_x, zero_loss, zero_aux), jnp.arange(M + S - 1))
    return jax.lax.psum((total, aux_total), PIPE_AXIS)
