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


def stop_ids(directory: Path | None, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a continuation: ``generation_config.json``'s ``eos_token_id`` in
    ``directory`` (an int or a list), else its ``config.json``'s, else the tokenizer's."""
    for name in (NAME, "config.json"):
        path = None if directory is None else directory / name
        if path is not None and path.is_file():
            try:
                eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            except (ValueError, UnicodeDecodeError, AttributeError) as err:
                raise ValueError(f"{path}: not a JSON object ({err}); fix or remove it") from None
            ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
            if ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                return tuple(ids)
    eos = getattr(tokenizer, "eos_id", None)
    return () if eos is None else (eos,)
