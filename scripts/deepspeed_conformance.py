"""Run DeepSpeed's own CPU unit tests against zerospeed and print how many pass (``scripts/deepspeed-conformance``).

The tests run from a DeepSpeed checkout outside this project (``tests/unit``), one pytest process per
area, with ``deepspeed`` renamed to ``zerospeed`` by an import hook and DeepSpeed's ``DistributedTest``
harness patched only to fork ranks and to fail (not hang) on a stuck rank
(``deepspeed_conformance_plugin.py``). N is the list of tests DeepSpeed 0.19.8 itself passes on this
machine (``deepspeed_conformance_passing.txt``, written by ``--record`` with real DeepSpeed in another venv).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from typing import IO
from pathlib import Path

HERE = Path(__file__).resolve().parent
PASSING = HERE / "deepspeed_conformance_passing.txt"
SPLIT = ("runtime", "v1")  # areas split one folder deeper
SUMMARY = "DeepSpeed unit tests under zerospeed: {p} of {n}"


def area_of(nodeid: str) -> str:
    """``unit/runtime/zero/test_x.py::T::t`` -> ``runtime/zero``; ``unit/ops/adam/x.py`` -> ``ops``."""
    parts = nodeid.split("::")[0].split("/")
    dirs = parts[1:-1] if parts[0] == "unit" else parts[:-1]
    if not dirs:
        return "unit"
    return "/".join(dirs[:2]) if dirs[0] in SPLIT else dirs[0]


def read_ids(path: Path) -> list[str]:
    """Test ids from a data file: one per line, ``#`` comments and blank lines ignored."""
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def tally(reference: Iterable[str], outcomes: dict[str, str], areas: Iterable[str] | None = None) -> dict:
    """Per area: N (reference passes in the areas run), P (of those, passing here), and outcome counts.

    A reference test that did not run here (its module failed to import, or it was deselected by -k)
    counts in N only when ``outcomes`` saw its module; with ``areas`` given, N covers those areas.
    """
    ref = [t for t in reference if areas is None or area_of(t) in set(areas)]
    rows: dict[str, dict[str, int]] = {}
    for tid in ref:
        row = rows.setdefault(area_of(tid), {"N": 0, "P": 0, "failed": 0, "skipped": 0, "not run": 0})
        row["N"] += 1
        outcome = outcomes.get(tid)
        if outcome == "passed":
            row["P"] += 1
        elif outcome in ("failed", "skipped"):
            row[outcome] += 1
        else:
            row["not run"] += 1
    return dict(sorted(rows.items()))


def format_table(rows: dict) -> str:
    """The table by area and the summary line."""
    cols = ["P", "N", "failed", "skipped", "not run"]
    width = max([len("area")] + [len(a) for a in rows])
    lines = [f"{'area':<{width}}  " + "  ".join(f"{c:>7}" for c in cols)]
    for area, row in rows.items():
        lines.append(f"{area:<{width}}  " + "  ".join(f"{row[c]:>7}" for c in cols))
    p, n = sum(r["P"] for r in rows.values()), sum(r["N"] for r in rows.values())
    lines.append(SUMMARY.format(p=p, n=n))
    return "\n".join(lines)


def default_areas(checkout: Path) -> list[str]:
    """The test folders under ``tests/unit`` (those in SPLIT one level deeper), as area names."""
    unit = checkout / "tests" / "unit"
    areas = []
    for d in sorted(p for p in unit.iterdir() if p.is_dir() and not p.name.startswith("__")):
        subs = sorted(s for s in d.iterdir() if s.is_dir() and not s.name.startswith("__"))
        if d.name in SPLIT:
            areas.append(f"{d.name}/*.py")
            areas += [f"{d.name}/{s.name}" for s in subs]
        else:
            areas.append(d.name)
    return areas


def run_area(checkout: Path, area: str, args: argparse.Namespace, out: Path) -> dict[str, str]:
    """One pytest process over one area; returns its outcomes (nodeid -> passed/failed/skipped)."""
    tests = checkout / "tests"
    targets = [str(p.relative_to(tests)) for p in sorted((tests / "unit").glob(area))]
    if area.endswith(".py") is False and (tests / "unit" / area).is_dir():
        targets = [f"unit/{area}"]
    if not targets:
        return {}
    mode = "deepspeed" if args.record else "zerospeed"
    src = HERE.parent / "src"
    env = dict(os.environ, ZS_CONFORMANCE_MODE=mode, ZS_CONFORMANCE_OUT=str(out),
               ZS_CONFORMANCE_TIMEOUT=str(args.timeout), DS_ACCELERATOR="cpu",
               LOCAL_SIZE=str(args.local_size), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(
                   [str(HERE)] + ([] if args.record else [str(src)]) + [os.environ.get("PYTHONPATH", "")]))
    cmd = [args.python or sys.executable, "-m", "pytest", "-p", "deepspeed_conformance_plugin", "-q",
           "-p", "no:cacheprovider", "--continue-on-collection-errors", *targets, *(["-k", args.k] if args.k else []), *args.pytest_args]
    with open(args.log, "a") as log:
        log.write(f"\n===== {area}: {' '.join(cmd)}\n")
        log.flush()
        if not run_bounded(cmd, tests, env, log, args.area_timeout):
            log.write(f"\n===== {area}: stopped after {args.area_timeout} s\n")
    return json.loads(out.read_text()) if out.exists() else {}


def run_bounded(cmd: list[str], cwd: Path, env: dict[str, str], log: IO[str], timeout: float) -> bool:
    """Run ``cmd`` in its own session; past ``timeout`` kill the whole session (pytest and the ranks its
    harness forked, which would otherwise outlive it), returning False."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deepspeed-conformance", description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path, help="a DeepSpeed checkout (tests/unit is read from it)")
    p.add_argument("--area", action="append", help="area(s) to run, e.g. runtime/zero, ops (default: all)")
    p.add_argument("-k", help="pytest -k expression, passed through")
    p.add_argument("--record", action="store_true",
                   help="run real DeepSpeed (--python of a venv that has it) and store its passing ids")
    p.add_argument("--python", help="interpreter to run pytest with (default: this one)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per distributed test")
    p.add_argument("--local-size", type=int, default=4,
                   help="LOCAL_SIZE for the parent: the CPU 'devices' DeepSpeed's harness may use (ranks per test)")
    p.add_argument("--area-timeout", type=float, default=3600.0, help="seconds per area")
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "deepspeed-conformance.log"))
    p.add_argument("--results", type=Path, help="also write every outcome here (JSON)")
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    return p.parse_args(argv)


def record(rows_outcomes: dict[str, str], areas: list[str], selected: bool = False, path: Path = PASSING) -> None:
    """Replace the stored passing ids of the areas just run with this run's passes; with ``selected`` (a -k
    run) only the ids of the tests that ran are replaced, the rest of their areas is kept."""
    run_areas = {area_of(t) for t in rows_outcomes} | {a.replace("/*.py", "") for a in areas}
    stored = read_ids(path)
    kept = [t for t in stored if t not in rows_outcomes] if selected else [t for t in stored
                                                                             if area_of(t) not in run_areas]
    passed = [t for t, o in rows_outcomes.items() if o == "passed"]
    header = ("# Tests DeepSpeed 0.19.8 itself passes here (DS_ACCELERATOR=cpu, Gloo), DeepSpeed tests at\n"
              "# commit edaa7221; written by scripts/deepspeed-conformance --record. Test ids, not code.\n")
    path.write_text(header + "\n".join(sorted(set(kept + passed))) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / "tests" / "unit" / "common.py").exists():
        sys.exit(f"deepspeed-conformance: {checkout} has no tests/unit/common.py (not a DeepSpeed checkout)")
    areas = args.area or default_areas(checkout)
    outcomes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, area in enumerate(areas):
            got = run_area(checkout, area, args, Path(tmp) / f"{i}.json")
            outcomes.update(got)
            if args.record:  # stored area by area: an interrupted recording keeps what it finished
                record(got, [area], selected=bool(args.k))
            print(f"{area}: {sum(o == 'passed' for o in got.values())} passed of {len(got)} run", flush=True)
    if args.results:
        args.results.write_text(json.dumps(outcomes, indent=0, sort_keys=True))
    if args.record:
        print(f"recorded {sum(o == 'passed' for o in outcomes.values())} passing ids in {PASSING}")
        return 0
    names = {a.replace("/*.py", "") for a in areas}
    print(format_table(tally(read_ids(PASSING), outcomes, names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
