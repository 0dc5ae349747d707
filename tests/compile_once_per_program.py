"""Byte-identical programs compiled once within a block: JAX's persistent compilation cache,
pointed at a temporary folder for that block only and switched off again after it.

For parametrized tests whose cases sometimes lower to the very same program (zero1 and zero2
without gradient accumulation). Each case still traces and lowers its own program; JAX's cache
key is the lowered module with the compile options, XLA flags and devices, so only a program
equal in every byte skips the XLA compile and loads the executable the first case compiled.
Nothing persists past the block (the folder is the caller's temporary one), so no test reads an
executable another run wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

_OPTIONS = {"jax_compilation_cache_dir": None, "jax_persistent_cache_min_compile_time_secs": 0.0,
            "jax_persistent_cache_min_entry_size_bytes": -1}


@contextlib.contextmanager
def compile_once(folder) -> Iterator[None]:
    """Within the block, a program already compiled in it is loaded from ``folder``, not recompiled."""
    before = {name: getattr(jax.config, name) for name in _OPTIONS}
    wanted = dict(_OPTIONS, jax_compilation_cache_dir=str(folder))
    for name, value in wanted.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is on: ask again now
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
