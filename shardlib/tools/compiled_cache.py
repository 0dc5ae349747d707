"""What `shardlib plan` reads of a compiled program, kept on disk so a rerun plan skips the compile.

The planner reads two things of a compiled step, ``memory_analysis()`` and the optimised HLO
(``as_text()``), and two traits of its shardings that the memory figures depend on: the platform
(a TPU peak is the compiler's own, XLA:CPU's is estimated) and whether an argument lives in host
memory (offloaded state, taken out of XLA:CPU's device figures). JAX's persistent compilation
cache cannot serve a TPU topology compiled on a CPU host: jax 0.10.2 writes the executable but
fails to load it back ("PjRtCompiler must be constructed with a Client to call
DeserializeLoadedExecutable") and compiles again, minutes for a large model; and it is a
process-wide setting. So plans keep those facts here, keyed by the lowered program's text and the
compiler (platform, topology, jax and libtpu versions): the same candidate planned again reads
them back; any change to the step, the model or the compiler misses.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import types
from typing import Any

from shardlib.runtime.files import AtomicFile, make_dir
from shardlib.tools.memory import compiled_platform, has_host_inputs

_FIELDS = ("generated_code_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
           "temp_size_in_bytes", "host_generated_code_size_in_bytes", "host_argument_size_in_bytes",
           "host_output_size_in_bytes", "host_alias_size_in_bytes", "host_temp_size_in_bytes",
           "peak_memory_in_bytes")


class CompiledFacts:
    """A compiled program's memory analysis, optimised HLO and ``recorded_traits`` (platform, host
    inputs), read back from the cache; stands in for a ``jax.stages.Compiled`` where only those are
    read (`shardlib.tools.memory.memory_stats`, `shardlib.tools.hlo.collective_stats`)."""

    input_shardings = None

    def __init__(self, memory: dict[str, int | None], text: str, traits: dict[str, Any]) -> None:
        self._memory, self._text = memory, text
        self.recorded_traits = {"platform": traits["platform"], "host_inputs": bool(traits["host_inputs"])}

    def memory_analysis(self) -> Any:
        return types.SimpleNamespace(**self._memory)

    def as_text(self) -> str:
        return self._text


def cache_key(lowered: Any, compiler: str) -> str:
    """The lowered program's text and the compiler's description, hashed."""
    digest = hashlib.sha256(compiler.encode())
    digest.update(lowered.as_text().encode())
    return digest.hexdigest()[:40]


def compile_cached(lowered: Any, folder: str | None, compiler: str) -> Any:
    """``lowered.compile()``, or its facts from ``folder`` when this program was compiled before
    by the same compiler (None: no cache)."""
    if folder is None:
        return lowered.compile()
    path = os.path.join(folder, f"plan-{cache_key(lowered, compiler)}.json.gz")
    if os.path.exists(path):
        try:
            with gzip.open(path, "rt") as f:
                saved = json.load(f)
            return CompiledFacts(saved["memory"], saved["text"], saved["traits"])
        except (OSError, ValueError, KeyError, TypeError):  # a damaged or older entry is compiled again, and rewritten
            pass
    compiled = lowered.compile()
    analysis = compiled.memory_analysis()
    memory = {field: getattr(analysis, field, None) for field in _FIELDS}
    traits = {"platform": compiled_platform(compiled), "host_inputs": has_host_inputs(compiled)}
    make_dir(folder, "the plan cache")
    with AtomicFile(path, what="the plan cache") as raw:  # whole or absent: a killed plan leaves no half entry
        with gzip.GzipFile(fileobj=raw, mode="wb") as f:
            f.write(json.dumps({"memory": memory, "text": compiled.as_text(), "traits": traits}).encode("utf-8"))
    return compiled


__all__ = ["CompiledFacts", "cache_key", "compile_cached"]
