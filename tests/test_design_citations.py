"""Every design citation in the code names something docs/design.md defines.

Citation forms understood, anywhere in a .py file (comments, docstrings, strings):

* `DESIGN invariant 3`, `DESIGN invariants 3 and 4`, `DESIGN invariants 1, 3 and 5`;
* `DESIGN "Reconcile tick"` (or single quotes): the exact title of a heading in docs/design.md;
* `invariant 3`, `invariants 3 and 4` without the word DESIGN: the same numbered rules.

A citation may wrap: line breaks and a comment's `#` may stand between its words, but a
quoted title stays on one line. The word DESIGN in capitals in any other form fails the test
with its file and line, so a citation this test cannot read is never let through as if it
were right. An invariant is a heading `N. Title` of docs/design.md; they are numbered 1..N.

Scanned: every .py file under the repository, except hidden folders (.venv, .git, caches),
`var/` (runtime data, ignored by git), `__pycache__`, and this file, whose examples are wrong on
purpose.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN_DOC = ROOT / "docs" / "design.md"
SKIPPED_FOLDERS = {"var", "__pycache__", "node_modules"}

# Between the words of a citation: spaces, line breaks and the `#` of a wrapped comment.
_GAP = r"[\s#]+"
_NUMBERS = rf"\d+(?:(?:\s*,{_GAP}|{_GAP}and{_GAP})\d+)*"
_INVARIANTS = re.compile(rf"\b[Ii]nvariants?{_GAP}(?P<numbers>{_NUMBERS})")
_DESIGN = re.compile(r"\bDESIGN\b")
_AFTER_DESIGN = re.compile(rf"{_GAP}(?:invariants?{_GAP}{_NUMBERS}\b|\"(?P<double>[^\"\n]+)\"|'(?P<single>[^'\n]+)')")
_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*$")
_NUMBERED = re.compile(r"^(?P<number>\d+)\.\s+\S")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class Design:
    """What docs/design.md defines: the titles of its headings and the numbers of its invariants."""

    sections: frozenset[str]
    invariants: frozenset[int]


@dataclass(frozen=True)
class Citation:
    """One citation in a source text: an invariant number or a section title, with its line."""

    line: int
    invariant: int | None = None
    section: str | None = None


class CitationFormError(ValueError):
    """The word DESIGN where no citation form this test understands follows it."""

    def __init__(self, line: int, text: str):
        super().__init__(f"line {line}: unrecognised citation form {text!r}")
        self.line, self.text = line, text


def parse_design(text: str) -> Design:
    """The headings and invariants of a design document; ValueError when its invariants are not 1..N."""
    titles: list[str] = []
    in_code = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code and (heading := _HEADING.match(line)):
            titles.append(" ".join(heading["title"].split()))
    numbers = [int(found["number"]) for title in titles if (found := _NUMBERED.match(title))]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"invariants must be headings numbered 1..N in order, found {numbers}")
    return Design(sections=frozenset(titles), invariants=frozenset(numbers))


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def forms_not_understood(text: str) -> list[CitationFormError]:
    """One error for each DESIGN in a source text that no citation form this test reads follows."""
    return [
        CitationFormError(_line_of(text, match.start()), text[match.start() : match.end() + 40].split("\n")[0])
        for match in _DESIGN.finditer(text)
        if _AFTER_DESIGN.match(text, match.end()) is None
    ]


def citations_in(text: str) -> list[Citation]:
    """Every citation in a source text; CitationFormError at the first DESIGN in a form not understood."""
    for error in forms_not_understood(text):
        raise error
    found: list[Citation] = []
    for match in _DESIGN.finditer(text):
        after = _AFTER_DESIGN.match(text, match.end())
        assert after is not None  # forms_not_understood found none
        title = after["double"] or after["single"]
        if title is not None:
            found.append(Citation(_line_of(text, match.start()), section=" ".join(title.split())))
    for match in _INVARIANTS.finditer(text):
        line = _line_of(text, match.start())
        found.extend(Citation(line, invariant=int(n)) for n in re.findall(r"\d+", match["numbers"]))
    return sorted(found, key=lambda c: c.line)


def undefined(citations: list[Citation], design: Design) -> list[Citation]:
    """The citations that name an invariant or a section the design does not define."""
    return [
        c
        for c in citations
        if (c.invariant is not None and c.invariant not in design.invariants)
        or (c.section is not None and c.section not in design.sections)
    ]


def source_files(root: Path = ROOT) -> Iterator[Path]:
    """Every .py file of the repository that may cite the design (see the module docstring)."""
    this = Path(__file__).resolve()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in SKIPPED_FOLDERS)
        for name in sorted(files):
            path = Path(folder, name)
            if name.endswith(".py") and path.resolve() != this:
                yield path


def _describe(citation: Citation) -> str:
    if citation.invariant is not None:
        return f"invariant {citation.invariant}"
    return f'section "{citation.section}"'


def test_every_citation_names_what_the_design_defines():
    design = parse_design(DESIGN_DOC.read_text())
    problems = []
    for path in source_files():
        where = path.relative_to(ROOT)
        text = path.read_text()
        not_understood = forms_not_understood(text)
        problems.extend(f"{where}:{exc.line}: unrecognised citation form {exc.text!r}" for exc in not_understood)
        if not_understood:
            continue
        cited = citations_in(text)
        problems.extend(
            f"{where}:{c.line}: cites {_describe(c)}, which docs/design.md does not define"
            for c in undefined(cited, design)
        )
    assert problems == []


def test_the_scan_finds_the_code_s_citations():
    """A guard against a scan that silently reads nothing: the lease module cites invariant 1."""
    lease = ROOT / "reconciler" / "leadership" / "lease.py"
    assert lease in set(source_files())
    assert Citation(1, invariant=1) in citations_in(lease.read_text())


def test_the_design_defines_what_the_code_leans_on():
    design = parse_design(DESIGN_DOC.read_text())
    assert design.invariants == frozenset(range(1, 10))
    assert {"Processes", "Reconcile tick", "One eviction order", "Stopping is always a drain"} <= design.sections


FAKE_DESIGN = """# Title
## Invariants
### 1. One leader
### 2. One shard per GPU
## Reconcile tick
```
## not a heading: inside a code block
```
"""


def test_the_parser_reads_headings_and_invariants():
    design = parse_design(FAKE_DESIGN)
    assert design.invariants == {1, 2}
    assert "Reconcile tick" in design.sections
    assert "not a heading: inside a code block" not in design.sections


def test_invariants_must_be_numbered_in_order():
    with pytest.raises(ValueError, match="numbered 1..N"):
        parse_design("## Invariants\n### 1. One\n### 3. Three\n")


def test_each_citation_form_is_read():
    text = (
        "x = 1  # the lease (DESIGN invariant 2)\n"
        '"""Usage (DESIGN invariants 1, 2 and 7), see DESIGN "Reconcile tick".\n'
        "Wrapped: (DESIGN\n"
        "invariant 1). Bare: invariants 1 and 2.\n"
        '"""\n'
        "# also wrapped in a comment (DESIGN\n"
        "# 'One leader')\n"
    )
    cited = citations_in(text)
    assert {c.invariant for c in cited if c.invariant} == {1, 2, 7}
    assert {c.section for c in cited if c.section} == {"Reconcile tick", "One leader"}
    assert Citation(1, invariant=2) in cited
    assert Citation(4, invariant=1) in cited  # a wrapped citation's number is on the line of the word "invariant"


def test_a_fake_citation_is_caught():
    design = parse_design(FAKE_DESIGN)
    cited = citations_in('# (DESIGN invariant 42)\n# DESIGN "No such section"\n# invariant 2 is fine\n')
    assert undefined(cited, design) == [Citation(1, invariant=42), Citation(2, section="No such section")]


@pytest.mark.parametrize(
    "text",
    [
        "# see DESIGN for why",
        "# DESIGN: the router depends on the hub only",
        "# DESIGN invariant three",
        '# DESIGN "a title that\nwraps"',
        "# the DESIGN.md file",
    ],
)
def test_a_form_the_parser_does_not_understand_fails_loudly(text):
    with pytest.raises(CitationFormError, match="unrecognised citation form"):
        citations_in(text)


def test_design_in_a_name_is_not_a_citation():
    assert citations_in("DESIGN_DOC = 'x'\nredesign = 1\n") == []
