"""Every relative link in the repository's Markdown resolves: `[text](path)` names a file or folder that
exists, and `[text](path.md#anchor)` or `[text](#anchor)` a heading of that page (GitHub's anchors: the
heading's text in lower case, punctuation dropped, spaces as hyphens, `-1`, `-2`... for repeats). Links to
other sites are not fetched. Run on every tracked `*.md` file, README.md, docs/ and bench/README.md among
them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target ends at whitespace (before an optional "title") or ")".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    """The tracked Markdown files; outside a git checkout, every *.md not under a build or venv folder."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        return sorted(ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file())
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "target", "node_modules"}
        return sorted(p for p in ROOT.rglob("*.md") if not skip.intersection(p.relative_to(ROOT).parts))


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation out, spaces as hyphens."""
    text = INLINE_CODE.sub(lambda m: m[2], heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match[2])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of one Markdown file, as "line N: target: why"."""
    problems = []
    text = path.read_text(encoding="utf-8")
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not target or EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            if file_part.startswith("/"):
                destination = root / file_part.lstrip("/")
            else:
                destination = (path.parent / file_part).resolve() if file_part else path
            if not destination.exists():
                problems.append(f"line {number}: {target}: no such file {destination}")
            elif anchor and destination.suffix == ".md" and anchor.lower() not in anchors(destination):
                problems.append(f"line {number}: {target}: no heading #{anchor} in {destination.name}")
    return problems


FILES = markdown_files()


def test_there_are_pages_to_check() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in FILES}
    assert {"README.md", "docs/flags.md", "bench/README.md"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, f"{path.relative_to(ROOT)} has broken links:\n" + "\n".join(problems)


def test_slugs_follow_github() -> None:
    assert slug("Behind a load balancer: nginx and docker compose") == (
        "behind-a-load-balancer-nginx-and-docker-compose"
    )
    assert slug("OpenAI API: `/v1/completions`, `/v1/models`") == "openai-api-v1completions-v1models"
    assert slug("`POST /tokenize`, `POST /detokenize`") == "post-tokenize-post-detokenize"
    assert slug("bfloat16 K in pairs") == "bfloat16-k-in-pairs"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-section) [fine](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [no heading here](#elsewhere)\n"
        "```\n[in a code block](ignored.md)\n```\n`[in code](ignored.md)`\n"
    )
    problems = broken_links(page, tmp_path)
    assert [problem.split(":")[1].strip() for problem in problems] == [
        "missing.md",
        "other.md#nowhere",
        "#elsewhere",
    ], problems
