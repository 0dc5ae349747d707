"""A Hub id (``org/name``) resolved to a snapshot already in the local Hugging Face cache, offline.

`huggingface_hub` keeps a downloaded repository as ``<cache>/models--org--name/`` with
``refs/main`` (the commit the ``main`` branch pointed to when it was fetched) and
``snapshots/<commit>/`` holding the files. The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``, as the library itself reads it. Nothing is ever downloaded: a
model that is not in the cache is one line saying where it looked and how to fetch it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardlib.hf.load import PretrainedError

# org/name as the Hub spells a repository id: no leading dot or slash, one slash, no spaces.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    """Where `huggingface_hub` keeps downloaded repositories."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as ``org/name`` and names no local path (a local directory wins)."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def resolve(spec: str) -> tuple[Path, str | None]:
    """(the model directory, a note naming the snapshot used, or None): ``spec`` itself when it is
    a path, else the cached snapshot ``refs/main`` points to. A Hub id with no snapshot in the cache
    is a `PretrainedError` naming the cache and the command that fetches it."""
    if not is_hub_id(spec):
        return Path(spec), None
    repo = cache_dir() / f"models--{spec.replace('/', '--')}"
    fetch = f"huggingface-cli download {spec} (or pass the model's local directory)"
    ref = repo / "refs" / "main"
    if not ref.is_file():
        where = f"{repo} has no refs/main" if repo.is_dir() else f"{cache_dir()} holds no models--{spec.replace('/', '--')}"
        raise PretrainedError(f"{spec} is not a local directory and not in the Hugging Face cache ({where}); "
                              f"nothing is downloaded: fetch it first with {fetch}")
    commit = ref.read_text(encoding="utf-8").strip()
    snapshot = repo / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        raise PretrainedError(f"{spec}: {ref} names commit {commit!r}, whose snapshot {snapshot} is missing; "
                              f"nothing is downloaded: fetch it again with {fetch}")
    return snapshot, f"{spec} from the Hugging Face cache: snapshot {commit} ({snapshot})"
