"""The run's checkpoints: where they live, whether a run resumes from them, and the save action.

`shardlib.runtime.checkpoint` does the saving and restoring; this module only decides which
directory a run uses and when a step is saved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shardlib.run.config import TrainConfig, TrainConfigError
from shardlib.runtime.files import make_dir


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """``RUN/checkpoints`` for a run directory; a path already named ``checkpoints`` as is."""
    path = Path(path).expanduser().absolute()
    return path if path.name == "checkpoints" else path / "checkpoints"


def open_checkpointer(config: TrainConfig, out_dir: Path):
    """(the run's Checkpointer, whether to resume from it); (None, False) when not checkpointing.

    Saves go to ``OUT/checkpoints``; a resumed run keeps saving where it resumed from. A run
    that saves into a directory already holding a complete checkpoint resumes from the latest
    one, so a job restarted with the same command after a crash or preemption continues.
    """
    directory = saves_to(config, out_dir)
    if directory is None:
        return None, False
    from shardlib.runtime import checkpoint

    if config.resume_from is not None and not directory.is_dir():
        raise TrainConfigError("resume_from", f"no checkpoints at {directory}; pass the --out directory of a run "
                                              "that saved some (not --ckpt-every 0)")
    if config.resume_from is None:  # created as a real directory: a planted link is refused, never filled
        make_dir(directory, "a run's checkpoints")
    ckpt = checkpoint.Checkpointer(directory, every=config.ckpt_every or 0, keep=config.keep)
    return ckpt, config.resume_from is not None or ckpt.latest_step() is not None


def refuse_silent_restart(config: TrainConfig, out_dir: Path) -> None:
    """Refuse, before anything compiles, a run that would start over at step 0 in an ``--out``
    holding an earlier run: beside its checkpoints (a run that does not checkpoint), or over its
    history (metrics, checkpoints it cannot resume from) with nothing to resume, unless ``--fresh``
    says so on purpose. ``--fresh`` beside a checkpoint that resumes is refused too."""
    if config.resume_from is not None or config.out is None:
        return
    from shardlib.runtime.elastic import latest_checkpoint, restart_from_env

    step = latest_checkpoint(out_dir) if (out_dir / "checkpoints").is_dir() else None  # no Orbax load without one
    if step is not None and (config.fresh or config.ckpt_every == 0):
        why = "--fresh would train from step 0" if config.fresh else "this run does not checkpoint, so it would start over"
        raise TrainConfigError("fresh" if config.fresh else "out",
                               f"{out_dir} already holds a run checkpointed at step {step}, and {why} beside it; "
                               + ("" if config.fresh else "drop --ckpt-every 0 to resume that run, or ") + "pick another --out")
    if step is not None or config.fresh or restart_from_env() is not None:  # an elastic restart starts over on purpose
        return
    history = run_history(out_dir)
    if history:
        raise TrainConfigError("out", f"{out_dir} holds an earlier run ({'; '.join(history)}) and no checkpoint to resume "
                                      "from, so this run would start over at step 0 over it; pass --fresh to start "
                                      "afresh on purpose (the old metrics.jsonl is moved aside), or pick another --out")


def run_history(out_dir: Path) -> list[str]:
    """What in ``out_dir`` shows that a run trained there: its metrics, and step directories that
    are not complete checkpoints (damaged, incomplete, interrupted saves)."""
    found = []
    if (out_dir / "metrics.jsonl").exists():
        found.append("metrics.jsonl")
    ckpt_dir = out_dir / "checkpoints"
    steps = sorted(p.name for p in ckpt_dir.iterdir() if p.name[:1].isdigit()) if ckpt_dir.is_dir() else []
    if steps:
        from shardlib.sharding.rules import listed

        found.append(f"checkpoints it cannot resume from: {listed(steps, limit=4)}")
    return found


def keep_schedule(config: TrainConfig, out_dir: Path) -> tuple[TrainConfig, str | None, bool]:
    """A run resumed with another ``--steps`` keeps the lr schedule it started with (re-planned over
    the new count, the rate would jump at the resumed step: 0.00038 to 0.0019): the config that
    does, the note to print once it has resumed, and whether it resumes."""
    import dataclasses

    ckpt, resume = open_checkpointer(config, out_dir)
    if ckpt is None:
        return config, None, False
    try:
        resumes = resume and ckpt.latest_step() is not None
        saved = ckpt.saved_config() if resumes and config.schedule_steps is None else {}
    finally:
        ckpt.close()
    planned = saved.get("schedule_steps") or saved.get("steps")
    if planned is None or planned == config.steps:
        return config, None, resumes
    note = (f"shardlib: note: the lr schedule stays the one this run started with, planned over {planned} steps "
            f"(after step {planned}: {config.lr * config.min_lr_ratio:g}, its final rate); --schedule-steps "
            f"{config.steps} re-plans it over the new count")
    return dataclasses.replace(config, schedule_steps=planned), note, resumes


def model_mismatch(config: TrainConfig, ckpt: Any, target: Any, err: Exception) -> Exception:
    """The error for a checkpoint that does not fit this run: when it was saved by another ``--model``,
    one sentence naming both and the two fixes, then the first few tensors that differ."""
    saved_config = ckpt.saved_config()
    saved, pretrained = saved_config.get("model"), saved_config.get("pretrained")
    from shardlib.runtime.checkpoint_contents import signature_mismatches, tree_signature
    from shardlib.sharding.rules import listed

    diff = signature_mismatches(ckpt.saved_signature(), tree_signature(target))
    if isinstance(pretrained, dict) and config.init_from is None:  # started from a Hugging Face model
        return TrainConfigError("init_from", f"checkpoint is a fine-tune of {pretrained.get('source')} "
                                             f"({pretrained.get('architecture')}): pass --init-from with that "
                                             "directory to resume it (its checkpoint, not the directory's weights, "
                                             f"is restored). ({len(diff)} tensors differ: {listed(diff, limit=3, sep='; ')})")
    if saved is None or saved == config.model:
        return err
    return TrainConfigError("model", f"checkpoint is model {saved!r}, this run is {config.model!r}: pass --model "
                                     f"{saved} to resume it, or a new --out to start another run. "
                                     f"({len(diff)} tensors differ: {listed(diff, limit=3, sep='; ')})")


def saves_to(config: TrainConfig, out_dir: Path) -> Path | None:
    """Where the run's checkpoints go (``OUT/checkpoints``, or the run resumed from); None when off."""
    if config.ckpt_every == 0 and config.resume_from is None:
        return None
    return out_dir.absolute() / "checkpoints" if config.resume_from is None else checkpoint_dir(config.resume_from)


def resume_hint(config: TrainConfig, out_dir: Path) -> str:
    """How to continue a stopped run: the same command resumes only if it names the same run folder."""
    if config.out is not None or config.resume_from is not None:
        return "run the same command again to resume"
    return f"to resume, run the same command with --out {out_dir}"


class SaveCheckpoint:
    """Action on a dispatched step: save the state after ``step`` updates and where the data resumes.

    ``due(step)`` says when (``--ckpt-every`` and the last step); `save` is also what a
    preempted run calls off that schedule. ``saved`` is the last step a save was asked for.
    ``close`` lets a save in flight commit, also when the run stops on an error. Every step
    first checks that no background save failed (`Checkpointer.check`): one that did stops the
    run with `CheckpointSaveError`, naming the last good checkpoint.
    """

    def __init__(self, ckpt: Any, due: Callable[[int], bool], *, seed: int, config: Mapping[str, Any],
                 data_state: Callable[[int], Any] | None = None) -> None:
        self.ckpt, self.due, self.seed, self.config = ckpt, due, seed, config
        self.data_state = data_state  # step -> the loader's state after that many batches (a Grain pipeline's)
        self.saved: int | None = None

    def __call__(self, step: int, state: Any, metrics: Mapping[str, Any]) -> None:
        self.ckpt.check()  # a background save that failed stops the run at the next step, naming the last good one
        if self.due(step):
            self.save(step, state, metrics)

    def save(self, step: int, state: Any, metrics: Mapping[str, Any]) -> None:
        from shardlib.runtime.data import LoaderState

        data_state = LoaderState(step=step, seed=self.seed) if self.data_state is None else self.data_state(step)
        self.ckpt.save(step, state, data_state=data_state, config=self.config, metrics=metrics, force=True)
        self.saved = step

    def close(self) -> None:
        try:
            self.ckpt.wait()
        finally:
            self.ckpt.close()
