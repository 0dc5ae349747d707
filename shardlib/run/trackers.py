"""``--log-to wandb,mlflow``: each step's record and the run's config in an experiment tracker.

Each tracker is an action (`shardlib.run.actions.Action`) that writes the scalars
``metrics.jsonl`` has, at their step, and the config once. Both run offline where the
environment says so: wandb with ``WANDB_MODE=offline`` (files under ``OUT/wandb``), mlflow into
``OUT/mlruns`` unless ``MLFLOW_TRACKING_URI`` names a server. Optional extras:
``pip install "shardlib[wandb]"`` / ``"shardlib[mlflow]"``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardlib.run.config import TrainConfigError


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers, by name (the step is the tracker's own axis)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class WandbLog:
    """Action: ``wandb.log`` of each record; the config as the run's config."""

    package = "wandb"

    def __init__(self, out_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardlib"), name=out_dir.name, dir=str(out_dir),
                              config=dict(config))

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLog:
    """Action: ``mlflow.log_metrics`` of each record; the config as the run's parameters."""

    package = "mlflow"

    def __init__(self, out_dir: Path, config: Mapping[str, Any]) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # the run's own folder: mlflow's file store (in maintenance, still read by `mlflow ui`)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out_dir.absolute() / "mlruns").as_uri()
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardlib"))
        self.run = mlflow.start_run(run_name=out_dir.name)
        mlflow.log_params({k: str(v) for k, v in config.items()})

    def __call__(self, step: int, state: Any, record: dict[str, Any]) -> None:
        import mlflow

        mlflow.log_metrics(scalars(record), step=step)

    def close(self) -> None:
        import mlflow

        mlflow.end_run()


TRACKERS = {"wandb": WandbLog, "mlflow": MlflowLog}


def parse(text: str) -> tuple[str, ...]:
    """``--log-to wandb,mlflow`` -> ``("wandb", "mlflow")``; an unknown name names the known ones."""
    names = tuple(filter(None, (n.strip() for n in text.split(","))))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or not names:
        raise TrainConfigError("log_to", f"{text!r}: choose among {', '.join(TRACKERS)} (comma-separated)")
    return names


def open_trackers(names: tuple[str, ...], out_dir: Path, config: Mapping[str, Any], *, enabled: bool) -> list[Any]:
    """The trackers' actions on process 0 (none elsewhere); a missing package names its extra."""
    if not enabled:
        return []
    opened = []
    for name in names:
        tracker = TRACKERS[name]
        try:
            opened.append(tracker(out_dir, config))
        except ModuleNotFoundError as err:
            if err.name != tracker.package:
                raise
            raise TrainConfigError("log_to", f"{name} is not installed: pip install \"shardlib[{name}]\"") from None
    return opened
