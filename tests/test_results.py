"""The README's results table is experiments/results.py's output, and every row's verdict follows the rules of
docs/reproductions.md from its JSON: no 'reproduces' from overlapping intervals or fewer than three seeds, no claim
from fewer seeds than three without the row saying so."""

import re

import pytest

from conftest import ROOT
from experiments import results


def test_verdict_rules_in_order():
    assert results.verdict(None, 3, 1, 1) == "not tested"
    assert results.verdict(False, 3, 1, 1) == "not at this scale"
    assert results.verdict(True, 3, 1, 1) == "reproduces"
    assert results.verdict(True, 2, 1, 1) == "direction only"  # apart, but two seeds
    assert results.verdict(True, 3, 1, 0) == "direction only"  # the paper's direction, intervals overlapping
    assert results.verdict(True, 3, -1, 0) == "not reproduced"
    assert results.verdict(True, 3, -1, -1) == "not reproduced"
    assert results.verdict(True, 3, 0, 0) == "not reproduced"  # no difference at all


def test_readme_table_is_the_functions_output():
    with open(f"{ROOT}/README.md", encoding="utf-8") as f:
        assert results.readme_table(f.read()) == results.table()


@pytest.mark.parametrize("row", results.rows(), ids=lambda row: row[0])
def test_each_row_follows_the_rules_and_says_its_seeds(row):
    claim, paper, measured, verdict, study, (regime, seeds, direction, apart) = row
    assert verdict == results.verdict(regime, seeds, direction, apart)
    if verdict == "reproduces":  # intervals apart in the paper's direction, over at least three seeds
        assert seeds >= 3 and apart == 1 and direction == 1
    if seeds < 3:  # a claim from fewer seeds says how many
        assert re.search(r"one seed|\b[12] seeds", measured), measured
    visible = re.sub(r"\]\([^)]*\)", "]", f"| {claim} | {paper} | {measured} | {verdict} | {study} |")
    assert len(visible) <= 200, visible  # the table stays readable; numbers are one link away
