"""Collective axis names written into model code, pmap style (`nn.BatchNorm(axis_name="batch")`,
`jax.lax.pmean(x, "batch")`), inside a step whose collectives run over shardlib's mesh axes.

The step's manual axes are mesh axes (`data`, `fsdp`), so a name from the pmap era is unbound
there and JAX fails deep inside a collective (a bare ``AssertionError`` or ``NameError``). This
module says which module and axis, and binds a linen module's own ``axis_name`` to the step's
batch axes when the user asks (`build(..., axis_name="batch")`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from shardlib.model import hooks

# JAX frames of a collective (psum, pmean, all_gather, ...) hold the axis names in this local.
_COLLECTIVE_FILE = "jax/_src/lax/parallel.py"


class UnboundAxisError(ValueError):
    """A collective in the model runs over an axis name the step does not bind; chained to JAX's
    own error (often a bare ``AssertionError`` from inside flax or the collective)."""


def _frames(tb: types.TracebackType | None) -> Iterator[types.FrameType]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _as_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def unbound_axis(err: BaseException, bound: tuple[str, ...]) -> tuple[str, str | None] | None:
    """(axis, module) when ``err`` was raised inside a collective over an axis not in ``bound``:
    the unbound name and the innermost Flax module on the way (its path, or None)."""
    module = None
    for frame in _frames(err.__traceback__):
        owner = frame.f_locals.get("self")
        if _is_flax_module(owner):
            module = _module_name(owner)
        if frame.f_code.co_filename.replace("\\", "/").endswith(_COLLECTIVE_FILE) and "axis_name" in frame.f_locals:
            names = [a for a in _as_names(frame.f_locals["axis_name"]) if a not in bound]
            if names:
                return str(names[0]), module
    return None


def _is_flax_module(obj) -> bool:
    from flax import linen as nn, nnx

    return isinstance(obj, (nn.Module, nnx.Module))


def _module_name(module) -> str:
    """A linen module's path in its tree (``ResNetBlock_0/BatchNorm_1``), else its class."""
    path = getattr(getattr(module, "scope", None), "path", None)
    name = "/".join(path) if path else ""
    return f"{type(module).__name__} {name!r}" if name else type(module).__name__


def raise_unbound_axis(err: BaseException, bound: tuple[str, ...], alias: str | None, *,
                       step: str = "build") -> None:
    """Raise `UnboundAxisError`, chained to ``err``, saying which collective axis name the model
    used that the step does not bind and what to write instead; return for errors raised
    elsewhere. ``step``: "build" (the mesh step) or "pmap_step" (whose one axis the user names)."""
    found = unbound_axis(err, bound)
    if found is None:
        return
    axis, module = found
    where = f"in {module}" if module else "in the model or its loss"
    batch = ", ".join(repr(a) for a in bound) or "none: one device"
    if step == "pmap_step":
        raise UnboundAxisError(f"a collective {where} runs over axis {axis!r}, but pmap_step binds {batch}: "
                               f"write pmap_step(model, tx, axis_name={axis!r})") from err
    bind = (f"; build(..., axis_name={axis!r}) binds the axis_name of linen and NNX modules, not "
            "that of a lax collective you call" if alias == axis else
            f"; for a linen module's own axis_name (nn.BatchNorm(axis_name={axis!r}), the Flax ImageNet example), "
            f"build(..., axis_name={axis!r}) binds it to those axes (synchronised statistics)")
    raise UnboundAxisError(
        f"a collective {where} runs over axis {axis!r}, which is not bound inside the step: its "
        f"batch axes are the mesh axes {batch} (what shardlib.batch_axis_names(mesh) returns). Pass "
        f"axis_name=shardlib.batch_axis_names(mesh) to the module instead of {axis!r}{bind}. A pmean of the "
        "loss or metrics over the batch is not needed: the step averages the loss and aux metrics over the "
        "global batch, so drop it; an all_gather of per-example embeddings for a loss over the whole batch "
        "(CLIP / SigLIP logits) is shardlib.gather_batch(x), which is the identity on one device") from err


@contextlib.contextmanager
def bound_axis_name(alias: str | None, axes: tuple[str, ...]):
    """While the model runs: every linen module (and NNX module, `hooks.rebind_axis_name`) whose ``axis_name``
    is ``alias`` computes its collectives over ``axes`` (the step's active batch axes; None on one
    device, no collective)."""
    if alias is None:
        yield
        return
    from flax import linen as nn

    target = axes or None

    def rebind(next_fun, args, kwargs, context):
        module = context.module
        if getattr(module, "axis_name", None) != alias:
            return next_fun(*args, **kwargs)
        object.__setattr__(module, "axis_name", target)  # linen modules are frozen; restored below
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "axis_name", alias)

    with nn.intercept_methods(rebind), hooks.axis_binding(alias, axes):
        yield
