"""AGENTS.md and CONTRIBUTING.md state the same style rules, each with a good and a bad example."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = (3, 5, 16, 17, 23, 24, 25, 26, 29)


def _rules_section(name: str) -> str:
    text = (ROOT / name).read_text()
    start = text.index("## Style rules")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_both_files_carry_the_same_rules_section() -> None:
    assert _rules_section("AGENTS.md") == _rules_section("CONTRIBUTING.md")


def test_each_rule_has_a_good_and_a_bad_example() -> None:
    section = _rules_section("CONTRIBUTING.md")
    blocks = re.split(r"\n(?=\*\*\d+\. )", section)[1:]
    assert [int(re.match(r"\*\*(\d+)\.", b).group(1)) for b in blocks] == list(RULES)
    for block in blocks:
        assert "\n- Good: " in block and "\n- Bad: " in block, block.splitlines()[0]
