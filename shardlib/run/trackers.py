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



class TrackerError(ValueError):
    """A tracker that cannot log; `shardlib.run.config.flag_errors` shows it as ``--log-to: ...``
    (this module imports nothing of the run's config, which imports it)."""


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers, by name (the step is the tracker's own axis)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _wandb_credentials() -> str | None:
    """Why wandb cannot log online (no key), or None: offline or disabled modes need none."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc().authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"wandb has no API key for {host} (WANDB_API_KEY, or `wandb login`); set WANDB_MODE=offline to log "
            "into OUT/wandb without one")


class WandbLog:
    """Action: ``wandb.log`` of each record; the config as the run's config."""

    package = "wandb"
    missing_credentials = staticmethod(_wandb_credentials)

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
    missing_credentials = staticmethod(lambda: None)  # a file store in OUT, or the server MLFLOW_TRACKING_URI names

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
        raise TrackerError(f"{text!r}: choose among {', '.join(TRACKERS)} (comma-separated)")
    return names


def check_trackers(names: tuple[str, ...]) -> None:
    """Each tracker's package is installed and it has what it needs to log (wandb: a key or offline
    mode): checked before the run directory is touched, so a refusal leaves ``--out`` as it was."""
    import importlib.util

    for name in names:
        tracker = TRACKERS[name]
        if importlib.util.find_spec(tracker.package) is None:
            raise TrackerError(f"{name} is not installed: pip install \"shardlib[{name}]\"")
        problem = tracker.missing_credentials()
        if problem is not None:
            raise TrackerError(problem)


def open_trackers(names: tuple[str, ...], out_dir: Path, config: Mapping[str, Any], *, enabled: bool) -> list[Any]:
    """The trackers' actions on process 0 (none elsewhere), started before the step compiles; one
    that cannot start is one line naming it (those already started are closed)."""
    if not enabled:
        return []
    check_trackers(names)
    opened: list[Any] = []
    for name in names:
        try:
            opened.append(TRACKERS[name](out_dir, config))
        except Exception as err:  # the tracker's own errors (network, login, a bad server URI)
            for tracker in opened:
                tracker.close()
            raise TrackerError(f"{name} could not start: {type(err).__name__}: "
                               f"{' '.join(str(err).split())[:300]}") from None
    return opened
