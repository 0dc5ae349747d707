"""One JSON object read from a model or adapter directory, every failure one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_object(path: Path, error: type[ValueError], missing: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``error(missing)`` when there is no such file, ``error`` naming
    the file when it is not JSON or not an object."""
    if not path.is_file():
        raise error(missing)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        why = f"{type(err).__name__} {' '.join(str(err).split())[:200]}"
        raise error(f"{path} is not valid JSON: {why}") from None
    if not isinstance(config, dict):
        raise error(f"{path} holds {type(config).__name__}, not a JSON object")
    return config
