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


def test_the_summary_means_each_arm_and_divides_the_mean_wall_times():
    runs = [{"arm": "nanogpt", "seed": 1337, "wall_s": 120.0, "printed_val": 1.9, "val_loss": 1.91},
            {"arm": "ours", "seed": 1337, "wall_s": 20.0, "printed_val": 1.89, "val_loss": 1.90},
            {"arm": "nanogpt", "seed": 1337, "wall_s": 130.0, "printed_val": 1.9, "val_loss": 1.91},
            {"arm": "ours", "seed": 1338, "wall_s": 30.0, "printed_val": 1.92, "val_loss": 1.93}]
    arms, ratio = bench_speedrun.summary(runs)
    assert arms["nanogpt"] == (125.0, pytest.approx(1.91), 2) and arms["ours"] == (25.0, pytest.approx(1.915), 2)
    assert ratio == 0.2
    lines = bench_speedrun.table(runs)
    assert lines[1:5] == ["nanogpt | 1337 | 120.0 | 1.9000 | 1.9100", "ours | 1337 | 20.0 | 1.8900 | 1.9000",
                          "nanogpt | 1337 | 130.0 | 1.9000 | 1.9100", "ours | 1338 | 30.0 | 1.9200 | 1.9300"]
    assert lines[-1] == "time ours / nanoGPT: 0.200; val ours - nanoGPT: +0.0050"


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
                      f"--ours_args={short} --n_layer=1", f"--out_json={tmp_path / 'bench.json'}", data_dir=tmp_path)
    lines = proc.stdout.splitlines()
    done = [line.split(" run ")[0] for line in lines if re.match(r"(nanogpt|ours) run \d/2: [\d.]+ s, val", line)]
    assert done == ["nanogpt", "ours", "nanogpt", "ours"]
    assert sum(line.startswith("load average") for line in lines) == 4
    with open(tmp_path / "bench.json") as f:
        result = json.load(f)
    assert [r["arm"] for r in result["runs"]] == ["nanogpt", "ours"] * 2
    assert [r["seed"] for r in result["runs"] if r["arm"] == "ours"] == [1337, 1338]
    assert lines[-len(bench_speedrun.table(result["runs"])):] == bench_speedrun.table(result["runs"])
    assert all(2.5 < r["val_loss"] < math.log(65) + 0.5 for r in result["runs"])  # 4 steps: far from trained


@pytest.mark.slow
@pytest.mark.parametrize("args,named", [([], "--nanogpt"), (["--nanogpt=."], "lacks model.py"),
                                        ([f"--nanogpt={NANOGPT}", "--input=nowhere.txt"], "--input=nowhere.txt")])
def test_a_missing_checkout_or_text_is_one_line_and_exit_2_before_anything_runs(args, named, tmp_path):
    if NANOGPT in " ".join(args) and not os.path.isfile(os.path.join(NANOGPT, "train.py")):
        pytest.skip("set NANOLATENT_NANOGPT to a nanoGPT checkout")
    proc = run_script("-m", "scripts.bench_speedrun", *args, f"--work_dir={tmp_path / 'work'}", data_dir=tmp_path,
                      check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and named in proc.stderr
    assert not (tmp_path / "work").exists()
