"""`shardlib plan --plot FILE.png`: per-chip memory and estimated step time against chip count.

One point per plan document (a ``--topology`` name or a ``--devices`` run) and one line per
strategy, so the chip count where a strategy starts to fit, and how its step time scales, can
be read at a glance. Needs matplotlib (the ``cli`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardlib.runtime.files import AtomicFile


def plot_plans(documents: Sequence[Mapping[str, Any]], path: str) -> str:
    """Draw the candidates of ``documents`` (`plan_document` outputs) to ``path``; returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'shardlib[cli]'") from None
    series: dict[str, list[tuple[int, float, float]]] = {}
    for doc in documents:
        for c in doc["candidates"]:
            if c["error"] is None:
                series.setdefault(c["strategy"], []).append((c["devices"], c["peak_bytes"] / 2**30, c["step_s"] * 1e3))
    fig, (memory, time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in sorted(series.items()):
        points.sort()
        chips = [p[0] for p in points]
        memory.plot(chips, [p[1] for p in points], marker="o", label=name)
        time.plot(chips, [p[2] for p in points], marker="o", label=name)
    hbm = {doc["hbm_bytes"] for doc in documents}
    for limit in hbm:
        memory.axhline(limit / 2**30, color="grey", linestyle="--", linewidth=1)
    names = ", ".join(str(doc.get("topology") or f"{doc['devices']} devices") for doc in documents)
    memory.set(xlabel="chips", ylabel="peak GiB per chip (dashed: HBM)", xscale="log", title="memory")
    time.set(xlabel="chips", ylabel="estimated step ms (roofline)", xscale="log", yscale="log", title="step time")
    memory.legend(fontsize=8)
    fig.suptitle(f"{documents[0]['model']}, {documents[0]['precision']}: {names}", fontsize=9)
    fig.tight_layout()
    with AtomicFile(path, what="the plan's plot") as f:  # never through a link at its name
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)
    return path
