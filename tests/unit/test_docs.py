"""The documentation under docs/: the spec reference is current with the API models, RLExperiment snippets are
valid manifests, and the `kuberl` commands named exist. Links: tests/unit/test_docs_links.py; every shell command of
the front page and the guides: tests/unit/test_docs_commands.py."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from kuberl.api import v1alpha1
from kuberl.api.reference import main as reference_main
from kuberl.api.reference import render_default, render_reference, render_type, walk
from kuberl.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "design" not in p.parts)


class TestReference:
    def test_docs_reference_is_generated_from_the_current_models(self):
        assert (DOCS / "reference.md").read_text() == render_reference(), (
            "docs/reference.md is out of date: run `python -m kuberl.api.reference -o docs/reference.md`"
        )

    def test_every_api_model_is_reachable_and_has_a_section(self):
        text = render_reference()
        concrete = {
            m for m in vars(v1alpha1).values()
            if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == v1alpha1.__name__
        }
        bases_only = {v1alpha1.KubeModel, v1alpha1.SchedulingSpec}  # their fields show in subclasses
        assert concrete - bases_only - set(walk(v1alpha1.RLExperiment)) == set()
        for model in concrete - bases_only:
            assert f"\n## {model.__name__}\n" in text, model.__name__

    def test_every_field_appears_by_its_manifest_name(self):
        text = render_reference()
        for model in walk(v1alpha1.RLExperiment):
            section = text.split(f"\n## {model.__name__}\n", 1)[1].split("\n## ", 1)[0]
            for name, field in model.model_fields.items():
                assert f"| `{field.alias or name}` |" in section, f"{model.__name__}.{name}"

    @pytest.mark.parametrize(
        "tp,expected",
        [
            (v1alpha1.Quantity, "quantity"),
            (int | None, "integer"),
            (dict[str, typing.Any], "object"),
            (dict[str, str], "map[string]string"),
            (list[v1alpha1.Condition], "[][Condition](#condition)"),
            (v1alpha1.EngineName, "`sglang` | `vllm`"),
            (typing.Literal["disk", "bus"], "`disk` | `bus`"),
        ],
    )
    def test_types_read_as_manifest_types(self, tp, expected):
        assert render_type(tp) == expected

    def test_defaults_show_required_values_and_non_default_factories(self):
        spec = v1alpha1.RLExperimentSpec.model_fields
        assert render_default(spec["model"]) == "*required*"
        assert render_default(spec["training"]) == '`{"epochs": 1}`'
        assert render_default(spec["bus"]) == '`{"embedded": {}}`'
        assert render_default(spec["suspend"]) == "`false`"
        assert render_default(v1alpha1.RolloutSpec.model_fields["image"]) == "—"

    def test_check_mode_fails_on_a_stale_page_and_passes_on_a_fresh_one(self, tmp_path, capsys):
        page = tmp_path / "reference.md"
        page.write_text("# stale\n")
        assert reference_main(["-o", str(page), "--check"]) == 1
        assert reference_main(["-o", str(page)]) == 0
        assert reference_main(["-o", str(page), "--check"]) == 0


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
class TestPages:
    def test_rlexperiment_snippets_are_valid_manifests(self, page):
        text = page.read_text()
        checked = 0
        for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL):
            for doc in yaml.safe_load_all(block):
                if isinstance(doc, dict) and doc.get("kind") == "RLExperiment":
                    v1alpha1.RLExperiment.model_validate(doc)
                    checked += 1
        # Every manifest the page shows was checked: none sits in a block of another language (or none).
        shown = sum(len(re.findall(r"^kind: RLExperiment[ \t]*$", b, re.MULTILINE))
                    for b in re.findall(r"```[^\n]*\n(.*?)```", text, re.DOTALL))
        assert checked == shown, f"{page.name}: {shown} RLExperiment manifests shown, {checked} in ```yaml blocks checked"

    def test_kuberl_commands_named_exist(self, page):
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(), re.DOTALL):
            # `kuberl X` where a command starts: line start, after &&, ;, || or $( (not `helm install kuberl ...`)
            for sub in re.findall(r"(?:^|&&|;|\|\||\$\()[ \t]*kuberl ([a-z][a-z-]*)", block, re.MULTILINE):
                assert sub in COMMANDS, f"{page.name}: `kuberl {sub}` is no kuberl subcommand"


def test_the_pages_show_rlexperiment_manifests_that_get_checked():
    # Guards TestPages' manifest check against passing vacuously (a changed fence style, a moved guide).
    pages = {p.name for p in PAGES if re.search(r"```yaml\n[^`]*^kind: RLExperiment", p.read_text(), re.MULTILINE)}
    assert {"user-guide.md", "gke.md", "eks.md"} <= pages, pages


SKYPILOT = sorted((ROOT / "examples" / "skypilot").glob("*.yaml"))
# Top-level keys of a SkyPilot task (docs.skypilot.co, "YAML spec").
SKYPILOT_TASK_KEYS = {"name", "resources", "num_nodes", "workdir", "file_mounts", "envs", "secrets", "setup", "run", "config", "volumes"}


def _sky_tasks() -> list[Path]:
    return [p for p in SKYPILOT if "run" in (yaml.safe_load(p.read_text()) or {})]


@pytest.mark.parametrize("path", _sky_tasks(), ids=lambda p: p.name)
class TestSkyPilotTasks:
    def task(self, path) -> dict:
        return yaml.safe_load(path.read_text())

    def test_only_skypilot_task_keys(self, path):
        assert set(self.task(path)) <= SKYPILOT_TASK_KEYS

    def test_the_manifest_it_runs_exists_and_is_valid(self, path):
        from kuberl.api import load_experiment

        manifest = ROOT / self.task(path)["envs"]["MANIFEST"]
        assert manifest.exists(), manifest
        load_experiment(manifest)

    def test_kuberl_command_lines_parse(self, path):
        from kuberl.cli import build_parser

        task = self.task(path)
        lines = [ln.strip() for ln in task["run"].splitlines() if ln.strip().startswith("kuberl ")]
        assert any(ln.startswith("kuberl run ") for ln in lines)
        for line in lines:
            argv = [a.strip('"') for a in line.split()[1:] if a != "$resume"]
            argv = [task["envs"]["MANIFEST"] if a == "$MANIFEST" else a for a in argv]
            build_parser().parse_args(argv)

    def test_pinned_packages_agree_with_pyproject(self, path):
        import tomllib

        from packaging.requirements import Requirement

        data = tomllib.loads((ROOT / "pyproject.toml").read_text())
        reqs = [Requirement(d) for extra in data["project"]["optional-dependencies"].values() for d in extra]
        for name, version in re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^"]*)"', self.task(path)["setup"]):
            for req in (r for r in reqs if r.name == name):
                assert req.specifier.contains(version), f"{name}=={version} vs pyproject {req}"
        for extras in re.findall(r'"\.\[([a-z,]+)\]"', self.task(path)["setup"]):
            for extra in extras.split(","):
                assert extra in data["project"]["optional-dependencies"], extra


def test_metric_names_in_operations_are_the_ones_the_operator_exports():
    from kuberl.operator import metrics

    exported = {m.name for m in metrics.REGISTRY.collect()}
    named = set(re.findall(r"\b(kuberl_operator_[a-z_]+)", (DOCS / "operations.md").read_text()))
    assert named, "operations.md names no operator metric"
    for name in named:
        base = name.removesuffix("_total")
        assert base in exported, f"operations.md names {name}, the operator exports {sorted(exported)}"


def _section(page: Path, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    text = page.read_text()
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def _field_exists(path: str) -> bool:
    """Whether a dotted manifest path (`algorithm.lora.rank`, under spec unless it starts with metadata) is a field."""
    model: type[BaseModel] = v1alpha1.RLExperiment
    parts = path.split(".")
    parts = parts if parts[0] in ("metadata", "spec") else ["spec", *parts]
    for part in parts:
        by_alias = {(f.alias or n): f for n, f in model.model_fields.items()}
        if part not in by_alias:
            return False
        nested = [a for a in (typing.get_args(by_alias[part].annotation) or (by_alias[part].annotation,))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        model = nested[0] if nested else None
        if model is None and part != parts[-1]:
            return False
    return True


def test_the_areal_table_names_fields_the_models_have():
    table = _section(DOCS / "user-guide.md", "### From AReaL: config keys as RLExperiment fields")
    rows = [r for r in table.splitlines() if r.startswith("| `") or r.startswith("| DAPO") or r.startswith("| your")]
    top = {f.alias or n for n, f in v1alpha1.RLExperimentSpec.model_fields.items()}
    tokens = [f.split(":")[0].strip() for r in rows for f in re.findall(r"`([^`]+)`", r.split(" | ")[1])]
    # Field paths: dotted names (values such as `broadcast` are not) and top-level spec fields such as `seed`.
    fields = [t for t in tokens if re.fullmatch(r"[a-z][A-Za-z]*(\.[a-z][A-Za-z]*)+", t) or t in top]
    assert len(rows) >= 30 and len(fields) >= 50, (len(rows), len(fields))
    assert [f for f in fields if not _field_exists(f)] == []
    assert not _field_exists("algorithm.noSuchField") and not _field_exists("algorithm.lora.rank.x")


def test_the_platform_guide_explains_every_condition_and_reason_the_operator_sets():
    from kuberl.api.status import ConditionType
    from kuberl.operator.labels import EventReason, Reason

    source = "\n".join(p.read_text() for p in (ROOT / "operator" / "kuberl" / "operator").rglob("*.py") if p.name != "labels.py")
    used = {r.value for r in Reason if re.search(rf"(?<!\w)Reason\.{r.name}\b", source)}
    used |= {r.value for r in EventReason if re.search(rf"(?<!\w)EventReason\.{r.name}\b", source)}
    assert {"ConfigurationError", "SecretNotFound", "ScaledUp", "CheckpointSaved"} <= used  # the scan finds them
    section = _section(DOCS / "operations.md", "## Troubleshooting")
    named = set(re.findall(r"`([A-Za-z]+)`", section))
    missing = sorted(({c.value for c in ConditionType} | used) - named)
    assert missing == [], f"docs/operations.md, Troubleshooting, does not explain {missing}"
