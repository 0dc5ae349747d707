"""What `shardlib train` may write in ``--out``, checked under the run's lock before any work.

Every name a run writes in its directory is listed here once (`RUN_OUTPUTS`): a symbolic link
planted at any of them is refused in one line before anything compiles (its target is never
written, truncated or rotated). An ``--out`` that is, or holds, the ``--init-from`` or
``--tokenizer`` directory is refused too: the run's ``config.json`` would replace the model's.
"""

from __future__ import annotations

from pathlib import Path

from shardlib.run.config import TrainConfig, TrainConfigError
from shardlib.runtime.files import refuse_link

RUN_OUTPUTS = ("config.json", "metrics.jsonl", "loss_curve.png", "sample.txt", "checkpoints", "examples.jsonl",
               "profile", "wandb", "mlruns")


def refuse_planted_links(out_dir: Path) -> None:
    """Each of the run's outputs (and its examples files, one per process) that is a link: refused."""
    names = set(RUN_OUTPUTS) | {p.name for p in out_dir.glob("examples.process*.jsonl")}
    for name in sorted(names):
        refuse_link(out_dir / name, "a run's output")


def refuse_out_over_sources(config: TrainConfig) -> None:
    """``--out`` may not be the directory of ``--init-from`` or ``--tokenizer``, nor one above it."""
    if config.out is None:
        return
    out = Path(config.out).expanduser().resolve()
    for field in ("init_from", "tokenizer"):
        given = getattr(config, field)
        if given is None:
            continue
        source = Path(given).expanduser().resolve()
        source = source if source.is_dir() else source.parent
        if source == out or out in source.parents:
            raise TrainConfigError("out", f"{out} is, or holds, the --{field.replace('_', '-')} directory {source}; "
                                          "the run's config.json, metrics and checkpoints would be written over the "
                                          "model's files: pick another --out")
