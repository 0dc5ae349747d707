"""A model's ``generation_config.json`` (its eos / bos ids, sampling defaults), kept from import to export.

transformers' ``generate`` and serving stacks read their stop tokens from this file; an export
without it stops at the wrong token or never. It is read once when a run imports the model,
recorded in the run's config, and written back verbatim beside the exported weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

NAME = "generation_config.json"


def read_generation_config(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``generation_config.json`` of a model directory, or None when it has none. A file that is
    not a JSON object is said on stderr (naming it) and not carried, never silently dropped."""
    path = Path(directory).expanduser() / NAME
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        value, why = None, f"cannot be read as JSON ({type(err).__name__})"
    else:
        why = "is not a JSON object"
    if not isinstance(value, dict):
        print(f"warning: {path} {why}; an export of this model will not carry a {NAME}", file=sys.stderr, flush=True)
        return None
    return value


def generation_config_text(value: dict[str, Any]) -> str:
    """The file's text as an export writes it."""
    return json.dumps(value, indent=2, sort_keys=True) + "\n"
