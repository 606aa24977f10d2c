"""The documentation stays true: a front page, product words only, a configuration reference that is
the schema's, facts in code blocks that the library confirms, and example outputs that a fresh
run reproduces (the check itself runs in CI: `python examples/doc_outputs.py check`; here, that its
comparison fails on a stale number and passes on a machine's speed)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import taco
from taco.train.config import config_reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DEVELOPMENT_WORDS = {  # how the product was made is not what it is
    "an issue number": r"(?i)\bissues? ?#?\d+",
    "a commit hash": r"(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w./-])",
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a work session": r"(?i)\bsessions?\b",
    "a commit": r"(?i)\bcommits?\b",
    "a diary's superlative": r"(?i)\bclosest yet\b",
}


def _doc_outputs():
    spec = importlib.util.spec_from_file_location("doc_outputs", ROOT / "examples" / "doc_outputs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for must in ("pip install torch==2.13.0 && pip install -e . && taco train --config configs/demo.toml",
                 "pip install -e '.[dev]' && pytest", "docs/cluster_speedup.png"):  # fmt: skip
        assert must in text, must


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_speak_of_the_product_only(page):
    text = page.read_text()
    for what, pattern in DEVELOPMENT_WORDS.items():
        m = re.search(pattern, text)
        assert m is None, f"{page.name} has {what}: {text[max(0, m.start() - 60) : m.end() + 60]!r}"


def test_the_development_words_are_caught():
    caught = ("see issue 13", "Issue #7's", "at a6fa2f8,", "on 2026-12-04", "one session", "Closest yet")
    for sample in caught:
        assert any(re.search(p, sample) for p in DEVELOPMENT_WORDS.values()), sample
    for sample in ("text-text-229665b5c653-tok4d40", "issue order", "sha256 per file", "1e-30 to 1e30"):
        assert not any(re.search(p, sample) for p in DEVELOPMENT_WORDS.values()), sample


def test_the_configuration_reference_is_generated_from_the_schema():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == config_reference(), (
        "docs/configuration.md differs from the schema: regenerate it with "
        "`taco config show --markdown > docs/configuration.md`"
    )


def test_every_page_is_in_the_site_navigation():
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_codec_facts_in_code_blocks_hold():
    codecs = (ROOT / "docs" / "codecs.md").read_text()
    block = codecs[codecs.index("taco.list_codecs()") : codecs.index("codec = taco.get_codec")]
    assert re.findall(r"'([\w-]+)'", block) == taco.list_codecs()
    for page in ("README.md", "docs/codecs.md"):
        text = (ROOT / page).read_text()
        assert "packed.nbytes" in text and "# 17825792 = 16M * (1 + 8/128)" in text, page
    assert taco.get_codec("taco", group_size=128, fmt="e4m3").nbytes(4096 * 4096) == 17825792


def test_documented_outputs_are_generated_and_checked():
    mod = _doc_outputs()
    for name in mod.EXAMPLES:
        text = mod.documented(name)
        assert text.startswith("$ ") and "(generated)" not in text, name


def test_a_stale_number_in_an_example_output_fails_the_check():
    mod = _doc_outputs()
    doc = (
        "$ taco train --config configs/demo.toml\n"
        "[data] tokenizing 4 documents (36,642 characters)\n"
        "[####] step   200/200 loss 4.9831 val 5.0527 lr 2.00e-04 2,518 tok/s mfu 1.23% mem 0.41 GiB eta 0s\n"
        "[taco] done in 182s: final val loss 5.0527, 2,518 tok/s\n"
        "max |taco - transformers| = 7.15e-07"
    )
    assert mod.differences(doc, doc) == []
    faster = doc.replace("2,518", "9,100").replace("182s", "40s").replace("1.23%", "4.50%").replace(
        "0.41 GiB", "1.20 GiB").replace("7.15e-07", "9.54e-07")  # fmt: skip
    assert mod.differences(doc, faster) == []  # the machine's speed is not a documented fact
    assert mod.differences(doc, doc.replace("5.0527", "5.0532")) == []  # float rounding
    for old, new in (("5.0527", "5.7461"), ("4 documents", "5 documents"), ("36,642", "36,643"),
                     ("step   200/200", "step    50/50")):  # fmt: skip
        assert mod.differences(doc, doc.replace(old, new)), new
    assert mod.differences(doc, doc + "\nan extra line")
