"""The helpers the reproduction scripts in experiments/ compute their tables with."""

import math

import pytest

from conftest import TINY, records, run_script

import common
import tasks


def test_pass_at_k_curve_averages_the_unbiased_estimator_over_prompts():
    # n = 4 samples; prompt A 1 correct, prompt B 4 correct, prompt C none
    curve = tasks.pass_at_k_curve([1, 4, 0], 4, (1, 2, 4))
    assert curve[1] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert curve[2] == pytest.approx((1 - math.comb(3, 2) / math.comb(4, 2) + 1.0 + 0.0) / 3)  # A: 1 - 3/6
    assert curve[4] == pytest.approx(2 / 3)


def test_matching_setting_interpolates_between_the_bracketing_points():
    # pass@1 falling with sigma: 0.5 at 0.1, 0.4 at 0.2, 0.2 at 0.4 -> 0.3 is reached half-way from 0.2 to 0.4
    assert tasks.matching_setting([0.4, 0.1, 0.2], [0.2, 0.5, 0.4], 0.3) == pytest.approx(0.3)
    assert tasks.matching_setting([0.1, 0.2], [0.5, 0.4], 0.45) == pytest.approx(0.15)
    assert tasks.matching_setting([0.1, 0.2], [0.5, 0.4], 0.4) == pytest.approx(0.2)  # a measured point itself
    # rising values work the same way (a temperature matched to a rising metric)
    assert tasks.matching_setting([1.0, 2.0], [0.0, 1.0], 0.25) == pytest.approx(1.25)


def test_matching_setting_prefers_the_crossing_nearest_the_target_and_says_when_there_is_none():
    # a noisy, non-monotone sweep crosses 0.3 twice: between 0.1 and 0.2 (values 0.31, 0.29: close to the target)
    # and between 0.3 and 0.4 (0.6, 0.0: far); the close pair gives the answer
    assert tasks.matching_setting([0.1, 0.2, 0.3, 0.4], [0.31, 0.29, 0.6, 0.0], 0.3) == pytest.approx(0.15)
    assert tasks.matching_setting([0.1, 0.2], [0.5, 0.4], 0.6) is None  # above everything the sweep reached
    assert tasks.matching_setting([0.1, 0.2], [0.4, 0.4], 0.4) == pytest.approx(0.1)  # a flat pair: its first point


@pytest.mark.parametrize("select_by", ["ce", "loss"])
def test_train_keeps_the_checkpoint_of_best_validation_ce_or_loss(data_root, tmp_path, select_by):
    # EVE's loss adds beta KL and control terms to the CE, so the two criteria are distinct numbers
    out = tmp_path / "eve"
    run_script("train.py", "--model=eve", f"--out_dir={out}", *TINY, "--max_iters=8", "--eval_interval=1",
               "--learning_rate=3e-3", f"--select_by={select_by}", data_dir=data_root)
    evals = [r for r in records(out) if "val_ce" in r and r["iter"] > 0]
    best = min(evals, key=lambda r: r[f"val_{select_by}"])
    checkpoint = common.load_checkpoint(out / "ckpt.pt")
    assert checkpoint["iter_num"] == best["iter"]
    assert checkpoint["best_val_loss"] == pytest.approx(best[f"val_{select_by}"])
    assert any(r["val_ce"] != r["val_loss"] for r in evals)
