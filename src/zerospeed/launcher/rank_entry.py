"""What each rank runs first: record this rank's pid, run the user's script, report how it failed.

``zerospeed launch`` asks torchrun to start ``python -u <this file> <script> <args...>`` on every rank.
This file runs *by path*, not as ``zerospeed.launcher.rank_entry``, so nothing of the ``zerospeed`` package
(nor ``torch``) is imported before the user's script: a script may still set ``CUDA_VISIBLE_DEVICES`` or
``OMP_NUM_THREADS`` before its own ``import torch``. It uses the standard library only.

Why a wrapper: torchrun tells the exit code of a dead rank but not its Python traceback, unless the user's
entry point is decorated with torch's ``@record``. Here every rank, when ``ZEROSPEED_LAUNCH_DIR`` is set,
writes into that directory:

- ``rank_<RANK>.pid``  at start: ``{"pid", "rank", "local_rank", "start"}``, so the launcher can find and
  kill any rank left alive after torchrun ends (no orphans, whatever happened to the agent);
- ``rank_<RANK>.err``  when the script raises or calls ``sys.exit(nonzero)``: ``{"rank", "exitcode", "time",
  "error", "traceback"}``, written atomically. A rank that dies without Python noticing (``os._exit``, a
  signal, a segfault) writes nothing; the launcher then takes its exit code from torchrun.

The script sees the same ``sys.argv``, ``sys.path[0]`` and ``__main__`` as under ``python script.py``
(or ``python -m module`` with ``--module``). With ``ZEROSPEED_PASS_LOCAL_RANK=1`` the argument
``--local_rank=<LOCAL_RANK>`` is put before the script's own arguments, as DeepSpeed's launcher does.
With ``ZEROSPEED_BIND_CORES`` set (``--bind_cores_to_rank``; its value is ``--bind_core_list`` or empty for
every core this process may use) the rank pins itself to its equal share of the cores, in order, and sets
``OMP_NUM_THREADS`` to that share before the script imports torch (DeepSpeed's numactl split).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    # Run by path, Python put this file's folder first on sys.path: drop it so that nothing in it can
    # shadow a module imported below or by the user's script. The script's own folder goes there instead.
    del sys.path[0]

import json
import runpy
import time
import traceback
from types import TracebackType

LAUNCH_DIR_ENV = "ZEROSPEED_LAUNCH_DIR"
PASS_LOCAL_RANK_ENV = "ZEROSPEED_PASS_LOCAL_RANK"
MODULE_ENV = "ZEROSPEED_RUN_MODULE"
BIND_CORES_ENV = "ZEROSPEED_BIND_CORES"
TRACEBACK_LINES = 12


def _write_json(path: str, data: dict[str, object]) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, then rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading frames of this wrapper and of ``runpy``: the user sees their own frames only."""
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if os.path.abspath(name) != here and "runpy" not in name:
            break
        tb = tb.tb_next
    return tb


def _report_failure(launch_dir: str, rank: int, exitcode: int, error: str, lines: list[str]) -> None:
    tail = "".join(lines).rstrip("\n").splitlines()[-TRACEBACK_LINES:]
    data: dict[str, object] = {
        "rank": rank,
        "exitcode": exitcode,
        "time": time.time(),
        "pid": os.getpid(),
        "error": error,
        "traceback": tail,
    }
    try:
        _write_json(os.path.join(launch_dir, f"rank_{rank}.err"), data)
    except OSError:
        pass  # reporting is best effort; the rank's own stderr still has the traceback


def _exit_code(code: object) -> int:
    """The process exit code Python gives for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _put_first_on_path(folder: str) -> None:
    """What ``python script.py`` / ``python -m`` does with sys.path (nothing under ``-P``/PYTHONSAFEPATH)."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, folder)


def _run_target(target: str, as_module: bool, args: list[str]) -> None:
    if as_module:
        sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
        _put_first_on_path(os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(target)
        sys.argv = [target, *args]
        _put_first_on_path(os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


def parse_core_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (DeepSpeed's ``--bind_core_list`` syntax)."""
    cores: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"--bind_core_list: bad range {part!r} (expected e.g. 0-3,8,10-11)")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def cores_for_rank(cores: list[int], local_rank: int, local_world: int) -> list[int]:
    """This rank's equal, contiguous share of ``cores`` (the remainder stays unused, as in DeepSpeed)."""
    share = len(cores) // local_world
    if share < 1:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} cores cannot be shared by {local_world} ranks per node")
    return cores[share * local_rank:share * (local_rank + 1)]


def _bind_cores(spec: str) -> None:
    available = sorted(os.sched_getaffinity(0))
    cores = parse_core_list(spec) if spec else available
    mine = cores_for_rank(cores, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))


DEEPSPEED_IMPORT_HINT = (
    "zerospeed serves DeepSpeed's import paths under the name 'zerospeed' (`from zerospeed.runtime.utils import "
    "...`); `import zerospeed as deepspeed` renames only that one name, so `from deepspeed.x import y` stays "
    "unresolved. Run `zerospeed alias install` once to make `import deepspeed` and its submodules resolve to "
    "zerospeed (docs/migration.md, step 1)")


def _hint_deepspeed_import(e: BaseException) -> None:
    """A script written for DeepSpeed failing on ``import deepspeed``: say what fixes it, under the error."""
    name = getattr(e, "name", None) or ""
    if not isinstance(e, ModuleNotFoundError) or not (name == "deepspeed" or name.startswith("deepspeed.")):
        return
    if getattr(sys.modules.get("deepspeed"), "__zerospeed_alias__", False):  # the alias works; this path is missing
        e.msg = f"{e.msg}: zerospeed does not serve DeepSpeed's module '{name}' yet (`zerospeed alias` is active)"
    else:
        e.msg = f"{e.msg}. {DEEPSPEED_IMPORT_HINT}"  # in the headline the launcher prints, not only below it
    e.args = (e.msg,)


def main() -> int:
    """Run ``sys.argv[1]`` (a script, or a module when ``ZEROSPEED_RUN_MODULE=1``) as ``__main__``."""
    if len(sys.argv) < 2:
        print("usage: rank_entry.py SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    target, args = sys.argv[1], sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get(PASS_LOCAL_RANK_ENV) == "1":
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    if BIND_CORES_ENV in os.environ:
        _bind_cores(os.environ[BIND_CORES_ENV])
    launch_dir = os.environ.get(LAUNCH_DIR_ENV, "")
    if launch_dir:
        info = {"pid": os.getpid(), "rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "start": time.time()}
        _write_json(os.path.join(launch_dir, f"rank_{rank}.pid"), info)
    try:
        _run_target(target, os.environ.get(MODULE_ENV) == "1", args)
    except SystemExit as e:
        code = _exit_code(e.code)
        if code != 0 and launch_dir:
            message = "" if isinstance(e.code, int) or e.code is None else f": {e.code}"
            _report_failure(launch_dir, rank, code, f"SystemExit({e.code!r}){message}", [])
        raise
    except BaseException as e:  # noqa: BLE001 - report every way the script can fail, then fail the same way
        _hint_deepspeed_import(e)
        tb = _user_traceback(e.__traceback__)
        lines = traceback.format_exception(type(e), e, tb)
        error = traceback.format_exception_only(type(e), e)[-1].strip()
        if launch_dir:
            _report_failure(launch_dir, rank, 1, error, lines)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
