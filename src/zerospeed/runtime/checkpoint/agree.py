"""What every rank of a save or load must agree on, checked collectively so all ranks fail together.

- **The tag** (``checkpoint.tag_validation``, DeepSpeed's key): "Fail" raises on every rank when ranks
  pass different tags; "Warn" (the default) warns and "Ignore" says nothing; both then save under rank
  0's tag, so one consistent checkpoint is written (DeepSpeed would scatter the ranks' files over
  several tag directories).
- **The directory**: every rank must see the same directory (a shared file system). Rank 0 creates the
  staging directory; each rank looks for it under the directory *it* was given. A rank that passed
  another path (a timestamp in it, a node-local disk) does not see it, and the save fails on all ranks
  instead of everything being written into rank 0's directory. Loading compares the manifest each rank
  found (same tag, same bytes), so an identical copy mounted elsewhere still loads.
- **Errors**: a failure on any rank is gathered and raised on every rank with that rank's message.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

from ... import comm
from .errors import CheckpointError, TagMismatchError
from .layout import MANIFEST

TAG_VALIDATION_MODES = ("Ignore", "Warn", "Fail")


def raise_if_any(error: str, group: Any, what: str, after: str = "") -> None:
    """Collective: raise on every rank if any rank passed a non-empty ``error`` (naming the first)."""
    errors = comm.all_gather_object(error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, first = failed[0]
        more = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise CheckpointError(f"{what} failed on rank {rank}: {first}{more}{after}")


def agree_on_tag_and_dir(tag: str, save_dir: str, mode: str, group: Any) -> tuple[str, list[str]]:
    """Collective: the tag every rank saves under (rank 0's, per ``mode``) and each rank's directory."""
    mode = mode.capitalize()
    if mode not in TAG_VALIDATION_MODES:
        raise ValueError(f"checkpoint.tag_validation must be one of {TAG_VALIDATION_MODES}, got {mode!r}")
    pairs = comm.all_gather_object((tag, os.path.abspath(save_dir)), group=group)
    tags = [t for t, _ in pairs]
    if len(set(tags)) > 1 and mode != "Ignore":
        msg = (f"save_checkpoint: the checkpoint tag is not the same on every rank ({_by_rank(tags)}); including "
               "rank-specific information in the tag breaks loading at another world size")
        if mode == "Fail":
            raise TagMismatchError(msg + " (checkpoint.tag_validation is 'Fail')")
        warnings.warn(msg + f"; saving under rank 0's tag {tags[0]!r} (checkpoint.tag_validation is 'Warn')",
                      stacklevel=4)
    return tags[0], [d for _, d in pairs]


def check_staging_visible(save_dir: str, staging_name: str, dirs: list[str], group: Any) -> None:
    """Collective: every rank must see rank 0's staging directory under its own ``save_dir``."""
    sees = os.path.isdir(os.path.join(save_dir, staging_name))
    seen = comm.all_gather_object(sees, group=group)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        hint = ("ranks passed different checkpoint directories" if len(set(dirs)) > 1 else
                "the directory is not shared between the ranks (node-local storage is not supported)")
        raise CheckpointError(f"save_checkpoint: rank(s) {blind} cannot see the checkpoint rank 0 is writing: "
                              f"{hint} ({_by_rank(dirs)}); every rank must pass the same directory, on a file "
                              "system all ranks share. Nothing was saved.")


def check_same_checkpoint(load_dir: str, ckpt: str | None, error: str, group: Any) -> None:
    """Collective: every rank resolved the same checkpoint (same tag, identical manifest) or none at all;
    ``error`` (a rank could not resolve its tag) is raised on every rank."""
    digest = None
    if ckpt is not None:
        try:
            with open(os.path.join(ckpt, MANIFEST), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            digest = "unreadable"
    mine = (os.path.abspath(load_dir), None if ckpt is None else os.path.basename(ckpt), digest, error)
    found = comm.all_gather_object(mine, group=group)
    errors = [(r, e) for r, (_, _, _, e) in enumerate(found) if e]
    if errors:
        raise CheckpointError(f"load_checkpoint failed on rank {errors[0][0]}: {errors[0][1]}")
    if len({(tag, d) for _, tag, d, _ in found}) > 1:
        what = _by_rank([f"{d} -> {tag or 'no checkpoint'}" for d, tag, _, _ in found])
        raise CheckpointError(f"load_checkpoint: the ranks found different checkpoints ({what}); every rank must "
                              "pass the same directory and tag, on a file system all ranks share")


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
