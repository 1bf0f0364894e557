"""The README starts where users start (issue 34): short, the first screen holds what a new user
needs, and every file it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_under_400_lines():
    assert len(README.splitlines()) < 400


def test_first_screen_has_install_example_cost_and_first_command():
    first = "\n".join(README.splitlines()[:50])
    assert "pip install" in first
    assert 'strategy="replay"' in first  # the three-line example
    assert re.search(r"1\.0\d-1\.0\dx", first), "the cost against torch checkpoint"
    assert "lightning_replay.demos.hazard_demo" in first
    assert ".venv/bin/python" in first
    assert "make test" in first and "make demo" in first


def test_every_relative_link_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    local = [x for x in links if "://" not in x]
    assert local, "the README links the docs and the benchmarks' history"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing, missing
