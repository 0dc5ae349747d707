"""The compiled train program: a layout turned into sharded init, train step and eval step.

`program.build` wires the parts, one module each: `compute` (how the model is called on one
device), `grads` (plain, accumulated or pipelined loss and gradients), `reduce` (gradients into
the optimizer-state layout, compressed or not), `update` (the optax update and the non-finite
skip) and `state` (the train state, its shardings and init); `precision` and `compression` are
the policies they receive.
"""

from shardlib.step.program import TrainProgram, TrainState, build

__all__ = ["TrainProgram", "TrainState", "build"]
