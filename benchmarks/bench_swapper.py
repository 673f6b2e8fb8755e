"""Benchmark 2 of ZeRO-Offload: the swapper's read and write bandwidth against the disk's raw sequential
bandwidth, measured in the same run (target: at least 80% of raw), for several ``aio`` settings.

Raw: one thread, 8 MiB O_DIRECT requests, fsync (like ``dd oflag=direct``). Swapper: 64 MiB buffers (as the
offloaded optimizer's sub-groups are) written then read through ``AsyncSwapper`` with each
(block_size, intra_op_parallelism). The same numbers come from ``zerospeed report --nvme_path DIR``.

    python benchmarks/bench_swapper.py [--dir /work] [--size_mb 1024] [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from zerospeed.offload import disk_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work")
    ap.add_argument("--size_mb", type=int, default=1024)
    ap.add_argument("--block_sizes", default="1048576,4194304")
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; the median of each figure is kept")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    total = args.size_mb * disk_bench.MiB
    disk_bench.check_space(args.dir, total)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rounds = [disk_bench.sweep(args.dir, total, blocks, threads) for _ in range(args.repeat)]
    raw = disk_bench.Rate("raw sequential (dd-like)", rounds[0][0].block_size, 1,
                          statistics.median(r[0].write_mb_s for r in rounds),
                          statistics.median(r[0].read_mb_s for r in rounds))
    rates = []
    for i, first in enumerate(rounds[0][1]):
        rates.append(disk_bench.Rate(first.label, first.block_size, first.threads,
                                     statistics.median(r[1][i].write_mb_s for r in rounds),
                                     statistics.median(r[1][i].read_mb_s for r in rounds)))
    rows = [{**vars(r), "write_vs_raw": r.write_mb_s / raw.write_mb_s, "read_vs_raw": r.read_mb_s / raw.read_mb_s}
            for r in [raw, *rates]]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"suggested": disk_bench.suggest(rates)}))
        return
    print(f"disk under {args.dir}: {args.size_mb} MiB per setting, median of {args.repeat} rounds")
    print(f"{'':<30}{'block':>9}{'threads':>8}{'write MB/s':>12}{'read MB/s':>11}{'w/raw':>7}{'r/raw':>7}")
    for row in rows:
        print(f"{row['label']:<30}{row['block_size'] // 1024:>8}K{row['threads']:>8}{row['write_mb_s']:>12.0f}"
              f"{row['read_mb_s']:>11.0f}{row['write_vs_raw']:>7.2f}{row['read_vs_raw']:>7.2f}")
    print("suggested:", json.dumps(disk_bench.suggest(rates)))


if __name__ == "__main__":
    main()
