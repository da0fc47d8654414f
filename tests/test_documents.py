"""The documents held to the code: every pointer from code or a document to a document names a heading that
exists there, every link and every repository path a document names is in the repository, nothing cites what
is outside it, and README.md stays a page a newcomer reads in minutes."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    p for p in ROOT.rglob("*.md") if not p.relative_to(ROOT).parts[0].startswith(".") and "models" not in p.parts
)
CODE = sorted(
    p
    for top in ("engine", "desktop", "tests", "resources")
    for p in (ROOT / top).rglob("*")
    if p.suffix in (".py", ".c", ".h", ".qss") and "__pycache__" not in p.parts and p.name != "test_documents.py"
)
# `path.md, "Heading"`: the way code and documents point at a section (the heading may wrap across lines)
POINTER = re.compile(r"([\w./-]*\b[\w-]+\.md),[\s#*]+\"([^\"]+)\"")
# `path.md, *Heading*` or `[path.md](path.md), *Heading*`: the form the documents use in prose
POINTER_EM = re.compile(r"([\w./-]*\b[\w-]+\.md)\)?,[ \t\n]+\*([^*\n]+(?:\n[^*\n]+)?)\*")
# what the repository cannot hold: the workplace's issue numbers and commit hashes, its shared folder
CITED = re.compile(r"\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\((?=\d*[a-f])[0-9a-f]{7,12}\b[,)]|\bshared/", flags=re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:engine|desktop|tests|resources|\.ci)/[\w./-]*)`")


def headings(doc: Path) -> set[str]:
    """The document's headings, as written after the #s."""
    out, fenced = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.add(line.lstrip("#").strip())
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def resolve(name: str, where: Path) -> Path | None:
    """A document named from `where`: relative to it, else to the repository's root."""
    for base in (where.parent, ROOT):
        p = (base / name).resolve()
        if p.exists():
            return p
    return None


def pointers(path: Path) -> list[tuple[str, str]]:
    text = path.read_text(encoding="utf-8")
    found = POINTER.findall(text) + POINTER_EM.findall(text)
    return [(doc, re.sub(r"[\s#*]+", " ", heading).strip()) for doc, heading in found]


def test_the_checks_read_pointers_links_and_headings(tmp_path):
    """What the tests below rest on: a pointer wrapped in a comment, a link with an anchor, a fenced '#'."""
    doc = tmp_path / "GUIDE.md"
    doc.write_text("# Guide\n\n## The seam, measured\n\n```sh\n# not a heading\n```\n", encoding="utf-8")
    src = tmp_path / "x.py"
    src.write_text('# see GUIDE.md, "The seam,\n# measured" for why\n', encoding="utf-8")
    assert headings(doc) == {"Guide", "The seam, measured"}
    assert pointers(src) == [("GUIDE.md", "The seam, measured")]
    assert slug("What `engine serve` costs on loopback") == "what-engine-serve-costs-on-loopback"
    assert LINK.findall("see [the seam](desktop/README.md#the-seam).") == ["desktop/README.md#the-seam"]
    prose = tmp_path / "y.md"
    prose.write_text("see ([GUIDE.md](GUIDE.md), *The seam,\nmeasured*) and GUIDE.md, *No such*.\n", encoding="utf-8")
    assert pointers(prose) == [("GUIDE.md", "The seam, measured"), ("GUIDE.md", "No such")]
    cited = CITED.findall("fixed in issue #12, see commit 5e1d5d2; issue 48")
    assert cited == ["issue #12", "commit 5e1d5d2", "issue 48"]


@pytest.mark.parametrize("path", CODE + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_pointer_names_a_heading_that_exists(path):
    bad = []
    for name, heading in pointers(path):
        doc = resolve(name, path)
        if doc is None:
            bad.append(f"{name}: no such document")
        elif heading not in headings(doc):
            bad.append(f'{name}, "{heading}": no such heading')
    assert bad == []


def test_code_names_a_document_only_by_its_file():
    """'README: the seam' was how pointers dangled: a document is named by its path (and a heading quoted)."""
    loose = re.compile(r"README(?!\.md)|\b(?:BENCHMARKS|MODELS|SERVING)\b(?!\.md)")
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in CODE
        for i, ln in enumerate(p.read_text().splitlines(), 1)
        if loose.search(ln)
    ]
    assert bad == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_a_document_names_is_in_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    bad = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        name, _, anchor = target.partition("#")
        found = resolve(name, doc) if name else doc
        if found is None:
            bad.append(f"link {target}: no such file")
        elif anchor and found.suffix == ".md" and anchor not in {slug(h) for h in headings(found)}:
            bad.append(f"link {target}: no such heading")
    for path in REPO_PATH.findall(text):
        if not (ROOT / path).exists():
            bad.append(f"path {path}: not in the repository")
    assert bad == []


@pytest.mark.parametrize("path", CODE + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_cites_what_is_outside_the_repository(path):
    """No issue numbers, commit hashes or files of the workplace outside the checkout, in code or documents."""
    assert CITED.findall(path.read_text(encoding="utf-8")) == []


def test_readme_is_short_and_names_the_documents_beside_the_code():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    for doc in ("engine/README.md", "engine/BENCHMARKS.md", "engine/MODELS.md", "engine/SERVING.md"):
        assert f"]({doc})" in readme, doc
    for doc in ("desktop/README.md", "tests/README.md"):
        assert f"]({doc})" in readme, doc


def test_the_readmes_layout_names_every_product_module():
    """README.md's Layout is the map of the house: every product module (engine/ and desktop/, their C sources,
    not the tools) is named there by its name."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") : readme.index("## Documents")]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", layout))
    modules = [
        p
        for top in ("engine", "desktop")
        for p in (ROOT / top).rglob("*")
        if p.suffix in (".py", ".c", ".h") and "tools" not in p.parts and p.stem not in ("__init__", "__main__")
    ]
    missing = [str(p.relative_to(ROOT)) for p in modules if p.stem not in words and p.name not in words]
    assert missing == []
    assert len(modules) > 80


def test_every_test_a_document_names_exists():
    """The failure table and the documents cite tests by name: each is a test that exists (a name cut with
    '…' is a prefix of one)."""
    defined = set()
    for p in (ROOT / "tests").rglob("test_*.py"):
        defined.update(re.findall(r"^(?:async )?def (test_\w+)", p.read_text(encoding="utf-8"), flags=re.M))
    bad, cited = [], 0
    for doc in DOCS:
        for name, cut in re.findall(r"`(test_\w+)(…?)`", doc.read_text(encoding="utf-8")):
            cited += 1
            if not (any(d.startswith(name) for d in defined) if cut else name in defined):
                bad.append(f"{doc.relative_to(ROOT)}: {name}")
    assert bad == [] and cited >= 15  # the failure table alone cites more than that
