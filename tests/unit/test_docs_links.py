"""Every relative link in README.md and docs/**/*.md resolves: the file (or folder) exists, and a `#anchor` names a
heading of the target page as GitHub renders it.

GitHub's anchor for a heading (github-slugger): the heading's rendered text (inline code keeps its content, a
link keeps its text, emphasis marks and HTML tags go), lower-cased, every character that is not a letter, a digit,
a space, `-` or `_` removed, each space turned into `-`; a second heading with the same anchor gets `-1`, a third
`-2`. Headings inside fenced code blocks are no headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The page without fenced code blocks (their lines kept blank, so line numbers stay right)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor of one heading's markdown text (without the duplicate suffix)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "")  # inline code keeps its content
    text = re.sub(r"(?<!\w)_(?=\S)(.+?)(?<=\S)_(?!\w)", r"\1", text)  # _emphasis_ (snake_case stays)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page's headings, duplicates numbered, plus explicit <a id/name> anchors."""
    text = prose(page.read_text())
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image outside code."""
    out = []
    for number, line in enumerate(prose(page.read_text()).splitlines(), 1):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            out.append((number, target))
    return out


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the page's relative links, one line each (paths shown relative to `root`)."""
    problems = []
    for number, link in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        where = f"{page.relative_to(root)}:{number}: {link}"
        if not path.exists():
            problems.append(f"{where}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{where}: no heading with anchor #{anchor} in {path.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


@pytest.mark.parametrize("heading,anchor", [
    ("GPU figures (one NVIDIA H200, 2026-11-27 and 2026-11-28)", "gpu-figures-one-nvidia-h200-2026-11-27-and-2026-11-28"),
    ("Session 24 (2026-11-29): page faults in the trainer", "session-24-2026-11-29-page-faults-in-the-trainer"),
    ("Stopping and killing `kuberl run`", "stopping-and-killing-kuberl-run"),
    ("Chaos: random kill -9 during a run", "chaos-random-kill--9-during-a-run"),
    ("KubeRL against TRL's GRPOTrainer", "kuberl-against-trls-grpotrainer"),
    ("bench_trl", "bench_trl"),
    ("`spec.tracking`", "spectracking"),
    ("**Bold** _and_ [a link](x.md) ≥ 0.8 × π", "bold-and-a-link--08--π"),
    ("Per-experiment users on a shared NATS (JWT mode)", "per-experiment-users-on-a-shared-nats-jwt-mode"),
])
def test_anchors_follow_githubs_rules(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_duplicate_headings_are_numbered_and_code_blocks_hold_no_headings(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Limits\n\n```bash\n# not a heading\n```\n\n## Limits\n\n### Limits\n")
    assert anchors(page) == {"limits", "limits-1", "limits-2"}


def test_a_missing_file_or_heading_is_reported_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# There\n")
    page = tmp_path / "page.md"
    page.write_text("# Here\n\n[ok](other.md#there) [self](#here) [code `[x](nowhere.md)`]\n"
                    "[gone](missing.md) [wrong](other.md#elsewhere)\n```\n[in code](nowhere.md)\n```\n")
    problems = [p.split(": ", 1)[1] for p in broken(page, tmp_path)]
    assert problems == ["missing.md: no such file", "other.md#elsewhere: no heading with anchor #elsewhere in other.md"]

