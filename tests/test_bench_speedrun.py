"""scripts/bench_speedrun.py: its table's arithmetic, its whole-split score, and a tiny run of both arms (nanoGPT's
train.py from the nanoGPT checkout NANOLATENT_NANOGPT names, by default ../shared/peers/nanogpt where the suite's
machine has one)."""

import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_script

from scripts import bench_speedrun

NANOGPT = os.environ.get("NANOLATENT_NANOGPT") or os.path.join(os.path.dirname(ROOT), "shared", "peers", "nanogpt")
SHAKESPEARE = os.path.join(os.environ["NANOLATENT_LOCAL_DATA"], "tinyshakespeare", "input.txt")


def test_the_summary_pairs_each_of_our_arms_with_nanogpts_run_of_the_same_turn():
    walls = {"nanogpt": [120.0, 130.0, 110.0], "ours": [20.0, 39.0, 22.0], "ours-bfloat16": [60.0, 65.0, 55.0]}
    vals = {"nanogpt": [1.91] * 3, "ours": [1.90, 1.925, 1.915], "ours-bfloat16": [1.905, 1.91, 1.93]}
    runs = [{"arm": arm, "seed": 1337 + i, "wall_s": walls[arm][i], "load": (1.0, 2.0), "printed_val": 1.9,
             "val_loss": vals[arm][i]} for i in range(3) for arm in walls]
    arms = bench_speedrun.summary(runs)
    assert arms["nanogpt"] == {"wall_s": 120.0, "val_loss": pytest.approx(1.91), "n": 3}
    ratios = [20 / 120, 39 / 130, 22 / 110]  # each against the nanoGPT run just before it
    mean = sum(ratios) / 3
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2)
    half = 4.302653 * sd / math.sqrt(3)  # t(0.975, 2)
    ours = arms["ours"]
    assert ours["ratio"]["mean"] == pytest.approx(mean)
    assert (ours["ratio"]["lo"], ours["ratio"]["hi"]) == (pytest.approx(mean - half, rel=1e-5),
                                                          pytest.approx(mean + half, rel=1e-5))
    assert ours["gap"]["diffs"] == pytest.approx([-0.01, 0.015, 0.005])
    assert ours["gap"]["mean"] == pytest.approx(1e-2 / 3)
    assert ours["within"] == 2 and arms["ours-bfloat16"]["within"] == 2  # 1.925 and 1.93 above 1.91 + 0.01
    cut = bench_speedrun.summary(runs[:7])  # saved after nanoGPT's third run, before ours: two turns each
    assert cut["nanogpt"]["n"] == 3 and cut["ours"]["ratio"]["n"] == cut["ours"]["gap"]["n"] == 2
    assert cut["ours"]["ratio"]["mean"] == pytest.approx((20 / 120 + 39 / 130) / 2)
    lines = bench_speedrun.table(runs)
    assert lines[1:4] == ["nanogpt | 1337 | 120.0 | 1.00, 2.00 | 1.9000 | 1.9100",
                          "ours | 1337 | 20.0 | 1.00, 2.00 | 1.9000 | 1.9000",
                          "ours-bfloat16 | 1337 | 60.0 | 1.00, 2.00 | 1.9000 | 1.9050"]
    gap = f"+0.0033 [{ours['gap']['lo']:+.4f}, {ours['gap']['hi']:+.4f}]"
    assert lines[-2] == (f"ours / nanoGPT time: {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]; val ours - nanoGPT: "
                         f"{gap} (95% t intervals over 3 turns); 2/3 runs within +0.01 of nanoGPT's loss")


def test_the_whole_split_score_is_the_mean_cross_entropy_of_every_window_token(tmp_path):
    tokens = torch.randint(0, 7, (1000,), generator=torch.Generator().manual_seed(0))
    tokens.numpy().astype("uint16").tofile(tmp_path / "val.bin")
    x, y = bench_speedrun.val_windows(tmp_path / "val.bin")
    assert x.shape == y.shape == (999 // 64, 64) and torch.equal(x.flatten()[1:], y.flatten()[:-1])
    assert torch.equal(y[-1], tokens[14 * 64 + 1:15 * 64 + 1])
    table = torch.randn(7, 7, generator=torch.Generator().manual_seed(1))  # a bigram model: logits of the next token
    expected = F.cross_entropy(table[x].flatten(0, 1), y.flatten()).item()
    assert bench_speedrun.whole_split_loss(lambda a, b: table[a], x, y, batch=5) == pytest.approx(expected, rel=1e-6)
    uniform = bench_speedrun.whole_split_loss(lambda a, b: torch.zeros(*a.shape, 7), x, y)
    assert uniform == pytest.approx(math.log(7), rel=1e-6)


@pytest.mark.slow
def test_a_tiny_bench_runs_both_arms_in_turns_and_scores_them_on_the_same_tokens(tmp_path):
    if not os.path.isfile(os.path.join(NANOGPT, "train.py")) or not os.path.isfile(SHAKESPEARE):
        pytest.skip("set NANOLATENT_NANOGPT to a nanoGPT checkout and NANOLATENT_LOCAL_DATA to a folder holding "
                    "tinyshakespeare/input.txt")
    short = "--max_iters=4 --lr_decay_iters=4 --eval_interval=2 --eval_iters=2 --warmup_iters=1"
    proc = run_script("-m", "scripts.bench_speedrun", f"--nanogpt={NANOGPT}", f"--input={SHAKESPEARE}", "--seeds=2",
                      "--threads=1", f"--work_dir={tmp_path}", f"--nanogpt_args={short} --n_layer=1",
                      f"--ours_args={short} --n_layer=1", f"--out_json={tmp_path / 'bench.json'}",
                      "--muon_dtypes=auto,bfloat16", data_dir=tmp_path)
    lines = proc.stdout.splitlines()
    done = [line.split(" run ")[0] for line in lines if re.match(r"[\w-]+ run \d/2: [\d.]+ s, val", line)]
    assert done == ["nanogpt", "ours", "ours-bfloat16"] * 2
    assert sum(line.startswith("load average") for line in lines) == 6
    with open(tmp_path / "bench.json") as f:
        result = json.load(f)
    assert [r["arm"] for r in result["runs"]] == ["nanogpt", "ours", "ours-bfloat16"] * 2
    assert [r["seed"] for r in result["runs"] if r["arm"] == "ours"] == [1337, 1338]
    fast = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    assert [r.get("newton_schulz") for r in result["runs"]] == [None, fast, "bfloat16"] * 2
    assert result["summary"]["ours"]["ratio"]["n"] == 2
    assert lines[-len(bench_speedrun.table(result["runs"])):] == bench_speedrun.table(result["runs"])
    assert all(2.5 < r["val_loss"] < math.log(65) + 0.5 for r in result["runs"])  # 4 steps: far from trained


@pytest.mark.slow
@pytest.mark.parametrize("args,named", [([], "--nanogpt"), (["--nanogpt=."], "lacks model.py"),
                                        ([f"--nanogpt={NANOGPT}", "--input=nowhere.txt"], "--input=nowhere.txt"),
                                        ([f"--nanogpt={NANOGPT}", "--muon_dtypes=float32,fp8"], "--muon_dtypes")])
def test_a_missing_checkout_or_text_is_one_line_and_exit_2_before_anything_runs(args, named, tmp_path):
    if NANOGPT in " ".join(args) and not os.path.isfile(os.path.join(NANOGPT, "train.py")):
        pytest.skip("set NANOLATENT_NANOGPT to a nanoGPT checkout")
    proc = run_script("-m", "scripts.bench_speedrun", *args, f"--work_dir={tmp_path / 'work'}", data_dir=tmp_path,
                      check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and named in proc.stderr
    assert not (tmp_path / "work").exists()
