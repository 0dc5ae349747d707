"""`shardlib generate`: text from a run's checkpoint or a Hugging Face model directory.

The parameters are placed under a strategy's layout on a mesh, as training places them (read
straight into the shards from safetensors, or restored from the checkpoint without its optimizer
state), in the compute dtype (``--precision bf16`` reads bf16 weights), and
`shardlib.models.decoding.generate` decodes with a KV cache: the prompt in one pass, then one token
a step. Greedy (``--temperature 0``, the default), temperature, top-k and top-p sampling. The text
ends at the first stop id: ``generation_config.json``'s ``eos_token_id`` (one or a list), else
``config.json``'s, else the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, metavar="RUN_OR_HF_DIR",
                        help="a run directory of `shardlib train` (its latest checkpoint) or a Hugging Face model directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampling")
    parser.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of tokens whose "
                                                                  "probability reaches P")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the K most likely tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory (default: the model "
                                                          "directory's, or the run's --tokenizer; bytes for byte-level runs)")
    parser.add_argument("--step", type=int, default=None, help="with a run directory: the checkpoint step (default: latest)")
    parser.add_argument("--strategy", default="dp", help="how the parameters are laid out over the devices (default dp)")
    parser.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. fsdp=8 (default: the strategy's)")
    parser.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                        help="simulate N CPU devices when there is no accelerator (default: the devices JAX finds)")
    parser.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                        help="the weights' and the computation's dtype (default f32; bf16 reads bf16 weights)")


def _setup_devices(cpu_devices: int | None) -> None:
    """Join the multi-process job this process belongs to (`shardlib launch`, SLURM, a TPU pod), or
    simulate ``cpu_devices`` CPU devices when asked."""
    from shardlib.runtime import distributed

    if distributed.plan().multi_process:
        distributed.initialize()
    elif cpu_devices is not None:
        from shardlib.runtime.devices import simulate_cpu_devices

        simulate_cpu_devices(cpu_devices)


def _check_flags(args: argparse.Namespace) -> None:
    """The flags that need no model, checked before JAX starts: each names itself."""
    from shardlib.models.decoding import check_sampling
    from shardlib.sharding.strategies import get_strategy

    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise GenerateError(f"--cpu-devices must be a positive device count, got {args.cpu_devices}")
    if args.max_new_tokens < 1:
        raise GenerateError("--max-new-tokens must be at least 1")
    if not args.prompt:
        raise GenerateError("--prompt is empty: give the text to continue")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
        get_strategy(args.strategy)
    except ValueError as err:
        raise GenerateError(str(err)) from None  # each names its flag: temperature, top_k, top_p, strategy


def _check_model(config: Any, tokenizer: Any, args: argparse.Namespace, what: str) -> None:
    """The flags against the model, before its parameters are read: ids it has rows for."""
    if args.top_k is not None and args.top_k > config.vocab_size:
        raise GenerateError(f"--top-k {args.top_k} is more than the {config.vocab_size} tokens {what} has")
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise GenerateError(f"--tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids, and {what} embeds only "
                            f"{config.vocab_size}: use the tokenizer the model was trained with")


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    _setup_devices(args.cpu_devices)
    import jax
    import numpy as np

    from shardlib.models.decoding import generate, until_stop
    from shardlib.models import from_params

    config, params, tokenizer, what, stops = load_for_generation(args)
    ids = np.asarray(tokenizer.encode(args.prompt) if tokenizer is not None else list(args.prompt.encode()), np.int32)
    if not len(ids):
        raise GenerateError(f"--prompt {args.prompt!r} is no tokens for {getattr(tokenizer, 'path', 'bytes')}: give "
                            "text to continue")
    if len(ids) + args.max_new_tokens > config.max_seq_len:
        raise GenerateError(f"the prompt's {len(ids)} tokens + --max-new-tokens {args.max_new_tokens} exceed the "
                                f"model's {config.max_seq_len} positions")
    model = from_params(config, params)
    out = generate(model, ids[None], args.max_new_tokens, rng=jax.random.key(args.seed), temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, stop_token=stops)
    new = until_stop(np.asarray(jax.device_get(out))[0, len(ids):], stops)  # nothing after the stop id
    if jax.process_index() == 0:
        text = tokenizer.decode(new) if tokenizer is not None else bytes(new.astype(np.uint8)).decode("utf-8", "replace")
        print(f"# {what}", file=sys.stderr)
        print(args.prompt + text)
    return 0


def _stop_ids(directory: Path | None, tokenizer: Any) -> tuple[int, ...]:
    from shardlib.hf.generation_config import stop_ids

    try:
        return stop_ids(directory, tokenizer)
    except ValueError as err:
        raise GenerateError(str(err)) from None


class GenerateError(ValueError):
    """A generate request that cannot run: one line, exit 2."""

    user_facing = True


def load_for_generation(args: argparse.Namespace) -> tuple[Any, Any, Any, str, tuple[int, ...]]:
    """(model config, parameters placed on the mesh in the compute dtype, tokenizer or None, a
    description, the stop ids) of ``--from``."""
    from shardlib.hf.load import is_pretrained_dir, load_params, open_pretrained
    from shardlib.hf.tokenizer import load_tokenizer

    source = Path(args.source).expanduser()
    if is_pretrained_dir(source):
        pretrained = open_pretrained(source, seq_len=None)
        named = args.tokenizer or (source if (source / "tokenizer.json").is_file() else None)
        tokenizer = load_tokenizer(named) if named is not None else None
        _check_model(pretrained.model_config, tokenizer, args, str(source))
        layout = _layout(pretrained.model_config, args)
        params = load_params(pretrained, layout.param_shardings(), dtype=_DTYPES[args.precision])
        return (_with_precision(pretrained.model_config, args), params, tokenizer, pretrained.describe(),
                _stop_ids(source, tokenizer))
    return _from_run(source, args)


def _from_run(source: Path, args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    import jax

    from shardlib.hf.tokenizer import load_tokenizer
    from shardlib.tools.export import open_checkpoints, run_model_config

    if not source.is_dir():
        raise GenerateError(f"--from {source}: no such directory (give a run directory or a Hugging Face model directory)")
    ckpt = open_checkpoints(source)
    try:
        step = ckpt.resolve_step(args.step)
        saved = ckpt.saved_config(step)
        config = run_model_config(saved)
        if config is None:
            raise GenerateError(f"--from {source}: its model {saved.get('model')!r} is not shardlib's decoder, which "
                                "generate runs")
        named = args.tokenizer or saved.get("tokenizer_file")
        if named is None and config.vocab_size != 256:
            raise GenerateError(f"--from {source}: the run's token ids come from a tokenizer it did not record; pass "
                                "--tokenizer")
        tokenizer = load_tokenizer(named) if named is not None else None
        _check_model(config, tokenizer, args, str(source))
        layout = _layout(config, args)
        target = {"params": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                         _abstract(config), layout.param_shardings())}
        params = ckpt.restore_subtree(target, step)["params"]
    finally:
        ckpt.close()
    dtype = _DTYPES[args.precision]
    params = jax.tree.map(lambda a: a.astype(dtype) if a.dtype != dtype else a, params)
    return (_with_precision(config, args), params, tokenizer, f"{source} step {step}",
            _stop_ids(tokenizer.path.parent if tokenizer is not None else None, tokenizer))


def _abstract(config: Any) -> Any:
    from shardlib.models import trainable

    return trainable(config).abstract()


def _layout(config: Any, args: argparse.Namespace) -> Any:
    from shardlib.models import trainable
    from shardlib.sharding.layout import make_layout
    from shardlib.sharding.mesh import make_mesh, parse_mesh
    from shardlib.sharding.strategies import get_strategy

    strategy = get_strategy(args.strategy)
    sizes = parse_mesh(args.mesh) if args.mesh else dict(strategy.default_mesh)
    return make_layout(trainable(config), strategy, make_mesh(sizes))


# --precision -> the weights' and the computation's dtype (generation keeps no float32 master copy).
_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def _with_precision(config: Any, args: argparse.Namespace) -> Any:
    import dataclasses

    return dataclasses.replace(config, compute_dtype=_DTYPES[args.precision])
