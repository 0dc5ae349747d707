"""One process of a 2-process Hugging Face import (tests/test_hf_import_processes.py).

Run under ``shardlib launch``: joins the job, imports ``DIR`` under zero3 over every device of
the job (``fsdp=-1``), and prints ``RESULT {json}``: the bytes this process's reader read, and
whether each of its devices' shards equals the same box of the checkpoint read whole on the host
(`Placement.read` over the whole tensor, converted to float32: the pre-issue-44 reader).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # the repository root, so `models` and `shardlib` import without install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardlib.runtime import distributed  # noqa: E402  (imports jax, starts no backend)


def main(directory: str) -> int:
    info = distributed.initialize()
    import jax
    import numpy as np

    from shardlib import make_layout, make_mesh
    from shardlib.hf import architectures as arch_lib
    from shardlib.hf.load import _param_shapes, load_params, open_pretrained
    from shardlib.models import trainable
    from shardlib.sharding.rules import path_str

    pretrained = open_pretrained(directory)
    layout = make_layout(trainable(pretrained.model_config), "zero3", make_mesh({"fsdp": -1}))
    params = jax.block_until_ready(load_params(pretrained, layout.param_shardings()))
    read = sum(f.bytes_read for f in set(pretrained.files.values()))

    shapes, maps = _param_shapes(pretrained.model_config), {t.path: t for t in arch_lib.tensors_for(pretrained.model_config)}
    mismatched, split = [], 0
    for path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = path_str(path)
        t, shape = maps[path], shapes[path]
        whole_box = lambda s: tuple(slice(0, n) for n in s)
        if t.per_layer:
            names = arch_lib.hf_names(t, shape[0])
            whole = np.stack([t.placement.read(shape[1:], whole_box(shape[1:]), lambda box, n=n: pretrained.files[n].read(n, box))
                              for n in names])
        else:
            whole = t.placement.read(shape, whole_box(shape), lambda box: pretrained.files[t.name].read(t.name, box))
        whole = whole.astype(np.float32)
        split += array.sharding.shard_shape(array.shape) != array.shape
        for shard in array.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), whole[shard.index]):
                mismatched.append(path)
    print("RESULT " + json.dumps({"process": info.process_id, "bytes_read": read, "mismatched": mismatched,
                                  "split": int(split), "devices": jax.device_count()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(distributed.finish(main(sys.argv[1])))
