"""The SkyPilot tasks in examples/skypilot, checked by the real SkyPilot (skypilot==0.14.1).

Every task YAML there goes through SkyPilot's own loader in an isolated venv (fixture
`skypilot_python`, tests/integration/conftest_skypilot.py): `sky.Task.from_yaml` validates it against
SkyPilot's task schema and builds its Resources; `expand_and_validate_workdir` checks the workdir as
`sky launch` would. Then the loaded Task is checked for what KubeRL needs: the GPUs and infra the
file means, a `kuberl run` of an experiment file that exists and passes `kuberl validate`, and
workdir/file_mounts that point at real paths. A deliberately broken copy must be rejected, so the
check can fail. Nothing contacts a cloud (empty HOME, no credentials, nothing launched).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest_skypilot import sky_env, skypilot_python  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SKYPILOT_DIR = ROOT / "examples" / "skypilot"
PROBE = Path(__file__).with_name("skypilot_probe.py")


def _is_experiment(path: Path) -> bool:
    doc = yaml.safe_load(path.read_text()) or {}
    return str(doc.get("apiVersion", "")).startswith("kuberl.io/")


TASKS = [p for p in sorted(SKYPILOT_DIR.glob("*.yaml")) if not _is_experiment(p)]
# What each task is meant to ask for: any one of these 2-GPU choices, on this infra.
INTENDED = {
    "vm.yaml": {"gpus": {"L4", "A10G", "L40S", "A100", "H100"}, "count": 2, "cloud": None},
    "kubernetes.yaml": {"gpus": {"L4", "A100", "H100"}, "count": 2, "cloud": "Kubernetes"},
}


def load_with_skypilot(python: Path, paths: list[Path], home: Path) -> dict:
    """{str(path): {"ok": bool, "task" | "error": ...}} as SkyPilot's loader sees each file.
    Runs from the repository root, where the tasks say `sky launch` is run (`workdir: .`)."""
    home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(python), "-I", str(PROBE), *map(str, paths)], cwd=ROOT, env=sky_env(home),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["sky_version"] == "0.14.1"
    return out["tasks"]


@pytest.fixture(scope="module")
def loaded(skypilot_python, tmp_path_factory) -> dict:  # noqa: F811
    """SkyPilot's answer for every file of this module, from one run of the loader (`import sky` alone
    takes seconds): the tasks as they are, vm.yaml with its optional mount on, and the broken copies.
    Keys: the task paths, "optional-mounts", and the names in BROKEN."""
    work = tmp_path_factory.mktemp("skypilot")
    files: dict[str, Path] = {str(p): p for p in TASKS}
    files["optional-mounts"] = work / "vm.yaml"
    files["optional-mounts"].write_text(optional_mounts_uncommented(SKYPILOT_DIR / "vm.yaml") or "")
    vm = yaml.safe_load((SKYPILOT_DIR / "vm.yaml").read_text())
    for name, (change, _) in BROKEN.items():
        files[name] = work / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(change(copy.deepcopy(vm)), sort_keys=False))
    results = load_with_skypilot(skypilot_python, list(files.values()), work / "home")
    return {key: results[str(path)] for key, path in files.items()}


def test_the_folder_has_tasks_and_each_has_an_intended_resource_spec():
    assert {p.name for p in TASKS} == set(INTENDED)


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
class TestTaskLoadsInSkyPilot:
    def task(self, loaded, path) -> dict:
        result = loaded[str(path)]
        assert result["ok"], f"SkyPilot rejects {path.name}: {result.get('error')}\n{result.get('traceback', '')}"
        return result["task"]

    def test_loads_and_passes_skypilot_schema_validation(self, loaded, path):
        self.task(loaded, path)

    def test_resources_ask_for_the_intended_gpus_and_infra(self, loaded, path):
        intended = INTENDED[path.name]
        resources = self.task(loaded, path)["resources"]
        # A dict of accelerators is "any of these": SkyPilot makes one candidate Resources each.
        assert {name for r in resources for name in r["accelerators"]} == intended["gpus"]
        for r in resources:
            assert list(r["accelerators"].values()) == [intended["count"]], r
            assert r["cloud"] == intended["cloud"], r
            assert float(r["disk_size"]) >= 100, r

    def test_run_starts_kuberl_on_a_valid_experiment(self, loaded, path):
        from kuberl.cli import build_parser, main

        task = self.task(loaded, path)
        run = task["run"]
        runs = [ln.strip() for ln in run.splitlines() if ln.strip().startswith("kuberl run ")]
        assert len(runs) == 1, run
        # The shell variables of the run script: $MANIFEST from envs, $workdir and $resume set above the line.
        shell = {**task["envs"], "workdir": "/home/sky/kuberl-runs/x"}
        for resume in ("", "--resume"):
            argv = []
            for word in shlex.split(runs[0]):
                if word == "$resume":
                    argv += [resume] if resume else []
                else:
                    argv.append(re.sub(r"\$\{?(\w+)\}?", lambda m: shell[m.group(1)], word))
            args = build_parser().parse_args(argv[1:])
            assert args.command == "run"
        manifest = Path(task["workdir"]) / task["envs"]["MANIFEST"]
        assert argv[2] == task["envs"]["MANIFEST"] and manifest.is_file(), manifest
        # The script validates the same file before it runs it, and that file passes `kuberl validate`.
        assert re.search(r'^\s*kuberl validate "\$MANIFEST"\s*$', run, re.MULTILINE), run
        assert main(["validate", str(manifest)]) == 0

    def test_workdir_is_this_repository_and_mounts_point_at_real_paths(self, loaded, path):
        task = self.task(loaded, path)
        assert Path(task["workdir"]) == ROOT, task["workdir"]
        assert (ROOT / "pyproject.toml").is_file()  # setup's `pip install -e ".[...]"` needs it
        for dst, src in task["file_mounts"].items():
            local = Path(src).expanduser()
            assert "://" in src or local.exists(), f"file_mounts {dst}: {src} does not exist"
        for dst, storage in task["storage_mounts"].items():
            source = storage["source"]
            assert source is None or "://" in str(source) or Path(source).expanduser().exists(), (dst, storage)

    def test_secrets_are_references_not_values(self, loaded, path):
        task = self.task(loaded, path)
        assert task["secrets"] == []  # no inline secret values in the repository
        assert "HF_TOKEN" in task["managed_secrets"]


def optional_mounts_uncommented(path: Path) -> str | None:
    """The task text with its commented-out `# file_mounts:` example switched on (None if it has none)."""
    text = path.read_text()
    block = re.search(r"^# file_mounts:\n(?:#   .*\n)+", text, re.MULTILINE)
    if block is None:
        return None
    return text.replace(block.group(0), "".join(line[2:] + "\n" for line in block.group(0).splitlines()))


def test_the_optional_checkpoint_bucket_mount_loads_and_holds_the_run_dir(loaded):
    assert optional_mounts_uncommented(SKYPILOT_DIR / "vm.yaml") is not None, "vm.yaml shows how to keep checkpoints in a bucket"
    result = loaded["optional-mounts"]
    assert result["ok"], result.get("error")
    task = result["task"]
    ((dst, storage),) = task["storage_mounts"].items()
    assert storage["mode"] == "StorageMode.MOUNT_CACHED" and storage["source"] is None  # a bucket SkyPilot creates
    # The mount must hold the run directory, or checkpoints would not outlive the VM.
    run_dir = Path("~") / task["envs"]["RUN_DIR"]
    assert Path(dst) in run_dir.parents, (dst, run_dir)


# A broken copy of vm.yaml and a fragment of the error SkyPilot must answer with.
BROKEN = {
    "unknown-top-level-field": (lambda t: {**t, "resourcez": t["resources"]}, "did you mean 'resources'"),
    "unknown-resources-field": (lambda t: {**t, "resources": {**t["resources"], "gpu": "L4:2"}}, "unsupported field 'gpu'"),
    "bad-accelerator-syntax": (lambda t: {**t, "resources": {**t["resources"], "accelerators": "L4:two"}}, "<name>:<cnt>"),
    "bad-accelerator-count": (lambda t: {**t, "resources": {**t["resources"], "accelerators": {"L4": "two"}}}, "$.accelerators.L4"),
    "unknown-infra": (lambda t: {**t, "resources": {**t["resources"], "infra": "nocloud"}}, "$.infra"),
}


@pytest.mark.parametrize("breakage", BROKEN, ids=list(BROKEN))
def test_skypilot_rejects_a_broken_copy(breakage, loaded):
    _, message = BROKEN[breakage]
    result = loaded[breakage]
    assert not result["ok"], f"SkyPilot accepted {breakage}"
    assert message in result["error"], result["error"]
