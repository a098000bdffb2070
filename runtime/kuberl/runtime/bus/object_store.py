"""Weights through the bus's object store (`weightSync.mode: bus`): the Bus methods over bus/weights.py.

A mixin of Bus (client.py): needs its `_obj`, `chunk_size` (StreamsMixin) and `_retry`.
"""

from __future__ import annotations

import os

from kuberl.runtime.bus import weights as weights_io


class ObjectStoreMixin:
    """put_weights, get_weights, delete_weights, list_weights."""

    # -- weights (object store) ------------------------------------------------------------------

    # Each call is retried whole through a bus outage (a kill -9 of the server mid-upload): objects are
    # replaced by name and the manifest is written last, so a repeated upload or download is safe.

    async def put_weights(self, version: int, folder: str | os.PathLike[str]) -> str:
        """Upload every file of `folder` as objects `v{version}/{file}`; returns the prefix `v{version}`."""
        chunk = min(self.chunk_size, 2 * 1024 * 1024)
        return await self._retry(f"upload weights v{version}", lambda: weights_io.put_weights(self._obj, version, folder, chunk_size=chunk))

    async def get_weights(self, prefix: str, dest_folder: str | os.PathLike[str]) -> str:
        """Download the objects under `prefix` into dest_folder (written beside it, then renamed)."""
        return await self._retry(f"download weights {prefix}", lambda: weights_io.get_weights(self._obj, prefix, dest_folder))

    async def delete_weights(self, prefix: str) -> int:
        """Delete the objects under `prefix`; returns how many."""
        return await self._retry(f"delete weights {prefix}", lambda: weights_io.delete_weights(self._obj, prefix))

    async def list_weights(self) -> list[str]:
        """Prefixes of the complete weight uploads in the object store."""
        return await self._retry("list weights", lambda: weights_io.list_weights(self._obj))
