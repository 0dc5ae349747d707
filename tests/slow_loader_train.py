"""``shardlib train`` with one process's input pipeline made slow: a straggler, for tests/test_elastic.py.

``python tests/slow_loader_train.py INDEX SECONDS train FLAGS...`` runs ``shardlib.cli.main(["train",
FLAGS...])`` in a process whose data loader (`ByteBatches`, process ``INDEX`` of the job only)
sleeps ``SECONDS`` before every batch, as a slow disk or decoder would. The patch lives in this
process alone; shardlib itself has no test hook for it.
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":  # the repository root, so `models` and `shardlib` import without install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardlib import cli  # noqa: E402
from shardlib.runtime.data import ByteBatches  # noqa: E402


def slow_down(index: int, seconds: float) -> None:
    """Process ``index``'s loader sleeps ``seconds`` before each batch (host time inside its step)."""
    batch = ByteBatches.batch

    def slow_batch(self: ByteBatches, step: int):
        if self.process_index == index:
            time.sleep(seconds)
        return batch(self, step)

    ByteBatches.batch = slow_batch


if __name__ == "__main__":
    slow_down(int(sys.argv[1]), float(sys.argv[2]))
    sys.exit(cli.main(sys.argv[3:]))
