"""The ``elastic-dp`` command.

    elastic-dp train JOB --workers N --steps S [--global-batch B] [--micro-batch M]
        [--seed X] [--device auto|cpu|cuda] [--checkpoint-dir DIR --checkpoint-every K]
        [--storage URI] [--resume [latest|auto|never]] [--run-name NAME]
        [--out DIR] [--zero 0|1|2|3 --snapshot-every K]
        [--on-nonfinite skip|fail --max-nonfinite-steps N]
    elastic-dp report RUN_DIR [--out DIR]
    elastic-dp release (--node NODE_ID | --actor ACTOR_ID)... [--address ADDR] [--deadline S]
    elastic-dp tokenize TEXT... --out DIR|URI [--tokenizer MODULE:NAME] [--dtype uint16|uint32]
    elastic-dp plan --params 7.5e9 --workers 64 --zero 1 [--gpu-memory 80GB]
        [--precision bf16|fp32] [--optimizer adam|adamw|sgd-momentum|sgd] [--json]

JOB is an importable module that defines ``TASK`` (e.g. ``jobs.gpt``); its defaults
apply to every flag not given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from elastic_dp.api import Trainer
from elastic_dp.config import CheckpointConfig, ClusterConfig, MetricsConfig
from elastic_dp.errors import SURFACE, ConfigError, ElasticDPError, TaskError
from elastic_dp.observe.plan import MemoryPlan, parse_size, render
from elastic_dp.schedules import SCHEDULES
from elastic_dp.task import load_task

logger = logging.getLogger("elastic_dp.cli")

# flag -> TrainConfig field; absent flags keep the job's defaults
_TRAIN_FLAGS = {"steps": int, "global_batch": int, "micro_batch": int, "seed": int,
                "warmup_steps": int, "lr_schedule": str, "decay_steps": int, "min_lr_ratio": float,
                "decay_fraction": float, "eval_every": int, "eval_batches": int, "lr_reference_batch": int,
                "clip_grad_norm": float,
                "precision": str, "batch_stats": str, "bucket_mb": float, "first_bucket_mb": float, "zero": int, "init": str,
                "snapshot_every": int, "on_nonfinite": str, "max_nonfinite_steps": int, "mode": str,
                "max_staleness": int, "staleness_lr": str, "ps_shards": int, "ps_device": str,
                "sync_every": int, "outer_lr": float, "outer_momentum": float, "outer_reduce": str,
                "fragments": int, "fragment_delay": int}


def _worker_range(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX``."""
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-dp", description="Elastic data-parallel training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a job's task on Ray worker actors")
    train.add_argument("job", help="job module that defines TASK, e.g. jobs.gpt")
    train.add_argument("--workers", type=_worker_range, default=(2, 2), metavar="N|MIN:MAX",
                       help="worker actors: N, or an elastic range MIN:MAX (default 2)")
    for name, kind in _TRAIN_FLAGS.items():
        extra = {"precision": {"choices": ["fp32", "bf16"]}, "zero": {"choices": [0, 1, 2, 3]},
                 "init": {"choices": ["auto", "whole", "units"]},
                 "batch_stats": {"choices": ["local", "global"]},
                 "on_nonfinite": {"choices": ["skip", "fail"]}, "mode": {"choices": ["sync", "async", "diloco"]}, "outer_reduce": {"choices": ["fp32", "bf16"]},
                 "staleness_lr": {"choices": ["none", "inverse"]},
                 "lr_schedule": {"choices": list(SCHEDULES)},
                 "ps_device": {"choices": ["cpu", "cuda"]}}.get(name, {})
        train.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                           help=f"override the job's {name}", **extra)
    train.add_argument("--no-reduce-fp32", dest="reduce_fp32", action="store_false", default=None,
                       help="reduce bf16 gradients in bf16 instead of fp32")
    train.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                       default=None, help="--zero 3: keep each unit's gathered parameters from its forward to its backward")
    train.add_argument("--no-outer-nesterov", dest="outer_nesterov", action="store_false", default=None,
                       help="--mode diloco: plain momentum in the outer SGD instead of Nesterov's")
    train.add_argument("--activation-checkpointing", action="store_true", default=None,
                       help="recompute each shard unit's activations in its backward (any --zero stage)")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    train.add_argument("--gpus-per-worker", type=float, default=1.0,
                       help="with cuda, each worker's share of a GPU in (0, 1]; below 1 workers share GPUs over gloo")
    train.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                       help="collective backend (auto: NCCL for whole GPUs, else gloo)")
    train.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or embedded local Ray)")
    train.add_argument("--placement-timeout", type=float, default=60.0, help="seconds to wait for worker slots")
    train.add_argument("--step-timeout", type=float, default=600.0,
                       help="deadline of one step, seconds: the last backstop behind hang detection")
    train.add_argument("--heartbeat-timeout", type=float, default=5.0,
                       help="seconds a worker may leave a heartbeat unanswered before it counts as frozen")
    train.add_argument("--stall-floor", type=float, default=5.0,
                       help="a worker that makes no progress while its peers wait for it is hung after "
                            "max(this, --stall-factor x median step time) seconds (async: in a gradient, "
                            "x the larger of the run's and its own median gradient time)")
    train.add_argument("--stall-factor", type=float, default=4.0, help="see --stall-floor")
    train.add_argument("--collective-timeout", type=float, default=300.0, help="timeout of one collective, seconds")
    train.add_argument("--min-wait-timeout", type=float, default=300.0,
                       help="below MIN workers, seconds to wait for capacity before failing")
    train.add_argument("--abort-grace", type=float, default=10.0,
                       help="seconds a worker may take to leave an aborted step before it counts as hung")
    train.add_argument("--leave-grace", type=float, default=25.0,
                       help="a worker sent SIGTERM leaves at the next step boundary; seconds it waits to be let "
                            "go before it exits on its own")
    train.add_argument("--prefetch", dest="prefetch", action="store_true", default=None,
                       help="collate the next step's batch on a background thread (default: on a GPU only)")
    train.add_argument("--no-prefetch", dest="prefetch", action="store_false")
    train.add_argument("--balance", dest="balance", action="store_true", default=None,
                       help="slices of each step's batch follow the workers' measured speed (stragglers get fewer)")
    train.add_argument("--inject", action="append", default=[], metavar="SPEC",
                       help="fault injection, repeatable: kill:step=S:rank=R[:phase=forward|allreduce|"
                            "optimizer|snapshot|checkpoint|upload|reform], hang:step=S:rank=R, join:step=S, "
                            "slow:rank=R:factor=F[:from=S][:to=S2]")
    train.add_argument("--checkpoint-dir", default=None, help="local directory (or shared mount) for checkpoints")
    train.add_argument("--storage", default=None, metavar="URI",
                       help="checkpoints under URI/RUN_NAME: a path or a pyarrow filesystem URI such as "
                            "s3://bucket/prefix?endpoint_override=host:port (implies --resume auto)")
    train.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (0: at the end only)")
    train.add_argument("--checkpoint-keep", type=int, default=3)
    train.add_argument("--sync-checkpoints", dest="async_checkpoints", action="store_false",
                       help="write checkpoints on the training thread (default: in the background)")
    train.add_argument("--resume", nargs="?", const="latest", default=None, choices=["latest", "auto", "never"],
                       help="continue from the latest checkpoint (which must exist); 'auto': from this run's latest "
                            "if there is one, else start fresh (the default with --storage); 'never'")
    train.add_argument("--out", default=None, help="write initial/final weights, metrics.jsonl, events.jsonl here")
    train.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="also write TensorBoard event files (scalars per step, membership changes) here")
    train.add_argument("--run-name", default=None,
                       help="the run's name: its checkpoints' prefix under --storage and the run tag of its Ray "
                            "metrics (default: the job's name and a hash of the settings that make it this run)")
    train.add_argument("--no-ray-metrics", dest="ray_metrics", action="store_false",
                       help="do not export the run's figures as Ray metrics")
    train.add_argument("--peak-tflops", type=float, default=None,
                       help="peak dense TFLOP/s of one worker's device, for model FLOPs utilisation "
                            "(default: known GPUs' bf16 peak; none on CPUs)")
    train.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="force the progress bar (default: when stderr is a terminal)")
    train.add_argument("--no-progress", dest="progress", action="store_false")

    report = sub.add_parser("report", help="plots and report.md from a run directory (--out of train)")
    report.add_argument("run_dir", help="the directory a run wrote with --out (metrics.jsonl, events.jsonl)")
    report.add_argument("--out", default=None, help="where to write the plots and report.md (default RUN_DIR/report)")

    tokenize = sub.add_parser("tokenize", help="write token files (a corpus larger than memory) from text files")
    tokenize.add_argument("inputs", nargs="+", help="text files, in order (their bytes are concatenated)")
    tokenize.add_argument("--out", required=True, help="a directory or pyarrow.fs URI (s3://bucket/prefix?...)")
    tokenize.add_argument("--tokenizer", default=None, metavar="MODULE:NAME",
                          help="an importable callable text -> list of token ids (default: bytes, as jobs.gpt)")
    tokenize.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16",
                          help="token id type (uint32 for vocabularies over 65,536)")
    tokenize.add_argument("--file-tokens", type=int, default=1 << 26, help="tokens per file (default 2^26)")

    release = sub.add_parser("release", help="ask running runs to let workers go at their next step boundary "
                                             "(maintenance: a planned leave, as for a drain)")
    release.add_argument("--node", action="append", default=[], metavar="NODE_ID",
                         help="every worker on this Ray node (hex id, `ray list nodes`); repeatable")
    release.add_argument("--actor", action="append", default=[], metavar="ACTOR_ID",
                         help="this worker actor (hex id, `ray list actors --filter class_name=WorkerActor`); "
                              "repeatable")
    release.add_argument("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else auto)")
    release.add_argument("--deadline", type=float, default=None, metavar="S",
                         help="seconds until the workers must be gone (default: none, the next step boundary)")
    release.add_argument("--reason", default="maintenance", help="recorded in the run's membership_changed event")

    plan = sub.add_parser("plan", help="per-worker memory and communication for a model size and ZeRO stage")
    plan.add_argument("--params", required=True, help="parameter count, e.g. 7.5e9 or 125M")
    plan.add_argument("--workers", type=int, required=True, help="data-parallel workers")
    plan.add_argument("--zero", type=int, default=0, help="ZeRO stage 0, 1, 2 or 3 (default 0)")
    plan.add_argument("--unit-params", default=None,
                      help="stage 3: the largest unit's parameters (e.g. 3.2e9), to add the gathered units")
    plan.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false", default=True,
                      help="stage 3: the units stay gathered from their forward to their backward")
    plan.add_argument("--precision", default="bf16", help="bf16 (mixed, fp32 master) or fp32 (default bf16)")
    plan.add_argument("--optimizer", default="adam", help="adam, adamw, sgd-momentum or sgd (default adam)")
    plan.add_argument("--gpu-memory", default=None, help="device memory, e.g. 80GB or 80GiB: also say how many "
                                                          "devices the training state needs")
    plan.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _train(args: argparse.Namespace) -> int:
    task = load_task(args.job)
    flags = [*_TRAIN_FLAGS, "reduce_fp32", "reshard_after_forward", "activation_checkpointing", "prefetch", "balance",
             "outer_nesterov"]
    overrides = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
    train = dataclasses.replace(task.defaults, **overrides)
    low, high = args.workers
    cluster = ClusterConfig(workers=high, min_workers=low, device=args.device, address=args.address,
                            gpus_per_worker=args.gpus_per_worker, backend=args.backend,
                            placement_timeout_s=args.placement_timeout, step_timeout_s=args.step_timeout,
                            collective_timeout_s=args.collective_timeout, min_wait_timeout_s=args.min_wait_timeout,
                            abort_grace_s=args.abort_grace, heartbeat_timeout_s=args.heartbeat_timeout,
                            stall_floor_s=args.stall_floor, stall_factor=args.stall_factor,
                            leave_grace_s=args.leave_grace)
    checkpoint = CheckpointConfig(dir=args.checkpoint_dir, storage=args.storage, every=args.checkpoint_every,
                                  resume=args.resume, keep=args.checkpoint_keep,
                                  asynchronous=args.async_checkpoints)
    summary = Trainer(task, train=train, cluster=cluster, checkpoint=checkpoint,
                      out_dir=args.out, progress=args.progress, inject=args.inject,
                      metrics=MetricsConfig(peak_tflops=args.peak_tflops, tensorboard=args.tensorboard,
                                            ray_metrics=args.ray_metrics, name=args.run_name)).fit()
    print(summary.render())
    return 0


def _plan(args: argparse.Namespace) -> int:
    plan = MemoryPlan(params=parse_size(args.params, "--params"), workers=args.workers, zero=args.zero,
                      precision=args.precision, optimizer=args.optimizer,
                      unit_params=parse_size(args.unit_params, "--unit-params") if args.unit_params else None,
                      reshard=args.reshard)
    gpu = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory is not None else None
    print(json.dumps(plan.report(gpu), indent=1) if args.json else render(plan, gpu))
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from elastic_dp.tokens import byte_tokens, load_tokenizer, text_pieces, write_token_files

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else byte_tokens
    for path in args.inputs:
        if not os.path.isfile(path):
            raise TaskError(f"{path} is not a file: pass text files to elastic-dp tokenize")
    texts = (piece for path in args.inputs for piece in text_pieces(path, binary=args.tokenizer is None))
    index = write_token_files(texts, args.out, tokenizer=tokenizer, dtype=args.dtype, file_tokens=args.file_tokens,
                              tokenizer_name=args.tokenizer or "bytes")
    print(f"wrote {index['tokens']} tokens in {len(index['files'])} files to {args.out}")
    return 0


def _release(args: argparse.Namespace) -> int:
    import time

    import ray

    from elastic_dp.api import check_reachable
    from elastic_dp.messages import LeaveNotice
    from elastic_dp.worker.leave import announce

    if not args.node and not args.actor:
        raise ConfigError("elastic-dp release needs the workers to let go: --node NODE_ID or --actor ACTOR_ID")
    if args.deadline is not None and args.deadline <= 0:
        raise ConfigError(f"--deadline must be positive seconds, got {args.deadline}")
    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(address, "--address" if args.address else "RAY_ADDRESS")
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        deadline = None if args.deadline is None else time.time() + args.deadline
        for kind, ids in (("node", args.node), ("actor", args.actor)):
            for ident in ids:
                announce(kind, ident, LeaveNotice("release", f"released by the user ({args.reason}): {kind} "
                                                             f"{ident[:12]}", deadline))
                print(f"asked for the workers of {kind} {ident} to be let go")
    finally:
        ray.shutdown()
    return 0


def _report(args: argparse.Namespace) -> int:
    from elastic_dp.observe.report import write_report  # matplotlib only when a report is drawn
    out = write_report(args.run_dir, args.out)
    print(f"wrote {out / 'report.md'} and its plots")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    surface = SURFACE.set("cli")  # errors name this command's flags, not the API's fields
    try:
        return {"plan": _plan, "release": _release, "report": _report, "tokenize": _tokenize,
                "train": _train}[args.command](args)
    except ElasticDPError as exc:
        print(f"elastic-dp: error: {exc}", file=sys.stderr)
        return 2
    finally:
        SURFACE.reset(surface)


if __name__ == "__main__":
    sys.exit(main())
