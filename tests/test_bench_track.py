"""scripts/bench_track.py: its summary's arithmetic against a direct computation, its arms, and a tiny track of the four
models end to end (each scored by its honest measure, the table and figure from the JSON)."""

import json
import math

import pytest

from conftest import run_script

from scripts import bench_track

SHAKESPEARE = bench_track.os.path.join(bench_track.os.environ["NANOLATENT_LOCAL_DATA"], "tinyshakespeare", "input.txt")


def test_the_summary_pairs_each_arm_with_the_det_run_of_the_same_seed():
    walls = {"det": [20.0, 22.0, 24.0], "eve": [30.0, 35.0, 33.0]}
    losses = {"det": [1.90, 1.92, 1.91], "eve": [1.95, 1.93, 1.99]}
    runs = [{"arm": arm, "seed": 1337 + i, "wall_s": walls[arm][i], "loss": losses[arm][i], "target": 1.914,
             "measure": "nll"} for i in range(3) for arm in walls]
    s = bench_track.summary(runs)
    assert s["det"]["reached"] == 2 and s["eve"]["reached"] == 0 and "ratio" not in s["det"]
    ratios = [30 / 20, 35 / 22, 33 / 24]
    mean = sum(ratios) / 3
    half = 4.302653 * math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2) / math.sqrt(3)  # t(0.975, 2)
    assert s["eve"]["ratio"]["mean"] == pytest.approx(mean)
    assert s["eve"]["ratio"]["hi"] - s["eve"]["ratio"]["lo"] == pytest.approx(2 * half, rel=1e-5)
    assert s["eve"]["gap"]["diffs"] == pytest.approx([0.05, 0.01, 0.08])
    assert s["det"]["wall"]["mean"] == 22.0 and s["det"]["wall"]["lo"] == pytest.approx(22.0 - 4.302653 * 2 / 3 ** 0.5,
                                                                                         rel=1e-5)
    lines = bench_track.table(runs)
    assert lines[2].startswith("| det (nll) | 3 | 22.0 [") and lines[2].endswith("| 2/3 | - | - |")
    assert lines[3].endswith(f"| 0/3 | {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}] | "
                             f"+0.0467 [{s['eve']['gap']['lo']:+.4f}, {s['eve']['gap']['hi']:+.4f}] |")


def test_an_arm_is_a_model_and_its_flags():
    assert bench_track.parse_arms("det, det --warmdown_iters=50,free") == [
        ("det", "det", []), ("det --warmdown_iters=50", "det", ["--warmdown_iters=50"]), ("free", "free", [])]


@pytest.mark.slow
def test_a_tiny_track_trains_and_scores_the_four_models_by_their_honest_measures(tmp_path):
    if not bench_track.os.path.isfile(SHAKESPEARE):
        pytest.skip(f"needs Tiny Shakespeare at {SHAKESPEARE}")
    proc = run_script("-m", "scripts.bench_track", f"--input={SHAKESPEARE}", "--seeds=1", "--max_tokens=128",
                      "--mc_samples=2", "--iw_samples=2", "--train_args=--max_iters=1 --eval_interval=1 --n_layer=2",
                      f"--work_dir={tmp_path}", f"--out_json={tmp_path / 'track.json'}",
                      f"--plot={tmp_path / 'track.png'}", data_dir=tmp_path)
    with open(tmp_path / "track.json") as f:
        result = json.load(f)
    assert [(r["arm"], r["measure"]) for r in result["runs"]] == [("det", "nll"), ("eve", "nll"),
                                                                   ("free", "iw_bound"), ("btrans", "seq_nll")]
    for r in result["runs"]:
        assert r["loss"] == r["scores"][r["measure"]] and 3.0 < r["loss"] < math.log(65) + 1  # one step: untrained
    btrans = result["runs"][3]["scores"]
    assert btrans["sigma0_nll"] == pytest.approx(btrans["sigma0_seq_nll"])  # no noise: one mind, det's likelihood
    lines = bench_track.table(result["runs"])
    assert proc.stdout.splitlines()[-7:] == lines and lines[-1].startswith("| btrans at sigma 0 (nll) | 1 |")
    assert (tmp_path / "track.png").stat().st_size > 10_000
