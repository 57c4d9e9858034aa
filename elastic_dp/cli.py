"""The ``elastic-dp`` command.

    elastic-dp train JOB --workers N --steps S [--global-batch B] [--micro-batch M]
        [--seed X] [--device auto|cpu|cuda] [--checkpoint-dir DIR --checkpoint-every K]
        [--storage URI] [--resume [latest|auto|never]] [--run-name NAME]
        [--out DIR] [--zero 0|1|2|3 --snapshot-every K]
        [--on-nonfinite skip|fail --max-nonfinite-steps N]
    elastic-dp report RUN_DIR [--out DIR]
    elastic-dp release (--node NODE_ID | --actor ACTOR_ID)... [--address ADDR] [--deadline S]
    elastic-dp tokenize TEXT... --out DIR|URI [--tokenizer MODULE:NAME] [--dtype uint16|uint32]
    elastic-dp plan --params 7.5e9 --workers 64 --zero 1 [--gpu-memory 80GB] [--hosts 8 --workers-per-host 8]
        [--precision bf16|fp32] [--optimizer adam|adamw|sgd-momentum|sgd] [--json]

JOB is an importable module that defines ``TASK`` (e.g. ``jobs.gpt``); its defaults
apply to every flag not given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys

from elastic_dp.api import Trainer
from elastic_dp.config import CheckpointConfig, ClusterConfig, MetricsConfig, TrainConfig
from elastic_dp.errors import SURFACE, ConfigError, ElasticDPError, Interrupted, TaskError
from elastic_dp.observe.capacity import MemoryPlan, parse_size, render
from elastic_dp.settings import arguments, declarations
from elastic_dp.task import load_task

CONFIGS = (TrainConfig, ClusterConfig, CheckpointConfig, MetricsConfig)
"""The configs whose declared settings are ``elastic-dp train``'s flags."""

logger = logging.getLogger("elastic_dp.cli")

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
    for config in CONFIGS:
        arguments(train, config)  # each setting's flag, from its declaration (elastic_dp.settings)
    train.add_argument("--inject", action="append", default=[], metavar="SPEC",
                       help="fault injection, repeatable: kill:step=S:rank=R[:phase=forward|gather_forward|"
                            "gather_backward|allreduce|optimizer|snapshot|checkpoint|upload|eval|reform], "
                            "hang:step=S:rank=R, join:step=S, slow:rank=R:factor=F[:from=S][:to=S2], slowlink:ms=M")
    train.add_argument("--out", default=None, help="write initial/final weights, metrics.jsonl, events.jsonl here")
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
    plan.add_argument("--params", default=None, help="parameter count, e.g. 7.5e9 or 125M (or --job)")
    plan.add_argument("--job", default=None, help="a job module (as for train): its model, built on the meta "
                      "device, gives the parameter count and the shapes that --compress needs")
    plan.add_argument("--compress", default=None, metavar="powersgd:rank=R[:start=S][:min-ratio=X]|int8",
                      help="as for train (--zero 0, with --job): the bytes of a compressed step")
    plan.add_argument("--compress-scope", default="all", help="as for train: hosts compresses the hop between the "
                      "hosts alone (--compress int8, --hosts)")
    plan.add_argument("--workers", type=int, default=None, help="data-parallel workers (or --hosts and "
                      "--workers-per-host)")
    plan.add_argument("--hosts", type=int, default=None, help="hosts the workers are spread over: also say the "
                      "bytes each host sends over its link per step (docs/hosts.md)")
    plan.add_argument("--workers-per-host", type=int, default=None, help="workers on each host (with --hosts)")
    plan.add_argument("--zero", type=int, default=0, help="ZeRO stage 0, 1, 2 or 3 (default 0)")
    plan.add_argument("--spares", type=int, default=0, help="warm spares beside the workers (as for train): a "
                      "device each, which must hold a worker's state once promoted")
    plan.add_argument("--shard-scope", default="all", help="with --zero 1-3 and --hosts: the state sharded over every "
                      "worker (all, default) or inside each host with replicas across hosts (host: HSDP)")
    plan.add_argument("--unit-params", default=None,
                      help="stage 3: the largest unit's parameters (e.g. 3.2e9), to add the gathered units")
    plan.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false", default=True,
                      help="stage 3: the units stay gathered from their forward to their backward")
    plan.add_argument("--precision", default="bf16", help="bf16 (mixed, fp32 master) or fp32 (default bf16)")
    plan.add_argument("--param-dtype", default="fp32", help="--zero 3: bf16 gathers fp32 parameters in bf16 (their "
                      "masters fp32, the gradients reduced in fp32), as for train (default fp32)")
    plan.add_argument("--optimizer", default="adam", help="adam, adamw, sgd-momentum or sgd (default adam)")
    plan.add_argument("--gpu-memory", default=None, help="device memory, e.g. 80GB or 80GiB: also say how many "
                                                          "devices the training state needs")
    plan.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _given(args: argparse.Namespace, config: type) -> dict:
    """The settings of ``config`` given on the command line (absent flags are None)."""
    return {name: getattr(args, name) for name, declared in declarations(config).items()
            if (declared.flag or declared.off) and getattr(args, name) is not None}


def _train(args: argparse.Namespace) -> int:
    task = load_task(args.job)
    # absent flags keep the job's defaults; a --mode or --zero that changes the part starts it afresh
    train = dataclasses.replace(task.defaults, **_given(args, TrainConfig))
    low, high = args.workers
    cluster = ClusterConfig(workers=high, min_workers=low, **_given(args, ClusterConfig))
    checkpoint = CheckpointConfig(**_given(args, CheckpointConfig))
    trainer = Trainer(task, train=train, cluster=cluster, checkpoint=checkpoint, out_dir=args.out,
                      progress=args.progress, inject=args.inject, metrics=MetricsConfig(**_given(args, MetricsConfig)))
    # standard output is the summary's: what Ray prints on the driver's stdout while the run
    # trains (its raylet's notes of a worker that died, the workers' own prints) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        summary = trainer.fit()
    print(summary.render())
    return 0


def _plan(args: argparse.Namespace) -> int:
    workers = args.workers
    if args.workers_per_host is not None:
        if args.hosts is None:
            raise ConfigError("--workers-per-host needs --hosts")
        if workers is not None and workers != args.hosts * args.workers_per_host:
            raise ConfigError(f"--workers {workers} is not --hosts {args.hosts} x --workers-per-host "
                              f"{args.workers_per_host}: give one or the other")
        workers = args.hosts * args.workers_per_host
    if workers is None:
        raise ConfigError("give --workers, or --hosts and --workers-per-host")
    params, compressed, once = _job_shapes(args)
    if args.params is not None:  # the job's units say nothing of another count
        params, once = parse_size(args.params, "--params"), 0.0
    if params is None:
        raise ConfigError("give --params (the parameter count) or --job (a job module whose model has them)")
    plan = MemoryPlan(params=params, workers=workers, zero=args.zero, hosts=args.hosts,
                      precision=args.precision, optimizer=args.optimizer,
                      unit_params=parse_size(args.unit_params, "--unit-params") if args.unit_params else None,
                      reshard=args.reshard, gathered_once=once,
                      shard_scope=args.shard_scope, spares=args.spares, compress=args.compress,
                      compressed=compressed, param_dtype=args.param_dtype, compress_scope=args.compress_scope)
    gpu = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory is not None else None
    print(json.dumps(plan.report(gpu), indent=1) if args.json else render(plan, gpu))
    return 0


def _job_shapes(args: argparse.Namespace) -> tuple[float | None, tuple[int, int] | None, float]:
    """``--job``'s model built on the meta device (no memory): its parameter count, with
    ``--compress`` what a compressed step moves (``compression.wire_bytes_per_step``), and at
    ``--zero 3`` the parameters gathered once a step (``units.gathered_once``)."""
    if args.job is None:
        return None, None, 0.0
    import torch

    from elastic_dp.comm.compression import parse_compress, wire_bytes_per_step
    from elastic_dp.comm.settings import Buckets

    task = load_task(args.job)
    with torch.device("meta"):
        model = task.model()
    params = list(model.parameters())
    spec = parse_compress(args.compress)
    compressed = wire_bytes_per_step(params, spec, Buckets()) if spec is not None else None
    once = 0.0
    if args.zero == 3 and args.reshard:
        from elastic_dp.state.units import gathered_once, model_units

        once = float(gathered_once(model, model_units(model, task.shard_units)))
    return float(sum(p.numel() for p in params)), compressed, once


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
    except Interrupted as exc:  # Ctrl-C during the run: where it stopped, and how to go on
        print(f"elastic-dp: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the run had started (its job, Ray's start, the checks)
        print("elastic-dp: interrupted before the run started: nothing was trained or written", file=sys.stderr)
        return 130
    except ElasticDPError as exc:
        print(f"elastic-dp: error: {exc}", file=sys.stderr)
        return 2
    finally:
        SURFACE.reset(surface)


if __name__ == "__main__":
    sys.exit(main())
