"""Digests of a checkpoint: a position-aware 64-bit hash of every array's logical value (the same
on any mesh), SHA-256 of the JSON items, and the Orbax item that writes them in the background.

The hash, ``h(x) = sum over elements i of fmix32((i * G + seed) ^ bits(x[i]))  (mod 2**32)``
with two seeds: each term depends only on the element's row-major index in the *logical* array
and its bits, and the sum is order-free, so the digest is the same whatever mesh, sharding or
process count holds the array: every device hashes its own shard and one all-reduce adds them
up. For a fixed index the term is a bijection of the bits, so any single changed element always
changes the digest; several changes cancel with probability about 2**-64.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlib.sharding.rules import path_str

DIGEST_ITEM = "digests"
DIGEST_KIND = "shardlib.poshash64/1"

_GOLDEN = np.uint32(0x9E3779B9)
_SEEDS = (np.uint32(0x3C6EF372), np.uint32(0xA54FF53A))


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finaliser: a bijection of uint32 that mixes every bit into every other."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32, shape ``x.shape + (k,)`` (k = 2 for 64-bit values, else 1)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_ or dtype.itemsize < 1 or dtype.name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn"):
        x = x.astype(jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else jnp.int32)  # exact for these
        dtype = np.dtype(x.dtype)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
    if dtype.itemsize == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2
    return lax.bitcast_convert_type(x, unsigned[dtype.itemsize]).astype(jnp.uint32)[..., None]


def _array_digest(x: jax.Array) -> jax.Array:
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):  # the row-major index, built elementwise (no reshape, no resharding)
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(stride & 0xFFFFFFFF)
        stride *= words.shape[axis]
    position = index * _GOLDEN
    lanes = [jnp.sum(_fmix32((position + seed) ^ words), dtype=jnp.uint32) for seed in _SEEDS]
    return jnp.stack(lanes)


def digest_all(leaves: list[jax.Array]) -> jax.Array:
    """The [n, 2] uint32 digests of ``leaves``: the body `digest_arrays` jits (tests lower it for
    TPU, where each lane is a reduction fused with its hash, no array-sized temporary)."""
    return jnp.stack([_array_digest(x) for x in leaves])


_digest_fns: dict[Any, Callable] = {}


def _in_device_memory(x: Any) -> Any:
    """``x``, copied into device memory if it lives in host memory (offloaded optimizer state): one
    computation cannot mix memory spaces. The copy keeps the sharding and is dispatched async."""
    sharding = getattr(x, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    if kind is None or kind == "device":
        return x
    return jax.device_put(x, sharding.with_memory_kind("device"))


def digest_arrays(tree: Any) -> tuple[list[str], jax.Array | None]:
    """(paths, a [n, 2] uint32 device array of digests) for the arrays of ``tree``.

    Dispatched asynchronously: nothing waits for the devices until the result is read
    (`digest_hex`). The result is replicated, so every process can read it.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = [(path_str(path), leaf) for path, leaf in flat if leaf is not None]
    if not flat:
        return [], None
    leaves = [_in_device_memory(leaf) for _, leaf in flat]
    sharding = getattr(leaves[0], "sharding", None)
    out = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
    fn = _digest_fns.get(out)
    if fn is None:
        fn = _digest_fns[out] = jax.jit(digest_all, out_shardings=out)
    return [p for p, _ in flat], fn(leaves)


def digest_hex(paths: list[str], digests: jax.Array | None) -> dict[str, str]:
    """``{path: "16 hex digits"}``; blocks until the digests are computed."""
    if digests is None:
        return {}
    values = np.asarray(digests)
    return {path: f"{int(a):08x}{int(b):08x}" for path, (a, b) in zip(paths, values)}


def sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``: how the digests record a JSON item's file."""
    return hashlib.sha256(data).hexdigest()


class PendingDigests:
    """The digests item of one save, read from the devices in Orbax's background write.

    `start` dispatches the reduction. An async save calls it right after Orbax has copied the
    arrays to the host, so that the copy (which the loop waits for) is not queued behind it;
    `resolve` (in the background write) waits for `start`, then for the devices.
    """

    def __init__(self, step: int, json_items: Mapping[str, Any], data_step_tied: bool) -> None:
        self.head = {
            "kind": DIGEST_KIND,
            "step": int(step),
            # the same bytes JsonCheckpointHandler writes: json.dumps(item)
            "files": {f"{name}/metadata": sha256(json.dumps(item).encode("utf-8")) for name, item in json_items.items()},
            "data_step_tied": bool(data_step_tied),
        }
        self._started = threading.Event()
        self._paths: list[str] = []
        self._digests: jax.Array | None = None
        self._error: BaseException | None = None

    def start(self, tree: Any) -> None:
        try:
            self._paths, self._digests = digest_arrays(tree)
        except BaseException as err:  # noqa: BLE001 - raised by resolve, in the save it belongs to
            self._error = err
            raise
        finally:
            self._started.set()

    def cancel(self, err: BaseException) -> None:
        if not self._started.is_set():
            self._error = err
            self._started.set()

    def resolve(self) -> dict[str, Any]:
        self._started.wait()
        if self._error is not None:
            raise self._error
        return {**self.head, "arrays": digest_hex(self._paths, self._digests)}


class DigestHandler(ocp.JsonCheckpointHandler):
    """Orbax's JSON item, except that the value is computed in the background thread."""

    async def _save_fn(self, x, directory):
        if ocp.multihost.is_primary_host(self._primary_host):
            value = x.resolve() if isinstance(x, PendingDigests) else x
            (directory / self._filename).write_text(json.dumps(value))


@ocp.args.register_with_handler(DigestHandler, for_save=True)
@dataclasses.dataclass
class DigestSave(ocp.args.CheckpointArgs):
    """Saves the digests item (a `PendingDigests`, resolved in the background write)."""

    item: Any


@ocp.args.register_with_handler(DigestHandler, for_restore=True)
@dataclasses.dataclass
class DigestRestore(ocp.args.CheckpointArgs):
    """Registers `DigestHandler` for restores (Orbax needs both directions; the item is read as JSON)."""

    item: Any = None
