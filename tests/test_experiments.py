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


def test_intervals_apart_calls_a_difference_only_when_mean_plus_minus_std_intervals_do_not_overlap():
    # [0.30, 0.32] (mean 0.31, std 0.01) against [0.27, 0.29] (0.28 ± 0.01): 0.30 > 0.29, apart
    assert tasks.intervals_apart([0.30, 0.32], [0.27, 0.29]) == 1
    assert tasks.intervals_apart([0.27, 0.29], [0.30, 0.32]) == -1
    # 0.31 ± 0.01 against 0.30 ± 0.01: the intervals share [0.30, 0.31], no call, either way round
    assert tasks.intervals_apart([0.30, 0.32], [0.29, 0.31]) == 0
    assert tasks.intervals_apart([0.29, 0.31], [0.30, 0.32]) == 0
    assert tasks.intervals_apart([0.2, 0.4], [0.3, 0.3]) == 0  # one inside the other


def test_gsm8k_answer_reads_the_number_after_the_last_marker_else_the_last_number():
    assert tasks.gsm8k_answer("9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == 18.0  # the dataset's own format
    assert tasks.gsm8k_answer("#### 3\nso #### 1,250 dollars, not 7") == 1250.0  # the last marker, separators out
    assert tasks.gsm8k_answer("She has 5 apples, then 12 - 5 = 7.") == 7.0  # no marker: the last number
    assert tasks.gsm8k_answer("#### none\nthe answer is -2.5") == -2.5  # a marker with no number after it
    assert tasks.gsm8k_answer("no digits here") is None


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
