"""Run every ``benchmarks/bench_*.py`` in turn with its defaults (``make bench``).

    python benchmarks/run_all.py [--json] [--only dp,cpu_adam]

Each script takes its own options; run one directly to change them. ``--json`` is passed on to every script
(they all print one JSON object per line with it). The ZeRO-Infinity headline (``bench_infinity.py``: a
2B-parameter model, ~30 GB of disk, several minutes per step) and ``bench_memory.py`` (GPT-2-small shape) run only
when named with ``--only infinity`` / ``--only memory``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="pass --json to every benchmark")
    p.add_argument("--only", default="", help="comma-separated names, e.g. 'dp' for bench_dp.py")
    args = p.parse_args()
    only = {f"bench_{n.strip()}.py" for n in args.only.split(",") if n.strip()}
    here = Path(__file__).resolve().parent
    failed = []
    heavy = {"bench_infinity.py", "bench_memory.py"}  # bench_memory: GPT-2-small shape, minutes per step
    for script in sorted(here.glob("bench_*.py")):
        if (only and script.name not in only) or (not only and script.name in heavy):
            continue
        if not args.json:
            print(f"\n== {script.name} ==", flush=True)
        if subprocess.call([sys.executable, str(script), *(["--json"] if args.json else [])]) != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
