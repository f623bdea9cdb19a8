"""Every relative link in README.md, docs/ and results/ resolves: the file exists, and a
`#anchor` names a heading of the target (GitHub's slugs). Plain text; no jax import."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "results").rglob("*.md")])

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
  """The lines outside fenced code blocks, with inline code spans removed."""
  out, fenced = [], False
  for line in text.splitlines():
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      out.append(re.sub(r"`[^`]*`", "``", line))
  return out


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than '-' and
  '_' dropped, spaces to '-'."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links keep their text
  text = re.sub(r"<[^>]+>", "", text).lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """Every heading anchor of a Markdown file, with GitHub's -1, -2 ... for repeats."""
  seen: dict[str, int] = {}
  out = set()
  fenced = False
  for line in path.read_text(encoding="utf-8").splitlines():
    if _FENCE.match(line):
      fenced = not fenced
      continue
    m = None if fenced else _HEADING.match(line)
    if m:
      base = slug(m.group(2))
      n = seen.get(base, 0)
      seen[base] = n + 1
      out.add(base if n == 0 else f"{base}-{n}")
  return out


def links(path: pathlib.Path) -> list[str]:
  """The relative link targets of a Markdown file (not URLs, not mail)."""
  out = []
  for line in _prose(path.read_text(encoding="utf-8")):
    for target in _LINK.findall(line):
      if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        out.append(target)
  return out


def test_slug_follows_github():
  assert slug("Decode attention, one layer (`benchmarks/decode_attention.py`)") == \
      "decode-attention-one-layer-benchmarksdecode_attentionpy"
  assert slug("Stage-2 variants: calibration and held-out runs (issue #13)") == \
      "stage-2-variants-calibration-and-held-out-runs-issue-13"
  assert slug("Why Quest scores 0 on SmolLM2: page size, not a bug") == \
      "why-quest-scores-0-on-smollm2-page-size-not-a-bug"


def test_pages_found():
  assert ROOT / "README.md" in PAGES and len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
  bad = []
  for target in links(page):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      bad.append(f"{target}: no such file")
      continue
    if anchor:
      if dest.is_dir() or dest.suffix.lower() != ".md":
        bad.append(f"{target}: anchor into a non-Markdown target")
      elif anchor not in anchors(dest):
        bad.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
  assert not bad, "\n".join(bad)


def test_readme_test_command_is_what_ci_runs():
  """The README promises its test command is exactly `.ci/run`'s last step."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
  assert ci.startswith("python3 -m pip install") and "pytest" in ci
  assert f"\n    {ci}\n" in readme
