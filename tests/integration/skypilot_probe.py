"""Loads SkyPilot task YAMLs with SkyPilot's own loader; run by the Python of the isolated SkyPilot venv.

    python skypilot_probe.py TASK.yaml...   ->  one JSON object on stdout: {path: summary or error}

Each file goes through `sky.Task.from_yaml` (duplicate-key check, `validate_schema` against
`sky.utils.schemas.get_task_schema()`, then `Resources.from_yaml_config`, which parses the
accelerators, infra, cpus and memory), then `Task.expand_and_validate_workdir`, as `sky launch` does
before it syncs anything. Nothing here contacts a cloud: the caller gives it an empty HOME, so
SkyPilot finds no credentials and no config, and no command that provisions is called.
Used by tests/integration/test_skypilot.py (not collected by pytest itself: kuberl is not installed
in that venv).
"""

from __future__ import annotations

import json
import sys
import traceback


def summary(task) -> dict:
    resources = []
    for r in task.resources:
        resources.append({
            "cloud": None if r.cloud is None else str(r.cloud),
            "infra": r.infra.to_str() if getattr(r, "infra", None) is not None else None,
            "accelerators": r.accelerators,
            "cpus": r.cpus,
            "memory": r.memory,
            "disk_size": r.disk_size,
            "use_spot": r.use_spot,
        })
    return {
        "name": task.name,
        "run": task.run,
        "setup": task.setup,
        "workdir": task.workdir,
        "envs": dict(task.envs),
        "secrets": sorted(task.secrets),
        "managed_secrets": sorted(ref.name for ref in getattr(task, "_managed_secret_refs", [])),
        "file_mounts": dict(task.file_mounts or {}),
        "storage_mounts": {dst: {"name": s.name, "source": s.source, "mode": str(s.mode)} for dst, s in task.storage_mounts.items()},
        "num_nodes": task.num_nodes,
        "resources": resources,
    }


def main(paths: list[str]) -> int:
    import sky

    out: dict = {"sky_version": sky.__version__, "tasks": {}}
    for path in paths:
        try:
            task = sky.Task.from_yaml(path)
            task.expand_and_validate_workdir()
            out["tasks"][path] = {"ok": True, "task": summary(task)}
        except Exception as exc:  # noqa: BLE001 - the error text is the result
            out["tasks"][path] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc(limit=3)}
    json.dump(out, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
