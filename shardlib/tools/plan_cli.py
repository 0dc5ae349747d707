"""`shardlib plan`'s command line: its flags, and one plan per ``--topology`` (or for ``--devices``),
printed as tables or one JSON document, with an optional plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from shardlib.backend import parse_options
from shardlib.tools import hardware as hw
from shardlib.tools import plan_lora
from shardlib.tools.plan import Planner
from shardlib.tools.plan_candidates import ALL_STRATEGIES, HPZ_STRATEGIES, PRECISIONS, PlanError, setup_devices
from shardlib.tools.plan_report import plan_document, render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model config name (models.CONFIGS), e.g. llama-7b, or a Hugging "
                                                       "Face config.json or model directory (the shapes only)")
    parser.add_argument("--devices", type=int, help="number of devices to plan for (simulated CPU devices)")
    parser.add_argument("--topology", nargs="+", metavar="NAME",
                        help="plan with the real TPU compiler for a TPU slice, JAX's names: v5e:2x4, v5p:4x4x4, "
                             "v6e:8x8 (needs jax[tpu]); several names plan each (with --plot: against chip count)")
    parser.add_argument("--slices", type=int, default=1, help="--topology: that many slices joined by DCN")
    parser.add_argument("--plot", metavar="FILE.png", help="draw per-chip memory and estimated step time against "
                                                           "chip count (one point per --topology or --devices run)")
    parser.add_argument("--cache-dir", help="where compiled candidates are kept, so a rerun plan skips compiling "
                                            "(default $SHARDLIB_PLAN_CACHE or ~/.cache/shardlib/jax; 'none': off)")
    from shardlib.sharding.strategies import STRATEGIES

    parser.add_argument("--strategy", nargs="+", action="extend", metavar="S",
                        help=f"strategies to compare, any of {', '.join(STRATEGIES)} (default: "
                             f"{', '.join(ALL_STRATEGIES)}, and {', '.join(HPZ_STRATEGIES)} when the devices span "
                             "more than one link domain)")
    parser.add_argument("--all", action="store_true", help="every strategy on its default mesh for N devices")
    parser.add_argument("--mesh", help="one mesh for every strategy, e.g. data=2,fsdp=4 (default: per strategy)")
    parser.add_argument("--batch-size", type=int, help="global sequences per step (default: one per device)")
    parser.add_argument("--batch-per-device", type=int, metavar="B",
                        help="sequences per device per step (the global batch is B x devices), as published runs state it")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's max_seq_len)")
    parser.add_argument("--dump-hlo", metavar="DIR", help="write each candidate's compiled HLO text to DIR "
                        "(<strategy>_<mesh>.hlo.txt): a Pallas kernel shows as tpu_custom_call")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="f32", help="compute dtype")
    parser.add_argument("--pipeline-stages", type=int, default=1, metavar="S",
                        help="add a pipe=S axis to every candidate's default mesh (or give pipe in --mesh)")
    parser.add_argument("--microbatches", type=int, metavar="M", help="pipeline microbatches (default 2 x stages)")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule")
    parser.add_argument("--stage-layers", metavar="auto|N,N",
                        help="layers per pipeline stage (auto: balance the compiled stage costs; default even)")
    parser.add_argument("--offload", default="none", choices=["none", "opt_state"],
                        help="keep the optimizer state in host memory (ZeRO-Offload, docs/offload.md)")
    parser.add_argument("--hbm", type=_hbm_flag, help="memory per device with its unit, e.g. 80GB or 16GiB "
                                                      "(default: the hardware's)")
    parser.add_argument("--hardware", help=f"profile for the time estimate: {', '.join(hw.HARDWARE)} (default: "
                                           "the --topology's generation, else h100)")
    parser.add_argument("--no-remat", action="store_true", help="plan without rematerialisation (--remat none)")
    parser.add_argument("--remat", choices=["none", "full", "save_dots_except_mlp_in", "save_dots", "offload_dots"],
                        help="what each block keeps for the backward pass (docs/tpu.md, \"Remat policies\"; default: "
                             "the model's, full)")
    parser.add_argument("--xla-options", metavar="NAME=VALUE,...",
                        help="XLA options every step compiles with, over the backend's own (on TPU the collective "
                             "options of docs/tpu.md) and over LIBTPU_INIT_ARGS")
    plan_lora.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def _hbm_flag(text: str) -> int:
    """``--hbm`` in bytes, read before JAX starts; a size without a unit is a usage error."""
    try:
        return hw.parse_bytes(text)
    except hw.HardwareError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    if args.all and args.strategy:
        raise PlanError("give --strategy or --all, not both")
    if args.devices is None and not args.topology:
        raise PlanError("give --devices N (simulated CPU devices) or --topology NAME (a TPU slice, e.g. v5e:2x4)")
    if args.hardware is not None:
        hw.get_hardware(args.hardware)  # unknown hardware: fail before JAX starts
    if args.batch_per_device is not None and args.batch_size is not None:
        raise PlanError("give --batch-size or --batch-per-device, not both")
    setup_devices(1 if args.topology else args.devices)
    cache_dir = plan_cache_dir(args.cache_dir)
    documents = []
    for topology in args.topology or [None]:
        planner = Planner(args.model, args.devices, batch_size=args.batch_size, seq_len=args.seq_len,
                          batch_per_device=args.batch_per_device,
                          precision=args.precision, hardware=args.hardware, hbm=args.hbm,
                          remat=False if args.no_remat else args.remat, pipeline_stages=args.pipeline_stages,
                          microbatches=args.microbatches, schedule=args.schedule, offload=args.offload,
                          stage_layers=_stage_layers_flag(args.stage_layers), topology=topology, slices=args.slices,
                          cache_dir=cache_dir, compiler_options=_options_flag(args.xla_options),
                          lora=plan_lora.from_args(args, PlanError), dump_hlo=args.dump_hlo)
        if planner.topology_note:
            print(f"shardlib plan: note: {planner.topology_note}", file=sys.stderr, flush=True)
        planner.progress = lambda line: print(f"shardlib plan: {line}", file=sys.stderr, flush=True)
        rows = planner.run(None if args.all else args.strategy, args.mesh)
        advice = planner.advise(rows)
        documents.append(plan_document(planner, rows, advice))
        if not args.json:
            print(render(planner, rows, advice))
    if args.json:
        json.dump(documents[0] if len(documents) == 1 else {"plans": documents}, sys.stdout, indent=1)
        print()
    if args.plot:
        from shardlib.tools.plan_plot import plot_plans

        print(f"plot: {plot_plans(documents, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    ok = [c for d in documents for c in d["candidates"] if c["error"] is None]
    return 0 if ok else 1


def plan_cache_dir(cache_dir: str | None) -> str | None:
    """The folder that keeps the plan's compiles (minutes each for a large model on a large
    topology), so planning the same candidates again reads them back: ``--cache-dir``, else
    ``$SHARDLIB_PLAN_CACHE``, else ``~/.cache/shardlib/jax``; None when either says ``none``."""
    folder = cache_dir or os.environ.get("SHARDLIB_PLAN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardlib", "jax")
    return None if folder == "none" else folder


def _options_flag(text: str | None) -> dict[str, str]:
    try:
        return parse_options(text)
    except ValueError as err:
        raise PlanError(f"--xla-options: {err}") from None


def _stage_layers_flag(text: str | None) -> Any:
    from shardlib.step.stage_balance import parse_stage_layers

    try:
        return parse_stage_layers(text)
    except ValueError as err:
        raise PlanError(str(err)) from None
