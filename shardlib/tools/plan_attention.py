"""Which attention kernel a plan candidate compiled, and its compiled HLO written out.

The row names what the program holds, read from its HLO: a Pallas kernel is a ``tpu_custom_call``
(the TPU policy's splash attention, `shardlib.model.splash`); otherwise the XLA attention the
model's ``attention`` setting resolves to under the devices' backend policy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from shardlib.runtime.files import make_dir, write_atomic

PALLAS_CALL = "tpu_custom_call"


def kernel(hlo_text: str, config: Any, dtype: Any, seq_len: int, policy: Any) -> str:
    """The attention kernel a compiled step runs, named for a plan row."""
    from shardlib.models.gpt import CUDNN_DTYPES, attention_for
    from shardlib.model.attention import FLASH_MIN_SEQ

    if PALLAS_CALL in hlo_text:
        return "splash (Pallas)"
    chosen = config.attention
    if chosen == "auto":
        chosen = attention_for(policy, dtype)
        chosen = "flash" if chosen == "einsum" and seq_len >= FLASH_MIN_SEQ else chosen
    if chosen == "splash":  # the kernel did not take the shape (said when traced)
        return "flash (splash did not fit)" if seq_len >= FLASH_MIN_SEQ else "einsum (splash did not fit)"
    if chosen == "cudnn" and dtype not in CUDNN_DTYPES:
        return "einsum"
    return chosen


def dump(directory: str, strategy: str, sizes: Mapping[str, int], hlo_text: str) -> str:
    """Write one candidate's compiled HLO text as ``DIR/<strategy>_<mesh>.hlo.txt``; its path."""
    make_dir(directory, "--dump-hlo's HLO files")  # never through a link
    mesh = "_".join(f"{axis}{size}" for axis, size in sizes.items() if size > 1) or "single"
    path = os.path.join(directory, re.sub(r"[^A-Za-z0-9_.=-]", "_", f"{strategy}_{mesh}") + ".hlo.txt")
    write_atomic(path, hlo_text, what="--dump-hlo's HLO files")
    return path
