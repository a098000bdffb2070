"""Weights through the NATS object store (`weightSync.mode: bus`): upload a folder, download it, delete it.

Called by Bus.put_weights/get_weights/delete_weights. Objects are `v{N}/{relative path}` plus a manifest
`v{N}/.kuberl-manifest.json` written last, so a reader never sees a half-uploaded version.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import nats.js.errors
from nats.js import api

log = logging.getLogger(__name__)
MANIFEST = ".kuberl-manifest.json"


def prefix_for(version: int) -> str:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weights version must be an int >= 0, got {version!r}")
    return f"v{version}"


def _files(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise FileNotFoundError(f"weights folder {str(folder)!r} does not exist or is not a folder")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    if not files:
        raise FileNotFoundError(f"weights folder {str(folder)!r} holds no files")
    return files


async def put_weights(store: Any, version: int, folder: str | os.PathLike[str], *, chunk_size: int) -> str:
    prefix = prefix_for(version)
    root = Path(folder)
    files = _files(root)
    total = sum((root / f).stat().st_size for f in files)
    t0 = time.monotonic()
    sizes = {}
    for rel in files:
        with open(root / rel, "rb") as fh:  # noqa: ASYNC230 - nats-py reads it in an executor
            meta = api.ObjectMeta(name=f"{prefix}/{rel}", options=api.ObjectMetaOptions(max_chunk_size=chunk_size))
            info = await store.put(f"{prefix}/{rel}", fh, meta=meta)
        sizes[rel] = info.size
    manifest = {"version": version, "files": sizes, "time": time.time()}
    await store.put(f"{prefix}/{MANIFEST}", json.dumps(manifest).encode())
    dt = max(time.monotonic() - t0, 1e-6)
    log.info("weights %s: uploaded %d files, %.1f MB in %.2fs (%.0f MB/s)", prefix, len(files), total / 1e6, dt, total / 1e6 / dt)
    return prefix


async def _manifest(store: Any, prefix: str) -> dict[str, Any]:
    try:
        res = await store.get(f"{prefix}/{MANIFEST}")
    except nats.js.errors.ObjectNotFoundError:
        raise FileNotFoundError(f"weights {prefix!r} are not in the object store (never uploaded, incomplete, or deleted)") from None
    return json.loads(res.data)


async def get_weights(store: Any, prefix: str, dest_folder: str | os.PathLike[str]) -> str:
    manifest = await _manifest(store, prefix)
    dest = Path(dest_folder)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.monotonic()
    try:
        for rel, size in manifest["files"].items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as fh:  # noqa: ASYNC230 - nats-py writes it in an executor
                await store.get(f"{prefix}/{rel}", writeinto=fh)  # the client checks the sha-256 digest
            if target.stat().st_size != size:
                raise OSError(f"weights {prefix}/{rel}: got {target.stat().st_size} bytes, manifest says {size}")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(manifest["files"].values())
    log.info("weights %s: downloaded %.1f MB to %s in %.2fs", prefix, total / 1e6, dest, time.monotonic() - t0)
    return str(dest)


async def delete_weights(store: Any, prefix: str) -> int:
    try:
        names = [f"{prefix}/{rel}" for rel in (await _manifest(store, prefix))["files"]]
    except FileNotFoundError:
        names = [o.name for o in await _list(store) if o.name.startswith(prefix + "/")]
    deleted = 0
    # Manifest first: from then on readers see the version as gone, never as half-deleted.
    for name in [f"{prefix}/{MANIFEST}", *names]:
        try:
            await store.delete(name)
            deleted += name != f"{prefix}/{MANIFEST}"
        except nats.js.errors.ObjectNotFoundError:
            pass
    return deleted


async def _list(store: Any) -> list[Any]:
    try:
        return await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        return []


async def list_weights(store: Any) -> list[str]:
    prefixes = [o.name[: -len(MANIFEST) - 1] for o in await _list(store) if o.name.endswith("/" + MANIFEST) and not o.deleted]
    return sorted(prefixes, key=lambda p: int(p[1:]) if p[1:].isdigit() else -1)
