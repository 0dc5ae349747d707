"""What a compiled program will do, read from the program itself: the names reports and scripts import.

One module per concern; this one re-exports their public names so that
``from shardlib.tools.report import collective_stats, memory_stats, format_table`` keeps working:

* `shardlib.tools.hlo_parse`: the HLO parser, loop multiplicities and replica groups.
* `shardlib.tools.hlo`: ``collective_stats`` (ring volumes of docs/design.md, "Collective
  volumes (ring convention)").
* `shardlib.tools.memory`: ``memory_stats`` (XLA's per-device buffer sizes and peak; see
  docs/design.md, "Memory per device").
* `shardlib.tools.flops`: ``flops_per_step``, ``mfu`` and ``peak_flops_for`` (peaks from the
  profiles in `shardlib.tools.hardware`).
* `shardlib.text` (the bottom layer): ``format_bytes``, ``format_table``, ``format_markdown``.
"""

from __future__ import annotations

from shardlib import text
from shardlib.tools import flops, hlo, hlo_parse, memory
from shardlib.tools.flops import *  # noqa: F403
from shardlib.tools.hlo import *  # noqa: F403
from shardlib.tools.hlo_parse import *  # noqa: F403
from shardlib.tools.memory import *  # noqa: F403
from shardlib.text import *  # noqa: F403

__all__ = [*hlo_parse.__all__, *hlo.__all__, *memory.__all__, *flops.__all__, *text.__all__]
