"""``zerospeed report``: the environment offload depends on, and (with ``--nvme_path``) the disk's bandwidth
through the swapper against its raw sequential rate, with the ``aio`` settings to use (like DeepSpeed's
``ds_report`` and NVMe tuning tool together). ``zerospeed report memory``: the memory timeline of one training step
by phase and owner (``launcher/memory_report.py``)."""

from __future__ import annotations

import argparse
import json
import os

from zerospeed.launcher import memory_report
from zerospeed.launcher.command import Command, UsageError

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", nargs="?", choices=["env", "memory"], default="env",
                        help="env (default): the environment and the disk; memory: one training step's memory "
                        "timeline by phase and owner")
    parser.add_argument("--nvme_path", "--nvme-path", default=None,
                        help="a directory on the disk to measure (files are removed afterwards)")
    parser.add_argument("--size_mb", "--size-mb", type=int, default=1024, help="MiB written and read per setting")
    parser.add_argument("--block_sizes", "--block-sizes", default="262144,1048576,4194304",
                        help="comma-separated aio block sizes to try (bytes, multiples of 4096)")
    parser.add_argument("--threads", default="1,2,4", help="comma-separated aio intra_op_parallelism values to try")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    memory_report.add_arguments(parser)


def _environment() -> dict[str, object]:
    import torch

    import zerospeed

    return {"zerospeed": zerospeed.__version__, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "intra_op_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "fused_cpu_adam": hasattr(torch, "_fused_adamw_"), "o_direct": hasattr(os, "O_DIRECT")}


def run(args: argparse.Namespace) -> int:
    if args.what == "memory":
        return memory_report.run(args)
    env = _environment()
    if args.json:
        print(json.dumps({"environment": env}))
    else:
        for k, v in env.items():
            print(f"{k:>18}: {v}")
    if args.nvme_path is None:
        return 0
    from zerospeed.offload import disk_bench

    try:
        blocks = [int(b) for b in args.block_sizes.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        raise UsageError("--block_sizes and --threads take comma-separated integers") from None
    path = os.path.abspath(args.nvme_path)
    if not os.path.isdir(path):
        raise UsageError(f"--nvme_path {path!r} is not a directory")
    total = args.size_mb * MiB
    try:
        disk_bench.check_space(path, total)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    raw, rates = disk_bench.sweep(path, total, blocks, threads)
    advice = disk_bench.suggest(rates)
    if args.json:
        for r in [raw, *rates]:
            print(json.dumps({**vars(r), "read_vs_raw": r.read_mb_s / raw.read_mb_s,
                              "write_vs_raw": r.write_mb_s / raw.write_mb_s}))
        print(json.dumps({"suggested": advice}))
        return 0
    print(f"\ndisk bandwidth under {path} ({args.size_mb} MiB per setting)")
    print(f"{'':<34}{'block':>9}{'threads':>8}{'write MB/s':>12}{'read MB/s':>11}{'w/raw':>7}{'r/raw':>7}")
    for r in [raw, *rates]:
        print(f"{r.label:<34}{r.block_size // 1024:>8}K{r.threads:>8}{r.write_mb_s:>12.0f}{r.read_mb_s:>11.0f}"
              f"{r.write_mb_s / raw.write_mb_s:>7.2f}{r.read_mb_s / raw.read_mb_s:>7.2f}")
    print("\nsuggested config:\n" + json.dumps(advice, indent=2))
    return 0


COMMAND = Command(
    name="report",
    help="show the environment, measure a disk for NVMe offload, or ('report memory') a step's memory timeline",
    description=__doc__ or "",
    add_arguments=add_arguments,
    run=run,
)
