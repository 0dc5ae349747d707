"""The compiled train program: a layout turned into sharded init, train step and eval step,
with precision, gradient accumulation, compression and pipelining as parts of the step."""

from shardlib.step.program import TrainProgram, TrainState, build

__all__ = ["TrainProgram", "TrainState", "build"]
