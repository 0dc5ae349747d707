"""The errors a checkpoint raises, one class per thing the caller does about it.

`shardlib.runtime.checkpoint` re-exports them: that is where users import them from.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the directory and the fix."""

    user_facing = True


class CheckpointNotFoundError(CheckpointError):
    """The directory, or the requested step in it, holds no complete checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tree (paths, shapes, dtypes) differs from the restore target."""


class NonFiniteStateError(CheckpointError):
    """A state with NaN or Inf values, which must never replace a good checkpoint."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files are missing, unreadable, or differ from the digests saved with it.

    ``reason`` is one word (``incomplete``, ``missing-file``, ``unreadable``, ``metadata``,
    ``data-step``, ``digest``); the message names the step, the file or tensor, and why.
    """

    def __init__(self, directory: str, step: int, reason: str, detail: str) -> None:
        self.directory, self.step, self.reason, self.detail = directory, int(step), reason, detail
        super().__init__(f"checkpoint {directory} step {step} is damaged ({reason}): {detail}")


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read for a reason its bytes do not show (storage outage,
    permissions, credentials, an error about the restore target): nothing is set aside."""

    def __init__(self, directory: str, step: int, detail: str) -> None:
        self.directory, self.step, self.detail = directory, int(step), detail
        super().__init__(f"checkpoint {directory} step {step} could not be read ({detail}); this says nothing about "
                         "its files, so nothing was set aside: fix the cause (storage, permissions, credentials) and "
                         "run again")


class CheckpointSaveError(CheckpointError):
    """A background (async) save failed: the run must stop; the last good checkpoint is named."""
