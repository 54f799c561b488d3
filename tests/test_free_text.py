"""experiments/free_text.py end to end at toy size: its JSON's fields and the order its likelihood bounds must keep."""

import importlib.util
import json
import math
import os
import sys

import pytest

from conftest import LOCAL_DATA, local_skip, run_script

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)

SHAKESPEARE = os.path.join(LOCAL_DATA, "tinyshakespeare", "input.txt")
# A 2-layer, 32-wide backbone trained 6 steps: the study's code paths in seconds. det and two κ, one seed.
TOY = ["--kappas=1_8,2", "--seeds=1,", "--max_tokens=4096", "--groups=2", "--group_size=3", "--references=2",
       "--per_reference=2", "--train_args=--max_iters=6 --n_layer=2 --n_embd=32 --n_head=2 --n_kv_head=1 "
       "--batch_size=4 --block_size=64 --eval_iters=1 --eval_interval=6 --warmup_iters=1"]
# Monte Carlo tolerance of the bound order, in nats per character. log p(x) >= -IW_K >= -IW_1 and E[IW_1] = -ELBO
# hold in expectation over the encoder's draws, not draw by draw. Measured at this size (64 windows of 64 characters,
# these κ, evaluate.py's seeds 1-8): the standard deviation of IW_1 is at most 0.008, of IW_16 and IW_64 0.004, of the
# -ELBO 0.0001, and of any difference of two of them 0.008. Three of those: 0.025.
TOL = 0.025


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    if not os.path.exists(SHAKESPEARE):
        pytest.skip(local_skip("tinyshakespeare/input.txt"))
    root = tmp_path_factory.mktemp("free_text")
    run_script("prepare.py", "text", f"--input={SHAKESPEARE}", "--tokenizer=char", "--name=shakespeare_char",
               data_dir=root / "data")
    proc = run_script(sys.executable, "-m", "experiments.free_text", *TOY, f"--runs_dir={root / 'runs'}",
                      f"--figure={root / 'free_text.png'}", data_dir=root / "data",
                      check=importlib.util.find_spec("matplotlib") is not None)
    if proc.returncode:  # without matplotlib (optional): the tables and the JSON, then one line naming the package
        assert proc.returncode == 2 and proc.stderr.strip().endswith("needs matplotlib: pip install matplotlib")
        assert not (root / "free_text.png").exists()
    with open(root / "free_text.json") as f:
        return json.load(f), proc.stdout, root


def test_free_text_writes_a_run_per_model_and_seed_with_every_number_of_the_table(study):
    data, stdout, root = study
    assert [(r["model"], r["seed"]) for r in data["runs"]] == [("det", 1), ("k1_8", 1), ("k2", 1)]
    assert data["iw_samples"] == [1, 16, 64] and data["max_tokens"] == 4096
    det, *frees = data["runs"]
    assert det["iters"] == 6 and det["tokens"] == 4096 and 3.0 < det["ce"] < math.log(65) + 0.5  # near uniform
    for r in frees:
        assert r["kappa_bits"] in (0.125, 2.0) and r["tokens"] == 4096
        for key in ("ce_prior", "ce_posterior", "neg_elbo", "iw_1", "iw_16", "iw_64", "kl_bits"):
            assert math.isfinite(r[key]), key
        assert r["floor"] in ("under", "at", "above") and isinstance(r["z_ignored"], bool)
        assert r["best_bound"] == min(r["ce_prior"], r["iw_64"])
        for condition in ("full", "prompt"):
            for measure in ("same_chars", "same_grams"):
                steer = r[f"steer_{condition}_{measure}"]
                assert steer["difference"] == pytest.approx(steer["matched"] - steer["mismatched"])
                assert 0 <= steer["matched"] <= 1 and 0 <= steer["mismatched"] <= 1
    for r in data["runs"]:
        for which in ("shared", "independent"):
            assert set(r[which]) == {"name_agree", "line_len_std", "distinct_4", "jaccard_4"}
            assert all(0 <= r[which][k] <= 1 for k in ("name_agree", "distinct_4", "jaccard_4"))
        assert len(r["examples"]["independent"]) == 3  # a group of generations, 64 - 2 characters after the prompt
        assert all(len(text) == 62 for text in r["examples"]["independent"])
    assert "| free κ = 2 | 1 |" in stdout
    assert os.path.exists(root / "free_text.png") or importlib.util.find_spec("matplotlib") is None


def test_free_text_bounds_keep_their_order_nll_le_iw64_le_iw16_le_iw1_and_elbo(study):
    data, _, _ = study
    for r in data["runs"][1:]:
        # -ELBO is the posterior CE plus the KL of the same forward pass (Eq. 3), exactly: KL >= 0
        assert r["neg_elbo"] == pytest.approx(r["ce_posterior"] + r["kl_bits"] * math.log(2), abs=1e-5)
        # the importance-weighted bound does not grow with K, and is at most the -ELBO averaged over draws
        assert r["iw_64"] <= r["iw_16"] + TOL and r["iw_16"] <= r["iw_1"] + TOL
        for K in (1, 16, 64):
            assert r[f"iw_{K}"] <= r["neg_elbo"] + TOL, K
    k2 = data["runs"][2]
    # κ = 2 bits gives the encoder room from the first steps: the bound's tightening with K is far above the noise
    assert k2["neg_elbo"] - k2["iw_64"] > 2 * TOL
