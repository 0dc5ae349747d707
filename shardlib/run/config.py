"""`TrainConfig`: everything a run depends on, and the one source of `shardlib train`'s flags.

Each field that is a flag carries a `Flag` in its metadata (help, metavar, choices, a CLI
default where it differs); `add_arguments` turns the fields into argparse arguments and
`from_args` turns the parsed flags back into a `TrainConfig`, so a new option is one field.
Light: imports neither JAX nor NumPy (``shardlib train --help`` stays instant).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from shardlib.exits import EXIT_DIVERGED

# Defaults of the bare `shardlib train`: the `small` byte-level GPT under zero3 on 8 simulated
# CPU devices. Measured on a 2-core machine: validation loss 1.83 nats/byte after 50 steps and
# 1.48 after 100 (the target is < 2.77), at 1.1-3 s a step depending on what else runs there.
DEFAULT_STEPS = 100
DEFAULT_BATCH = 32
DEFAULT_SEQ_LEN = 128
DEFAULT_LR = 3e-3
DEFAULT_CPU_DEVICES = 8
PRECISIONS = {"f32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # fp16: dynamic loss scaling


class TrainConfigError(ValueError):
    """A bad setting: the CLI shows it as one line (exit 2) naming the flag and the fix."""

    user_facing = True

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{flag_name(field)}: {message}")


def flag_name(field: str) -> str:
    """The flag of a `TrainConfig` field: its `Flag.name` when it has one (``--schedule``), else ``--field-name``."""
    spec = next((f.metadata["flag"] for f in dataclasses.fields(TrainConfig) if f.name == field and "flag" in f.metadata),
                None)
    return spec.name if spec is not None and spec.name else "--" + field.replace("_", "-")


_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a `TrainConfig` field appears on the command line.

    ``help`` may use argparse's ``%(default)s``. ``name``: the flag when it is not the field's
    name; ``negate``: a boolean field that ``--no-NAME`` turns off; ``choices``: a list or a
    function giving one (read only when the parser is built, so registries load lazily);
    ``cli_default``: the CLI's default where it differs from the field's; ``parse``: turns the
    flag's string into the field's value after parsing (raising `TrainConfigError`).
    """

    help: str
    metavar: str | None = None
    name: str | None = None
    negate: bool = False
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    cli_default: Any = _UNSET
    parse: Callable[[str], Any] | None = None


def flag(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a default that is also a `shardlib train` flag."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **kwargs)})


def _model_name(name: str) -> str:
    """``--model``: a built-in config's name, or ``package.module:factory`` (`shardlib.run.user_model`)."""
    import difflib

    from shardlib.models import CONFIGS

    if ":" in name or name in CONFIGS:
        return name
    close = difflib.get_close_matches(name, list(CONFIGS), n=1, cutoff=0.6)
    hint = f"; did you mean --model {close[0]}?" if close else ""
    raise TrainConfigError("model", f"unknown model config {name!r} (built-in: {', '.join(CONFIGS)}; or your own as "
                                    f"package.module:factory){hint}")


def _step_range(text: str) -> str:
    """``--profile 5:8``: two step numbers, 1 <= START <= STOP."""
    start, sep, stop = text.partition(":")
    if not (sep and start.isdigit() and stop.isdigit() and 1 <= int(start) <= int(stop)):
        raise TrainConfigError("profile", f"{text!r} is not START:STOP, two steps with 1 <= START <= STOP (e.g. 5:8)")
    return text


@contextlib.contextmanager
def flag_errors(field: str, error: type[Exception]) -> Iterator[None]:
    """``error`` raised inside, from a module that knows no flags, as a `TrainConfigError` naming ``field``'s."""
    try:
        yield
    except error as err:
        raise TrainConfigError(field, str(err)) from None


def _tracker_names(value: str | tuple[str, ...]) -> tuple[str, ...]:
    from shardlib.run.trackers import TrackerError, parse

    with flag_errors("log_to", TrackerError):
        return parse(value) if isinstance(value, str) else tuple(value)


def _strategies() -> list[str]:
    from shardlib.sharding.strategies import ALIASES, STRATEGIES

    return [*STRATEGIES, *ALIASES]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; saved as ``config.json`` in the run directory.

    ``mesh`` is a string (``"data=2,fsdp=4"``), a dict, or None for the strategy's default.
    ``pipeline_stages > 1`` sets the mesh's ``pipe`` axis (the strategy's ``-1`` axis takes the
    rest). ``cpu_devices`` simulates that many CPU devices when no accelerator is present; it must be
    applied before JAX starts, so library users normally leave it None and set devices up
    themselves (the CLI passes its ``--cpu-devices``). ``warmup_steps=None`` means 10% of steps.
    Fields without a `Flag` (``min_lr_ratio``, ``eval_batches``, ``verbose``, ...) are library-only.
    """

    model: str = flag("small", "a built-in model config (tiny, small, ...; default %(default)s), or your own as "
                               "package.module:factory returning a shardlib Model (docs/your-model.md)",
                      metavar="NAME|MODULE:FACTORY", parse=_model_name)
    strategy: str = flag("zero3", "parallelism strategy (default %(default)s)", choices=_strategies)
    mesh: str | Mapping[str, int] | None = flag(
        None, "mesh axis sizes, e.g. data=2,fsdp=4 or fsdp=-1 (default: the strategy's)", metavar="SIZES")
    cpu_devices: int | None = flag(
        None, "simulate N CPU devices when there is no accelerator (default %(default)s)", metavar="N",
        cli_default=DEFAULT_CPU_DEVICES)
    xla_gpu_overlap: bool = flag(False, "set XLA's GPU flags for compute/communication overlap (latency-hiding "
                                        "scheduler, collective combining; docs/gpu.md); a no-op off GPU")
    steps: int = flag(DEFAULT_STEPS, "training steps (default %(default)s)", metavar="N")
    epochs: float | None = flag(None, "train for N passes over the training data in place of --steps: instruction "
                                      "examples (each once per epoch, shuffled) or text tokens", metavar="N")
    pack: bool = flag(False, "pack several instruction examples (.jsonl) into each row, attention kept within each "
                             "(segment ids) and positions restarting at each, instead of one padded example a row")
    batch_size: int = flag(DEFAULT_BATCH, "global batch size in sequences (default %(default)s)", metavar="B")
    seq_len: int | None = flag(None, f"sequence length in tokens (default: {DEFAULT_SEQ_LEN}, or the model's "
                                     "max_seq_len when that is shorter)", metavar="T")
    cp_balance: bool = flag(True, "with a context mesh axis: split each sequence into contiguous chunks instead of "
                                  "one early and one late chunk per device (causal load balance, the default)", negate=True)
    cp_attention: str = flag("auto", "with a context mesh axis: attention by a ring of K/V blocks, an all-gather of "
                                     "K/V, or auto (by tokens per device; the choice is printed) (default %(default)s)",
                             choices=("auto", "ring", "allgather"))
    lr: float = flag(DEFAULT_LR, "peak learning rate; linear warmup, then cosine decay to 10%% (default %(default)s)",
                     metavar="LR")
    warmup_steps: int | None = flag(None, "warmup steps (default 10%% of --steps)", metavar="N")
    min_lr_ratio: float = 0.1
    schedule_steps: int | None = flag(None, "steps the lr schedule spans (default: --steps; a run resumed with "
                                            "another --steps keeps the one it started with)", metavar="N")
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = flag(0, "seed for init and data order", metavar="S")
    precision: str = flag("f32", "compute dtype; parameters and optimizer state stay f32 (fp16 adds dynamic loss "
                                 "scaling)", choices=list(PRECISIONS))
    reduce_dtype: str = flag("f32", "dtype the gradients are reduced in over the batch axes (reduce-scatter / "
                                    "all-reduce; default f32; bf16 halves those bytes)", choices=["f32", "bf16"])
    xla_options: str | None = flag(None, "XLA options every step compiles with, NAME=VALUE,..., over the backend's "
                                         "own (on TPU the collective options of docs/tpu.md) and LIBTPU_INIT_ARGS",
                                   metavar="NAME=VALUE,...")
    remat: str = flag("full", "what each block keeps for its backward pass: none (everything, no recompute), full "
                              "(nothing, recompute the block), save_dots_except_mlp_in, save_dots, offload_dots (the "
                              "projections' outputs in host memory); reference decoders only (default %(default)s)",
                      choices=["none", "full", "save_dots_except_mlp_in", "save_dots", "offload_dots"])
    grad_accum: int = flag(1, "split each step's batch into K microbatches, one optimizer update (default 1)",
                           metavar="K")
    grad_compression: str = flag("none", "compress the gradient reduction (int8: per-block scales + error "
                                         "feedback; default none)", choices=["none", "bf16", "int8"])
    weight_gather: str = flag("none", "ZeRO-3's weight all-gather on the wire (int8: ZeRO++ qwZ, per-block "
                                      "scales; docs/zeropp.md; default none)", choices=["none", "int8"])
    bucket_mb: float = flag(25.0, "pack the uncompressed gradient reductions into buckets of this many MiB, one "
                                  "collective each (default %(default)s; 0: one per tensor)", metavar="MB")
    offload: str = flag("none", "keep the optimizer state in pinned host memory between steps (ZeRO-Offload, "
                                "docs/offload.md; default none)", choices=["none", "opt_state"])
    staleness: int = flag(0, "apply each step's reduced gradient TAU steps later, so its reduction overlaps the "
                             "next steps' compute (docs/sync-async.md; default 0: synchronous)", metavar="TAU")
    pipeline_stages: int = flag(1, "split the layers into S pipeline stages over the mesh's pipe axis (default 1: "
                                   "no pipeline)", metavar="S")
    microbatches: int | None = flag(None, "pipeline microbatches per step (default 2 x stages); the bubble is "
                                          "(S-1)/(M+S-1)", metavar="M")
    pipeline_schedule: str = flag("1f1b", "pipeline schedule (default 1f1b: activations of at most 2S-1 "
                                          "microbatches per stage)", name="--schedule", choices=["1f1b", "gpipe"])
    stage_layers: str | None = flag(None, "layers per pipeline stage: auto (balance the stages' compiled costs, "
                                          "embedding and head included) or a list such as 3,5 (default: even)",
                                    metavar="auto|N,N")
    data: str | None = flag(None, "text file, folder of .txt files, or glob, read as bytes; or a token file "
                                  "(.bin / .npy of token ids, docs/data.md) (default: the built-in pydoc corpus)",
                            metavar="PATH")
    eval_data: str | None = flag(None, "validate on this file, read as --data is (text, token file or .jsonl "
                                       "examples), and train on all of --data (default: the last 5%% of --data)",
                                 metavar="PATH")
    vocab_size: int | None = flag(None, "with a token file: the tokenizer's vocabulary size, the model's embedding "
                                        "rows (default: the model's)", metavar="V")
    init_from: str | None = flag(None, "start from a Hugging Face model directory (config.json + safetensors: Llama, "
                                       "Mistral, Qwen2, Gemma; or org/name, its snapshot in the local Hugging Face "
                                       "cache, never downloaded): its architecture and weights, read straight into "
                                       "the shards; the optimizer starts fresh; replaces --model (docs/pretrained.md)",
                                 metavar="HF_DIR")
    lora_rank: int | None = flag(None, "with --init-from: train LoRA adapters of rank R on the --lora-targets "
                                       "projections, the base frozen and stored in the compute dtype "
                                       "(docs/pretrained.md, LoRA)", metavar="R")
    lora_alpha: float | None = flag(None, "LoRA's alpha: the adapters' output is scaled by alpha / rank "
                                          "(default: the rank, a scale of 1)", metavar="A")
    lora_targets: str = flag("q,k,v,o,gate,up,down", "the projections LoRA adapts (default %(default)s)",
                             metavar="NAMES")
    lora_base: str | None = flag(None, "QLoRA: store every projection of the frozen base as int8 codes with "
                                       "per-output-channel scales (Qwix; the shardlib[qlora] extra), dequantised in "
                                       "the compute dtype (nf4: not yet, refused)", choices=("int8", "nf4"))
    init_lora: str | None = flag(None, "with --lora-rank: start the adapters from a PEFT adapter directory "
                                       "(adapter_config.json + adapter_model.safetensors; its rank, alpha and "
                                       "targets must match)", metavar="PEFT_DIR")
    tokenizer: str | None = flag(None, "a Hugging Face tokenizer (tokenizer.json, or a model directory holding one): "
                                       "--data text is tokenized with it (cached beside the data) and a .jsonl file "
                                       "read as instruction examples; the sample's prompt too", metavar="PATH")
    token_dtype: str = flag("uint16", "element type of a raw .bin token file (default uint16, as nanoGPT writes; "
                                      "uint32 for vocabularies over 65,536)", choices=["uint16", "uint32"])
    out: str | None = flag(None, "run directory (default runs/<timestamp>, new each run); a re-run with the same "
                                    "--out resumes from its checkpoints", metavar="DIR")
    eval_every: int = flag(25, "validate every N steps and at the end (default %(default)s; 0: at the end only)",
                           metavar="N")
    eval_batches: int = 8
    log_every: int = flag(10, "refresh the printed numbers every N steps (default %(default)s)", metavar="N")
    prompt: str = flag("The ", "prompt for the final text sample (default %(default)r)", metavar="TEXT")
    sample_tokens: int = flag(300, "tokens to continue --prompt by at the end (bytes for a byte-level run; greedy, "
                                   "ending early at the tokenizer's end-of-sequence token) (default %(default)s; 0: "
                                   "no sample)", metavar="N")
    sample_temperature: float = flag(0.0, "the end-of-run sample's temperature (default 0: greedy; above 0: "
                                          "sampled, --seed)", metavar="T")
    progress: bool = flag(True, "plain log lines instead of a progress bar (the default where the output is not a "
                                "terminal)", negate=True)
    tensorboard: bool = flag(True, "do not write TensorBoard event files", negate=True)
    verbose: bool = True
    ckpt_every: int | None = flag(None, "save a checkpoint every N steps and at the end (default: at the end only; "
                                        "0: never); each run also saves on Ctrl-C or SIGTERM", metavar="N")
    keep: int = flag(3, "checkpoints to keep (default %(default)s)", metavar="N")
    resume_from: str | None = flag(
        None, "continue from the latest checkpoint of this run directory (and keep writing there); a run "
              "whose --out already holds checkpoints resumes from them by itself", metavar="DIR")
    force: bool = flag(False, "start even when the compiled step needs more memory than a device has (refused "
                              "otherwise, with the largest --batch-size or the --grad-accum that fits)")
    fresh: bool = flag(False, "start at step 0 in an --out that holds an earlier run's metrics or damaged checkpoints "
                              "but no checkpoint to resume (without it such a run is refused); the old metrics.jsonl "
                              "is moved aside")
    max_skips: int = flag(10, f"stop (exit {EXIT_DIVERGED}) after K consecutive steps with a non-finite loss or "
                              "gradient, which are skipped; 0: never stop (default %(default)s)", metavar="K")
    profile: str | None = flag(None, "write a jax.profiler trace of steps START to STOP into DIR/profile (TensorBoard's "
                                     "profile plugin, or Perfetto for its trace.json.gz; docs/cli.md)",
                               metavar="START:STOP", parse=lambda text: text if text is None else _step_range(text))
    log_to: tuple[str, ...] = flag((), "also write each step's scalars and the config to wandb and/or mlflow (comma-"
                                       "separated; offline: WANDB_MODE=offline, mlflow into DIR/mlruns)",
                                   metavar="wandb,mlflow", parse=lambda value: _tracker_names(value))
    record_examples: bool = flag(False, "write DIR/examples.jsonl: the window start offsets each step read (audits "
                                        "exactly-once data)")
    straggler_every: int | None = flag(None, "with several processes, compare their step times every N steps and "
                                             "warn about a slow one (default 50; 0: off)", metavar="N")
    straggler_factor: float = flag(1.5, "warn when a process's step time is this many times the median of the "
                                        "others' (default %(default)s)", metavar="X")


def _flags() -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(TrainConfig) if "flag" in f.metadata]


def _value_type(hint: Any) -> type | None:
    """int or float for a numeric field (``int | None`` included); None (a string) otherwise."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next((t for t in (int, float) if t in options), None)


class _Default:
    """A flag's default as argparse holds it: told apart from the same value given (`given_fields`)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def _argument(field: dataclasses.Field, spec: Flag, hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for one field."""
    kwargs: dict[str, Any] = {"dest": field.name, "help": spec.help}
    if hint is bool:
        kwargs["action"] = "store_false" if spec.negate else "store_true"
        kwargs["default"] = _Default(field.default)
        return kwargs
    kwargs["default"] = _Default(field.default if spec.cli_default is _UNSET else spec.cli_default)
    if spec.parse is None and _value_type(hint) is not None:
        kwargs["type"] = _value_type(hint)
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices() if callable(spec.choices) else spec.choices)
    return kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument per `TrainConfig` field that has a `Flag`, in field order."""
    hints = typing.get_type_hints(TrainConfig)
    for field, spec in _flags():
        name = "--no-" + field.name.replace("_", "-") if spec.negate and not spec.name else flag_name(field.name)
        parser.add_argument(name, **_argument(field, spec, hints[field.name]))


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of parsed flags; fields without a flag keep their defaults."""
    values = {}
    for field, spec in _flags():
        value = getattr(args, field.name)
        value = value.value if isinstance(value, _Default) else value
        values[field.name] = spec.parse(value) if spec.parse is not None else value
    return TrainConfig(**values)


def given_fields(args: argparse.Namespace) -> frozenset[str]:
    """The fields whose flag was on the command line (even at its default value)."""
    return frozenset(field.name for field, _ in _flags() if not isinstance(getattr(args, field.name), _Default))


def check_numbers(config: TrainConfig) -> None:
    """Counts and rates in range; each error names its flag."""
    for field in ("steps", "batch_size", "seq_len", "log_every", "eval_batches", "grad_accum", "pipeline_stages",
                  "schedule_steps"):
        if getattr(config, field) is not None and getattr(config, field) < 1:  # seq_len None: the model's default
            raise TrainConfigError(field, f"must be at least 1, got {getattr(config, field)}")
    for field in ("eval_every", "ckpt_every", "sample_tokens", "seed", "max_skips"):
        if getattr(config, field) is not None and getattr(config, field) < 0:  # ckpt_every None: at the end
            raise TrainConfigError(field, f"must be non-negative, got {getattr(config, field)}")
    if not config.lr > 0:
        raise TrainConfigError("lr", f"must be positive, got {config.lr}")
    if not config.sample_temperature >= 0:  # nan too
        raise TrainConfigError("sample_temperature", f"must be >= 0 (0: greedy), got {config.sample_temperature}")
    if config.keep < 1:
        raise TrainConfigError("keep", f"must keep at least 1 checkpoint, got {config.keep}")
    if config.straggler_every is not None and config.straggler_every < 0:
        raise TrainConfigError("straggler_every", f"must be non-negative (0: off), got {config.straggler_every}")
    if config.profile is not None and int(_step_range(config.profile).split(":")[1]) > config.steps:
        raise TrainConfigError("profile", f"{config.profile} ends past the run's last step ({config.steps}); profile "
                                          f"steps within --steps")
    if not config.straggler_factor > 1:
        raise TrainConfigError("straggler_factor", f"must be above 1 (a process this many times slower than the median "
                                                   f"of the others is named), got {config.straggler_factor}")
