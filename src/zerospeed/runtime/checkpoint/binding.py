"""What a checkpoint's manifest must say before anything in the checkpoint is believed.

The manifest (``manifest.json``) binds the checkpoint: every file the loader opens is listed in it with its
size and sha256, and verification hashes exactly those files. So:

- its shape is checked first (``files`` a mapping of name -> ``{"bytes": int, "sha256": hex}``, ``version``
  an integer), and a malformed one is one ``CheckpointError`` naming the file and the field;
- every name in it, and every file ``index.json`` points at, is relative, normalised (``a/b``, no ``..``, no
  ``./``, no backslash, not absolute) and so stays inside the tag directory;
- ``meta.json`` and ``index.json`` are always listed; ``model_states.safetensors`` and ``client_state.safetensors``
  are listed whenever they exist; the shard files the index names are listed; a rank's RNG file is listed
  whenever the checkpoint was saved with that rank and holds RNG states (see ``rng_to_load``).

A file the manifest does not list is never opened: it could be anything (edited by hand, left by another tag).
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from .errors import CheckpointError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_name(name: Any, where: str) -> str:
    """``name`` must be a relative, normalised path inside the tag directory."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: file name {name!r} is not a non-empty string")
    if (name.startswith("/") or "\\" in name or "\x00" in name or posixpath.normpath(name) != name
            or name.split("/", 1)[0] == ".." or os.path.isabs(name)):
        raise CheckpointError(f"{where}: file name {name!r} is not a normalised relative path inside the checkpoint "
                              "directory (refusing '..', absolute paths and non-normalised names)")
    return name


def check_manifest(manifest: Any, path: str, fmt: str, max_version: int) -> dict[str, Any]:
    """The manifest's shape, every field checked; returns it."""
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise CheckpointError(f"{path} is not a zerospeed checkpoint manifest (field 'format')")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointError(f"{path}: field 'version' is {version!r}, not an integer")
    if version > max_version:
        raise CheckpointError(f"{path} has format version {version}; this zerospeed reads up to {max_version}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: field 'files' is a {type(files).__name__}, not a mapping of file name -> "
                              "{bytes, sha256}")
    for name, entry in files.items():
        check_name(name, f"{path}: field 'files'")
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: field 'files.{name}' is not a mapping with 'bytes' and 'sha256'")
        size, digest = entry.get("bytes"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{path}: field 'files.{name}.bytes' is {size!r}, not a byte count")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise CheckpointError(f"{path}: field 'files.{name}.sha256' is {digest!r}, not a sha256 hex digest")
    return manifest


def check_bound(ckpt: str, manifest: dict[str, Any], index: Any, always: tuple[str, ...],
                if_present: tuple[str, ...]) -> None:
    """Every file the loader may open is listed in the manifest (see the module docstring)."""
    files = manifest["files"]
    where = os.path.join(ckpt, "manifest.json")
    for name in always:
        if name not in files:
            raise CheckpointError(f"{where}: field 'files' does not list {name!r}, which the loader reads; the "
                                  "checkpoint is not verified (refusing to load it)")
    for name in if_present:
        if name not in files and os.path.lexists(os.path.join(ckpt, name)):
            raise CheckpointError(f"{where}: {os.path.join(ckpt, name)} exists but the manifest does not list it "
                                  "(field 'files'); refusing to load an unverified file")
    ipath = os.path.join(ckpt, "index.json")
    if not isinstance(index, dict):
        raise CheckpointError(f"{ipath} is not a mapping of tensor key -> [[file, lo, hi], ...]")
    for key, pieces in index.items():
        if not isinstance(pieces, list):
            raise CheckpointError(f"{ipath}: field {key!r} is not a list of [file, lo, hi]")
        for piece in pieces:
            if (not isinstance(piece, list) or len(piece) != 3 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                      for v in piece[1:]) or not 0 <= piece[1] <= piece[2]):
                raise CheckpointError(f"{ipath}: field {key!r} holds {piece!r}, not [file, lo, hi] with 0 <= lo <= hi")
            check_name(piece[0], f"{ipath}: field {key!r}")
            if piece[0] not in files:
                raise CheckpointError(f"{ipath}: field {key!r} points at {piece[0]!r}, which the manifest does not "
                                      "list (a file of another checkpoint?); refusing to load it")


def rng_to_load(ckpt: str, manifest: dict[str, Any], name: str, rank: int, saved_world: Any) -> str | None:
    """The RNG file this rank restores: listed when the checkpoint has this rank; None when it was saved
    with fewer ranks (a new rank keeps its own RNG) or holds no RNG state at all (converted from DeepSpeed)."""
    if name in manifest["files"]:
        return os.path.join(ckpt, name)
    where = os.path.join(ckpt, "manifest.json")
    saved_rng = any(n.startswith("rng/") for n in manifest["files"])  # a converted checkpoint has none
    if saved_rng and isinstance(saved_world, int) and rank < saved_world:
        raise CheckpointError(f"{where}: field 'files' does not list {name!r}: the checkpoint was saved with "
                              f"{saved_world} ranks, so rank {rank}'s RNG state is missing (refusing a silent "
                              "partial restore)")
    if os.path.lexists(os.path.join(ckpt, name)):
        raise CheckpointError(f"{where}: {os.path.join(ckpt, name)} exists but the manifest does not list it")
    return None
