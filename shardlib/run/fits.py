"""Refuse a step the devices cannot hold, before it runs out of memory mid-run.

The compiled step's peak (`shardlib.tools.memory.peak_bytes`) is compared with what a device
has (`device_capacity`). A step too large is refused in one line with the largest batch that
fits and the ``--grad-accum`` that keeps the batch; each is found by compiling it, since a
step's memory is not proportional to its batch (a fixed part: parameters, optimizer state,
gradients). ``--force`` starts it anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from shardlib.run.config import TrainConfig, TrainConfigError

_TRIES = 4  # compiles spent looking for what fits, after the one that did not


def check_fits(config: TrainConfig, mem: Any, multiple: int, microbatches: int, pipelined: bool,
               peak_of: Callable[[TrainConfig], int]) -> None:
    """Raise `TrainConfigError` on ``--batch-size`` when the compiled step's peak exceeds a device.

    ``multiple``: the data-parallel devices a batch splits over; ``peak_of(config)``: the peak
    bytes of the step compiled for another batch size or ``--grad-accum``.
    """
    from shardlib.text import format_bytes
    from shardlib.tools.memory import device_capacity, peak_bytes

    capacity = device_capacity()
    peak = peak_bytes(mem)
    if config.force or capacity is None or peak <= capacity[0]:
        return
    limit, what = capacity
    batch = config.batch_size
    largest, exact = _largest_batch(config, batch, peak, limit, multiple * microbatches, peak_of)
    flag = "--microbatches" if pipelined else "--grad-accum"
    accum = None if pipelined else _accumulation(config, batch, largest, limit, multiple, peak_of)
    if largest:
        fix = f"the largest batch that fits is {largest}" if exact else f"a batch of {largest} fits"
        fix += f" (--batch-size {largest})"
        fix += f", or keep {batch} with {flag} {accum}" if accum else ""
    else:
        fix = ("even the smallest batch does not fit: shard the state over more devices (--strategy zero3, a "
               "larger mesh), --offload opt_state, or --precision bf16")
    raise TrainConfigError("batch_size", f"{batch} sequences need {format_bytes(peak)} per device "
                                         f"({format_bytes(mem.temp_bytes)} of temporaries), and the devices have "
                                         f"{format_bytes(limit)} each ({what}): {fix}; --force starts it anyway")


@contextlib.contextmanager
def held_output() -> Iterator[None]:
    """Hold what this process writes to its stderr (file descriptor 2: XLA's own C++ log too) while
    the step compiles, and let it out after, unless the step is refused: compiling a batch of
    100,000 rows makes XLA log its slow constant folding over several lines, which would bury the
    one-line refusal."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 to hold
        yield
        return
    refused = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except TrainConfigError:
            refused = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not refused:
                held.seek(0)
                os.write(2, held.read())


def _largest_batch(config: TrainConfig, batch: int, peak: int, limit: int, step: int,
                   peak_of: Callable[[TrainConfig], int]) -> tuple[int, bool]:
    """(the largest multiple of ``step`` below ``batch`` whose step fits (0: none), whether the next
    multiple up was seen not to fit), by secant steps on the compiled peaks, each guess compiled."""
    smallest = step
    low_peak = peak_of(dataclasses.replace(config, batch_size=smallest))
    if low_peak > limit:
        return 0, True
    fits, high, high_peak = smallest, batch, peak
    for _ in range(_TRIES):
        per_row = (high_peak - low_peak) / max(high - fits, 1)
        ahead = int((limit - low_peak) / per_row) // step * step if per_row > 0 else high
        guess = min(high - step, fits + max(step, ahead))  # at least one step up: settles "largest"
        guess_peak = peak_of(dataclasses.replace(config, batch_size=guess))
        if guess_peak <= limit:
            fits, low_peak = guess, guess_peak
        else:
            high, high_peak = guess, guess_peak
        if high - fits <= step:
            break
    return fits, high - fits <= step


def _accumulation(config: TrainConfig, batch: int, largest: int, limit: int, multiple: int,
                  peak_of: Callable[[TrainConfig], int]) -> int | None:
    """The fewest microbatches (``--grad-accum``) that keep ``batch`` and fit, or None."""
    if not largest:
        return None
    tries = 0
    for k in range(max(config.grad_accum + 1, -(-batch // largest)), batch // multiple + 1):
        if batch % (k * multiple):
            continue
        if peak_of(dataclasses.replace(config, grad_accum=k)) <= limit:
            return k
        tries += 1
        if tries == _TRIES:
            return None
    return None
