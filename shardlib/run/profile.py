"""``--profile START:STOP``: a `jax.profiler` trace of those steps, written to ``OUT/profile``.

TensorBoard's profile plugin reads it (``tensorboard --logdir OUT``), Perfetto its
``trace.json.gz``; docs/cli.md says how to read it for communication that compute does not hide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ProfileSteps:
    """After-step action: starts the trace before step START is dispatched and stops it once step
    STOP has finished (the trace holds its device work), on process 0."""

    def __init__(self, spec: str | None, out_dir: Path, first: int, *, enabled: bool) -> None:
        start, stop = (int(x) for x in spec.split(":")) if spec else (0, -1)
        self.start, self.stop, self.directory = start, stop, out_dir / "profile"
        self.enabled = enabled and spec is not None and stop > first
        self.tracing = False
        if self.enabled and start <= first + 1:  # resumed inside (or at the start of) the range
            self._begin()

    def _begin(self) -> None:
        import jax

        jax.profiler.start_trace(str(self.directory))
        self.tracing = True

    def __call__(self, step: int, state: Any, metrics: Any) -> None:
        if not self.enabled:
            return
        if step == self.start - 1 and not self.tracing:
            self._begin()
        elif step == self.stop and self.tracing:
            import jax

            jax.block_until_ready(state)
            self.close()
            print(f"profile    steps {self.start}-{self.stop}: {self.directory} (tensorboard --logdir "
                  f"{self.directory.parent}, Profile tab; or its trace.json.gz in Perfetto)", flush=True)

    def close(self) -> None:
        if self.tracing:
            import jax

            jax.profiler.stop_trace()
            self.tracing = False
