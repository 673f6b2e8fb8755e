"""Checkpoint directory layout, manifest, atomic commit and the ``latest`` pointer.

::

    save_dir/
      latest                      the tag of the newest complete checkpoint (replaced atomically, last)
      <tag>/
        manifest.json             every other file with its size and sha256 (written last inside the tag)
        meta.json                 rank 0: names, shapes, dtypes, engine/scheduler/scaler state, client state
        index.json                where each tensor's element ranges live (merged from the ranks' markers)
        model_states.safetensors  rank 0: module state the optimizer does not own (frozen params, buffers)
        shards/rank_NNNNN.safetensors   each rank: the elements it owns of fp32 master + optimizer state
        rng/rank_NNNNN.json       each rank: CPU / device / python / numpy RNG states

Commit protocol: every rank writes into ``save_dir/.tmp-<tag>-<nonce>/``, fsyncs, and publishes a marker
(its file list, written by rename). Rank 0 then writes ``index.json`` and ``manifest.json``, renames the
directory to ``<tag>`` (an older ``<tag>`` is first renamed aside to ``.old-<tag>-<nonce>``) and finally
replaces ``latest``. A process killed at any moment leaves at worst a ``.tmp-``/``.old-`` directory that
the next save removes; ``latest`` always names a directory whose manifest verifies.

An async save runs this protocol on the file system only (the writer threads issue no collectives): a rank
whose write fails publishes ``failed_rank_NNNNN.json`` instead of its marker; rank 0 then commits nothing and
writes the outcome (``.tmp-<tag>-<nonce>.outcome``, ok or the first error) that every other rank waits for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from typing import Any

from .errors import CheckpointError

LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
INDEX = "index.json"
MODULE_FILE = "model_states.safetensors"
FORMAT = "zerospeed-checkpoint"
VERSION = 1
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def shard_file(rank: int) -> str:
    return f"shards/rank_{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng/rank_{rank:05d}.json"


def marker_file(rank: int) -> str:
    return f"done_rank_{rank:05d}.json"


def failure_file(rank: int) -> str:
    return f"failed_rank_{rank:05d}.json"


def outcome_file(staging: str) -> str:
    return staging.rstrip(os.sep) + ".outcome"


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not _TAG.match(tag) or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name (letters, digits, '_', '-', '.'; "
                         f"not starting with '.', not 'latest')")
    return tag


# --- small durable-file helpers -------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> tuple[int, str]:
    """Write JSON durably and atomically (temporary file, fsync, rename); returns ``(bytes, sha256)``."""
    data = json.dumps(obj, indent=1, sort_keys=True, allow_nan=True).encode()
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.part"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data), hashlib.sha256(data).hexdigest()


def read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}: {exc})") from None


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


# --- saving ---------------------------------------------------------------------------------------
def begin(save_dir: str, tag: str) -> str:
    """Rank 0: remove leftovers of interrupted saves and create a fresh staging directory."""
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(".tmp-") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(".tmp-"):  # the outcome file of an async save (read by every rank before this save)
            with contextlib.suppress(OSError):
                os.remove(path)
        elif name.startswith(".old-"):
            original = name[len(".old-"):].rsplit("-", 1)[0]
            if os.path.isfile(os.path.join(save_dir, original, MANIFEST)):
                carry_foreign(path, os.path.join(save_dir, original))  # a crash interrupted the carry
                shutil.rmtree(path, ignore_errors=True)
    staging = os.path.join(save_dir, f".tmp-{tag}-{uuid.uuid4().hex[:8]}")
    os.makedirs(os.path.join(staging, "shards"))
    os.makedirs(os.path.join(staging, "rng"))
    return staging


def publish_marker(staging: str, rank: int, files: dict[str, dict[str, Any]], index: dict[str, list[int]]) -> None:
    """A rank's last act: its files (already fsynced) and the element ranges its shard file holds."""
    write_json(os.path.join(staging, marker_file(rank)), {"rank": rank, "files": files, "index": index})


def publish_failure(staging: str, rank: int, error: str) -> None:
    """A rank's write failed: say so in the staging directory (best effort), for rank 0 and the others."""
    with contextlib.suppress(OSError):
        write_json(os.path.join(staging, failure_file(rank)), {"rank": rank, "error": error})


def first_failure(staging: str) -> str | None:
    """The error of the lowest rank that published a failure into ``staging``, if any."""
    try:
        names = sorted(n for n in os.listdir(staging) if n.startswith("failed_rank_") and n.endswith(".json"))
    except OSError:
        return None
    for name in names:
        try:
            info = read_json(os.path.join(staging, name))
            return f"rank {info['rank']}: {info['error']}"
        except (CheckpointError, KeyError, TypeError):
            return f"{name[:-5].replace('_', ' ')}: (unreadable failure record)"
    return None


def wait_markers(staging: str, world: int, timeout_s: float, poll_s: float = 0.02, channel: Any = None
                 ) -> list[dict[str, Any]]:
    """Rank 0 of an async save: wait (polling the file system, no collectives) for every rank's marker.

    Raises as soon as a rank published a failure, or when ``timeout_s`` passes.
    """
    deadline = time.monotonic() + timeout_s
    missing = list(range(world))
    while missing:
        missing = [r for r in missing if not os.path.exists(os.path.join(staging, marker_file(r)))]
        if not missing:
            break
        failure = first_failure(staging) or (channel.failure() if channel is not None else None)
        if failure is not None:
            raise CheckpointError(f"checkpoint in {staging} was not committed ('latest' is unchanged): "
                                  f"the write failed on {failure}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint in {staging}: rank(s) {missing} did not finish writing within "
                                  f"{timeout_s:.0f} s; the checkpoint was not committed")
        time.sleep(poll_s)
    return [read_json(os.path.join(staging, marker_file(r))) for r in range(world)]


def write_outcome(staging: str, error: str | None) -> None:
    """Rank 0 of an async save: the save's outcome, which every other rank's writer waits for."""
    with contextlib.suppress(OSError):
        write_json(outcome_file(staging), {"ok": error is None, "error": error})


def wait_outcome(staging: str, timeout_s: float, poll_s: float = 0.02, channel: Any = None) -> None:
    """Ranks other than 0 of an async save: return once rank 0 committed; raise if any rank failed."""
    deadline = time.monotonic() + timeout_s
    path = outcome_file(staging)
    outcome: Any = None
    while not os.path.exists(path):
        outcome = channel.outcome() if channel is not None else None
        if outcome is not None:
            break
        failure = first_failure(staging) or (channel.failure() if channel is not None else None)
        if failure is not None:
            raise CheckpointError(f"checkpoint in {staging} was not committed ('latest' is unchanged): "
                                  f"the write failed on {failure}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint in {staging}: rank 0 did not commit it within {timeout_s:.0f} s")
        time.sleep(poll_s)
    if outcome is None:
        outcome = read_json(path)
    if not outcome.get("ok"):
        raise CheckpointError(f"checkpoint in {staging} was not committed ('latest' is unchanged): "
                              f"{outcome.get('error')}")


# files of a tag directory that zerospeed writes (besides the ones an old manifest lists)
OWN_NAMES = frozenset({MANIFEST, META, INDEX, MODULE_FILE, "client_state.safetensors", "shards", "rng"})


def own_names(tag_dir: str) -> set[str]:
    """The top-level entries of ``tag_dir`` that are zerospeed's: the fixed names and what its manifest lists."""
    names = set(OWN_NAMES)
    try:
        with open(os.path.join(tag_dir, MANIFEST), "rb") as f:
            files = json.loads(f.read()).get("files")
        if isinstance(files, dict):
            names.update(str(n).split("/", 1)[0] for n in files)
    except (OSError, ValueError, AttributeError):
        pass
    return names


def carry_foreign(old: str, new: str) -> None:
    """Move every entry of ``old`` that is not zerospeed's (the user's files, a DeepSpeed checkpoint's ``.pt``
    files) into ``new``, so overwriting a tag replaces only zerospeed's own files."""
    try:
        entries = os.listdir(old)
    except OSError:
        return
    own = own_names(old)
    for name in entries:
        if name not in own and not os.path.lexists(os.path.join(new, name)):
            os.rename(os.path.join(old, name), os.path.join(new, name))
    fsync_dir(new)


def check_overwrite(save_dir: str, tag: str, overwrite: bool | None) -> None:
    """Refuse to replace an existing tag unless ``overwrite`` is true (``None``, the default, and ``False``
    refuse, a zerospeed checkpoint as much as any other directory: a save never silently replaces what is
    there). Whatever replaces a tag keeps the files that are not zerospeed's."""
    final = os.path.join(save_dir, tag)
    if overwrite or not os.path.lexists(final):
        return
    what = "a zerospeed checkpoint" if os.path.isfile(os.path.join(final, MANIFEST)) else "a directory that is not a zerospeed checkpoint"
    raise CheckpointError(f"checkpoint tag {tag!r} already exists in {save_dir} ({what}): refusing to replace it; "
                          "pass another tag, or overwrite=True (save_checkpoint(..., overwrite=True); zerospeed "
                          "convert-deepspeed --overwrite) to replace zerospeed's files in it (other files are kept)")


def commit(save_dir: str, tag: str, staging: str, markers: list[dict[str, Any]], save_latest: bool,
           overwrite: bool | None = None) -> str:
    """Rank 0: index + manifest, rename into place, then move ``latest``. Returns the final path.

    An existing ``<tag>`` (allowed by ``check_overwrite``) is renamed aside; after the new one is in place,
    the files of the old one that are not zerospeed's are moved into it, and only then is the old one removed."""
    check_overwrite(save_dir, tag, overwrite)
    files: dict[str, dict[str, Any]] = {}
    index: dict[str, list[list[Any]]] = {}
    for m in markers:
        files.update(m["files"])
        fname = shard_file(int(m["rank"]))
        for key, (lo, hi) in m["index"].items():
            index.setdefault(key, []).append([fname, lo, hi])
    nbytes, digest = write_json(os.path.join(staging, INDEX), index)
    files[INDEX] = {"bytes": nbytes, "sha256": digest}
    write_json(os.path.join(staging, MANIFEST), {"format": FORMAT, "version": VERSION, "tag": tag, "files": files})
    for m in markers:
        os.remove(os.path.join(staging, marker_file(int(m["rank"]))))
    fsync_dir(staging)
    final = os.path.join(save_dir, tag)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(save_dir, f".old-{tag}-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(save_dir)
    if aside is not None:
        carry_foreign(aside, final)
        shutil.rmtree(aside, ignore_errors=True)
    if save_latest:
        tmp = os.path.join(save_dir, f".latest.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST))
        fsync_dir(save_dir)
    return final


# --- loading --------------------------------------------------------------------------------------
def read_pointer(pointer: str) -> str:
    """The tag a ``latest`` file names (zerospeed's and DeepSpeed's alike); CheckpointError if it is not one."""
    if not os.path.isfile(pointer):
        raise CheckpointError(f"{pointer} is not a file naming a tag (a directory?); pass tag= or remove it")
    with open(pointer, "rb") as f:
        raw = f.read(4096)
    try:
        return raw.decode().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} is not a text file naming a tag (binary content)") from None


def resolve(load_dir: str, tag: str | None) -> str | None:
    """The checkpoint directory for ``tag`` (default: the one ``latest`` names); None if there is none.

    If a crash interrupted an overwrite of the same tag between its two renames, the previous copy
    (``.old-<tag>-*``) is used.
    """
    if tag is None:
        pointer = os.path.join(load_dir, LATEST)
        if not os.path.lexists(pointer):
            return None
        tag = read_pointer(pointer)
        try:
            check_tag(tag)
        except ValueError as exc:
            raise CheckpointError(f"{pointer}: {exc}") from None
    tag = check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    if os.path.isdir(load_dir):
        for name in sorted(os.listdir(load_dir)):
            if name.startswith(f".old-{tag}-") and os.path.isfile(os.path.join(load_dir, name, MANIFEST)):
                return os.path.join(load_dir, name)
    raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir}")


def read_manifest(ckpt: str) -> dict[str, Any]:
    from .binding import check_manifest

    path = os.path.join(ckpt, MANIFEST)
    return check_manifest(read_json(path), path, FORMAT, VERSION)


def verify_files(ckpt: str, manifest: dict[str, Any], names: list[str] | None = None, hash_: bool = True) -> None:
    """Check size (and sha256) of the listed files; the error names the first bad file."""
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name in sorted(files) if names is None else names:
        entry = files[name]
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, the manifest says {entry['bytes']} "
                                  "(truncated or overwritten)")
        if hash_ and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} does not match its sha256 in the manifest (corrupt)")
