"""The § citations in the Clipper half point at sections that exist and are about the code citing them.

A bare `§` or `lecture §` is the lecture's (its sections are the first column of seeds/README.md);
`Clipper paper §` (or `paper §`) is the NSDI 2017 paper's, whose sections are named below.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "clipper").glob("*.py")) + sorted((ROOT / "experiments").glob("01_clipper_*.py"))

# The Clipper paper's sections this code implements, and the modules each is about.
PAPER = {
    "4.1": ("Caching", {"cache"}),
    "4.2": ("Batching", {"controllers", "profile", "closed_loop", "queue_sim"}),
    "4.2.1": ("Delayed Batching", {"queue_sim"}),
    "4.3": ("Model Containers", {"container", "torch_models", "toy_models"}),
    "5": ("Model Selection Layer", {"selection", "straggler"}),
}
PAPER_CITE = re.compile(r"(?:Clipper paper|Clipper|paper) §(\d+(?:\.\d+)*)")
LECTURE_CITE = re.compile(r"§(\d+(?:\.\d+)*)(?:[–-](\d+(?:\.\d+)*))?")


def _lecture_sections() -> set[str]:
    rows = [line.split("|")[1] for line in (ROOT / "seeds" / "README.md").read_text().splitlines()
            if line.startswith("| §")]
    return {m.group(1) for row in rows for m in re.finditer(r"§(\d+(?:\.\d+)?)", row)} | {"2", "4"}


def test_every_lecture_section_cited_exists():
    known = _lecture_sections()
    assert {"2.1", "2.2", "2.3", "2.4", "2.6"} <= known
    bad = []
    for f in FILES:
        text = PAPER_CITE.sub("", f.read_text())
        for m in LECTURE_CITE.finditer(text):
            for sec in filter(None, m.groups()):
                if sec not in known:
                    bad.append(f"{f.relative_to(ROOT)}: §{sec}")
    assert not bad, f"lecture sections that do not exist: {bad}"


def test_every_paper_section_cited_is_about_the_module_citing_it():
    bad = []
    for f in FILES:
        for m in PAPER_CITE.finditer(f.read_text()):
            sec = m.group(1)
            if sec not in PAPER or f.stem not in PAPER[sec][1]:
                bad.append(f"{f.relative_to(ROOT)}: Clipper paper §{sec}")
    assert not bad, f"paper sections cited by modules they are not about: {bad}"
