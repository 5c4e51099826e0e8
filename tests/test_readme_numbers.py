"""The root README stays a short front page whose numbers come from the docs.

Every number the README states must appear, with the same digits, in at least one
``docs/*.md`` page, where the measurement it comes from is described; and the README is at
most 120 lines.

A number says where it was measured: for every README number, at least one docs *section*
holding it (``docs_sections``: the text from one markdown heading, any level, to the next;
``#`` lines inside fenced code are not headings) also names the CPU kind it ran on
(``MACHINE``: "AMD EPYC", "Intel Xeon" or "AVX2 only", as ``lscpu`` tells them apart; learning
figures differ by CPU kind, not only speed). ``NOT_MEASURED`` lists the few README numbers
that are no measurement, each with the reason.

Which tokens count as numbers (``number_tokens``):

- a token starts at a digit that does not follow a letter, a digit, ``_`` or ``.``, and is
  digits with optional ``.digits`` parts (``0.275``, ``2.3``, ``1.16.0``, ``8192``); what
  follows it does not matter (``2.16x``, ``135M``, ``7.3 %``), so digits inside names
  (``FSDP2``, ``smollm2_rm.yaml``, ``qwen2.5``) are not numbers;
- two numbers joined by ``–`` or ``-`` (spaces allowed) are one range token (``35–40``,
  ``1-25``), written with ``–`` and no spaces, and must appear as that range in the docs;
- a decimal or a range always counts; an integer counts from 10 up (single digits —
  ``2 cores``, ``step 1`` — are left out);
- ignored: version requirements, i.e. a number right after ``>=``, ``<=``, ``==``, ``~=``,
  ``!=``, ``<``, ``>`` or ``≥`` (``torch>=2.4``, ``Python ≥ 3.11``), and link targets
  (the ``(...)`` of ``[text](...)``, ``http(s)://`` addresses).

The docs' side is read with the same tokenizer, every token and range kept (small
integers too), so ``0.79`` does not match a documented ``0.790``.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 120

MACHINE = re.compile(r"AMD EPYC|Intel Xeon|AVX2[- ]only", re.IGNORECASE)
NOT_MEASURED = {
    "135": "SmolLM2-135M-Instruct: the model's name (its parameter count), not a result",
}

_NUM = r"\d+(?:\.\d+)*"
_TOKEN = re.compile(rf"(?<![\w.])({_NUM})(?:\s*[–-]\s*({_NUM}))?")
_REQUIREMENT = re.compile(r"(?:>=|<=|==|~=|!=|<|>|≥)\s*$")
_LINK_TARGET = re.compile(r"\]\([^)]*\)|https?://\S+")
_HEADING = re.compile(r"#{1,6}\s")
_FENCE = re.compile(r"\s*(```|~~~)")


def number_tokens(text: str, *, all_tokens: bool = False) -> list[str]:
    """The number tokens of ``text`` by the module's rule (``all_tokens``: small integers
    and requirement specifiers too, and each end of a range besides the range)."""
    text = _LINK_TARGET.sub("", text)
    found = []
    for m in _TOKEN.finditer(text):
        first, second = m.group(1), m.group(2)
        if not all_tokens and _REQUIREMENT.search(text[max(0, m.start() - 3) : m.start()]):
            continue
        if second is not None:
            found.append(f"{first}–{second}")
            if all_tokens:
                found += [first, second]
        elif all_tokens or "." in first or int(first) >= 10:
            found.append(first)
    return found


def docs_tokens() -> set[str]:
    return {t for page in DOCS for t in number_tokens(page.read_text(), all_tokens=True)}


def docs_sections(text: str) -> list[str]:
    """``text`` cut at its markdown headings (any level; not inside fenced code): each
    section is a heading line and what follows it up to the next one (the first: what comes
    before the first heading)."""
    sections: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and _HEADING.match(line):
            sections.append([])
        sections[-1].append(line)
    return ["\n".join(lines) for lines in sections]


def test_the_tokenizer_follows_its_rule() -> None:
    text = (
        "from 0.275 to 0.790 in 2.3 min, +35–40 points, ~3x TRL, 120 problems, 2 cores, "
        "torch>=2.4, Python ≥ 3.11, FSDP2, smollm2_rm.yaml, 2.16x, [docs](docs/x1.md), "
        "steps 1-25, trl 1.16.0."
    )
    assert number_tokens(text) == [
        "0.275",
        "0.790",
        "2.3",
        "35–40",
        "120",
        "2.16",
        "1–25",
        "1.16.0",
    ]


def test_docs_sections_split_at_headings() -> None:
    text = "intro 1.5\n# A\na 2.5\n```sh\n# not a heading\n```\n### B\nb 3.5\n#no-space\n"
    assert docs_sections(text) == [
        "intro 1.5",
        "# A\na 2.5\n```sh\n# not a heading\n```",
        "### B\nb 3.5\n#no-space",
    ]


def test_readme_numbers_are_in_the_docs() -> None:
    documented = docs_tokens()
    missing = sorted({t for t in number_tokens(README.read_text()) if t not in documented})
    assert not missing, (
        f"numbers in README.md that no docs/*.md page has (same digits): {missing}; "
        "put the measurement in the docs page it belongs to, or drop the number"
    )


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines, more than {MAX_LINES}"


def test_readme_numbers_stand_in_the_docs_with_their_machine() -> None:
    readme = set(number_tokens(README.read_text()))
    stale = sorted(set(NOT_MEASURED) - readme)
    assert not stale, f"NOT_MEASURED lists numbers the README no longer states: {stale}"
    with_machine = {
        token
        for page in DOCS
        for section in docs_sections(page.read_text())
        if MACHINE.search(section)
        for token in number_tokens(section, all_tokens=True)
    }
    unplaced = sorted(readme - with_machine - set(NOT_MEASURED))
    assert not unplaced, (
        f"numbers in README.md that no docs/*.md section naming its machine holds: {unplaced}; "
        "the section (heading to heading) that gives the measurement must name the CPU kind it "
        f"ran on ({MACHINE.pattern}, e.g. '2-core AMD EPYC with AVX512-BF16') and, for a "
        "learning result, its seeds"
    )
