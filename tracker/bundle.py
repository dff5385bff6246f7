"""A run dir's tracker state as one file, to carry a run across networks (`rlops runs export` / `sync FILE`).

A bundle is a tar of `manifest.json` (first) and the state dir's files; the manifest names each file with
its size and sha256. Unpacking checks everything before anything is used: a member the manifest does not
name, a missing, truncated or altered file, a link or a path out of the folder is refused with what is
wrong, so nothing of a bad bundle is ever logged. A good one unpacks (once) under the data dir and is
synced from there like any run dir.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tracker import offline, state
from tracker.checkpoints import sha256_of
from tracker.lock import RunDirLock

FORMAT = "rlops-run-bundle"
VERSION = 1
MANIFEST = "manifest.json"
UNPACKED_DIR = "synced-runs"  # under the data dir
SKIPPED_SUFFIXES = (".tmp",)  # half-written files of a live writer are not state


class BundleError(ValueError):
    """A bundle that cannot be trusted, and why."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    run_label: str  # the run's server id, or `offline-<id>` for a run never bound
    files: int
    bytes: int


def _state_files(state_path: Path) -> list[Path]:
    return sorted(p for p in state_path.rglob("*")
                  if p.is_file() and not p.is_symlink() and not p.name.endswith(SKIPPED_SUFFIXES))


def export_run_dir(run_dir: Path, out: Path, lock_lease_s: float) -> Bundle:
    """Write `run_dir`'s tracker state to the bundle `out` (written aside, then renamed). Refused while a
    live process writes the run dir (`tracker.lock.RunDirBusy`): its state would move under the tar."""
    run_dir, out = Path(run_dir), Path(out)
    record = state.stored_run(run_dir)
    if record is None:
        raise FileNotFoundError(f"{run_dir} holds no tracked run ({state.STATE_DIR}/{state.RUN_FILE} is missing)")
    lock = RunDirLock(run_dir, lock_lease_s)
    lock.acquire()
    try:
        state_path = state.state_dir(run_dir)
        files = _state_files(state_path)
        manifest = {"format": FORMAT, "version": VERSION, "created_at": time.time(),
                    "run_id": record.get("run_id"), "offline_id": record.get("offline_id"),
                    "files": {p.relative_to(state_path).as_posix(): {"size": p.stat().st_size, "sha256": sha256_of(p)}
                              for p in files}}
        tmp = out.with_name(out.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
            for path in files:
                tar.add(path, arcname=f"{state.STATE_DIR}/{path.relative_to(state_path).as_posix()}", recursive=False)
        os.replace(tmp, out)
    finally:
        lock.release()
    return Bundle(out, offline.label(record), len(files), sum(f["size"] for f in manifest["files"].values()))


def unpack_bundle(bundle: Path, data_path: Path) -> Path:
    """Check `bundle` whole, then unpack it under `<data_path>/synced-runs/` (once: a bundle unpacked before
    is found again, with what its syncs recorded since). Returns the run dir. Raises BundleError."""
    bundle = Path(bundle)
    digest = sha256_of(bundle)
    try:
        with tarfile.open(bundle, "r:*") as tar:
            members = tar.getmembers()  # reads to the end: a truncated file fails here
            manifest = _read_manifest(tar, members)
            run_dir = Path(data_path) / UNPACKED_DIR / f"{_run_name(manifest)}-{digest[:12]}"
            if (run_dir / state.STATE_DIR).is_dir():
                return run_dir
            tmp = run_dir.with_name(run_dir.name + ".unpacking")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _extract_checked(tar, members, manifest, tmp / state.STATE_DIR)
                tmp.rename(run_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise BundleError(f"{bundle} is not a whole run bundle (truncated or not a bundle): {exc}") from None
    return run_dir


def _read_manifest(tar: tarfile.TarFile, members: list[tarfile.TarInfo]) -> dict:
    if not members or members[0].name != MANIFEST or not members[0].isfile():
        raise BundleError(f"not a run bundle: its first member is not {MANIFEST}")
    try:
        manifest = json.loads(tar.extractfile(members[0]).read())
    except ValueError as exc:
        raise BundleError(f"the bundle's {MANIFEST} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise BundleError(f"not a run bundle: {MANIFEST} lacks format {FORMAT!r} and its file list")
    if manifest.get("version") != VERSION:
        raise BundleError(f"bundle version {manifest.get('version')!r} is not {VERSION}: sync it with the rlops "
                          "that exported it")
    if not (manifest.get("run_id") or manifest.get("offline_id")):
        raise BundleError(f"the bundle's {MANIFEST} names no run")
    return manifest


def _run_name(manifest: dict) -> str:
    name = manifest.get("offline_id") or manifest["run_id"]
    if not isinstance(name, str) or not name.isalnum():
        raise BundleError(f"the bundle's run id {name!r} is not a run id")
    return name


def _extract_checked(tar: tarfile.TarFile, members: list[tarfile.TarInfo], manifest: dict, dest: Path) -> None:
    """Extract the state files into `dest`, each checked against the manifest as it is written."""
    expected = manifest["files"]
    seen: set[str] = set()
    for member in members[1:]:
        name = PurePosixPath(member.name)
        if not member.isfile():
            raise BundleError(f"bundle member {member.name!r} is not a plain file (links and devices are refused)")
        if name.parts[:1] != (state.STATE_DIR,) or ".." in name.parts or name.is_absolute():
            raise BundleError(f"bundle member {member.name!r} lies outside {state.STATE_DIR}/")
        rel = PurePosixPath(*name.parts[1:]).as_posix()
        if rel not in expected:
            raise BundleError(f"bundle member {member.name!r} is not in its manifest (added after export)")
        if rel in seen:
            raise BundleError(f"bundle member {member.name!r} appears twice")
        seen.add(rel)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        with tar.extractfile(member) as src, open(target, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        want = expected[rel]
        if size != want.get("size") or digest.hexdigest() != want.get("sha256"):
            raise BundleError(f"bundle file {rel} was altered: sha256 {digest.hexdigest()[:12]}… and {size} bytes, "
                              f"the manifest says {str(want.get('sha256'))[:12]}… and {want.get('size')} bytes")
    missing = sorted(set(expected) - seen)
    if missing:
        raise BundleError(f"the bundle lacks {len(missing)} file(s) its manifest names, e.g. {missing[0]}")
