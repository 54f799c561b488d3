"""rlvr.py: GRPO advantages and update, minds as rollouts (frozen per rollout, det at sigma = 0), the TTRL majority
reward, the arithmetic verifier, and the script end to end on a tiny arithmetic dataset, its refusals one line each."""

import copy
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import (ROOT, assert_one_line_error, records, run_script, snapshot, start_script, train_det,
                      wait_for_line)

import configurator
from nanolatent import ckpt, grpo, models
from scripts import rlvr
from nanolatent import tasks, tokendata

TINY_MODEL = dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, block_size=32, vocab_size=14)


def tiny(model_type="btrans", seed=0, **kwargs):
    torch.manual_seed(seed)
    return models.build_model(model_type, {**TINY_MODEL, **kwargs}).eval()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_group_advantages_match_a_hand_computation():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = grpo.group_advantages(rewards, eps=1e-4)
    # group 0: mean 1/2, std (Bessel) sqrt(4 * 1/4 / 3); group 1: no signal; group 2: mean 1/4, std 1/2
    s0 = (1 / 3) ** 0.5
    expected = [[0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4), 0.5 / (s0 + 1e-4)], [0.0] * 4,
                [-0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0.75 / 0.5001]]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_clipped_objective_and_k3_kl_match_a_hand_computation():
    ratios = torch.tensor([[1.5, 0.5], [1.5, 1.1]])  # pi / pi_old per token
    old = torch.zeros(2, 2)
    logp = ratios.log()
    ref = torch.log(torch.tensor([[1.5, 0.5], [3.0, 1.1]]))  # pi_ref: equal to pi but at one token (ratio 2)
    mask = torch.tensor([[True, True], [True, False]])  # the last token is past the stop: not scored
    loss, stats = grpo.grpo_loss(logp, old, ref, mask, torch.tensor([1.0, -1.0]), clip_eps=0.2, kl_coef=0.5)
    # row 0, A = +1: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5; row 1, A = -1: min(-1.5, -1.2) = -1.5
    policy = (-(1.2 + 0.5) / 2 + 1.5) / 2
    kl = (0.0 + (2 - math.log(2) - 1)) / 2  # k3 = r - log r - 1, r = pi_ref / pi: 0 in row 0, r = 2 in row 1
    assert loss.item() == pytest.approx(policy + 0.5 * kl, abs=1e-6)
    assert stats["kl"] == pytest.approx(kl, abs=1e-6) and stats["clip_frac"] == pytest.approx((1.0 + 1.0) / 2)


def test_minds_differ_within_a_group_and_each_stays_frozen_through_its_rollout_kv_cache_included():
    model = tiny(sigma=0.5)
    with torch.no_grad():  # larger weights than at init, so that greedy decoding does not just repeat a token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    prompt, G, L = [3, 7, 1, 5, 13], 4, 12
    completions, latents = grpo.rollouts(model, [prompt], G, L, 0.0, gen(0), gen(1))  # greedy: only minds differ
    assert latents.shape == (G, model.config.n_norms, 32)
    assert all((latents[i] - latents[j]).abs().max() > 0.5 for i in range(G) for j in range(i))
    assert len({tuple(c) for c in completions.tolist()}) > 1  # one prompt, several answers: the minds differ
    # Regenerated with the same latents: the same tokens, and at every step the cached decode's logits equal a full
    # forward of the whole prefix with the same latents, so no mind changed mid-rollout.
    step_logits = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: step_logits.append(out))
    again = model.generate(torch.tensor([prompt] * G), L, temperature=0, latents=latents)
    handle.remove()
    assert torch.equal(again[:, len(prompt):], completions)
    assert len(step_logits) == L
    with torch.no_grad():
        for s, cached in enumerate(step_logits):
            full, _, _ = model(again[:, :len(prompt) + s], latents=latents)  # (G, 1, V)
            assert torch.allclose(cached, full, atol=1e-5)
    assert (step_logits[0][0] - step_logits[0][1]).abs().max() > 1e-2  # same prompt, different minds


def test_sigma_zero_minds_rollouts_equal_the_det_models_at_the_same_sampling_seed():
    det = tiny("det")
    prompts = [[3, 7, 13], [4, 5, 6, 13], [8, 13, 9]]  # two lengths: two generate() calls
    expected, none = grpo.rollouts(det, prompts, 4, 10, 1.0, gen(3), gen(5))
    assert none is None
    for sigma, equal in ((0.0, True), (1.0, False)):
        minds = tiny(sigma=sigma, noise_mode="sequence")
        minds.load_state_dict(det.state_dict(), strict=False)
        completions, latents = grpo.rollouts(minds, prompts, 4, 10, 1.0, gen(3), gen(6))
        assert latents.shape == (12, minds.config.n_norms, 32)
        assert torch.equal(completions, expected) == equal  # sigma > 0: the same token seed, other tokens


def test_ttrl_reward_is_agreement_with_the_group_majority_first_seen_wins_and_none_never_wins():
    assert grpo.ttrl_rewards(["444", "12", "444", None]) == [1.0, 0.0, 1.0, 0.0]
    assert grpo.ttrl_rewards(["12", "444", "444", "12"]) == [1.0, 0.0, 0.0, 1.0]  # a tie: "12" was seen first
    assert grpo.ttrl_rewards([None, None, None, "7"]) == [0.0, 0.0, 0.0, 1.0]  # None never votes
    assert grpo.ttrl_rewards([None, None]) == [0.0, 0.0]  # nothing parses: no reward at all


def test_arith_verifier_on_edge_cases():
    assert tasks.verify_arith("\n37*12=", "444\n12+3=15\n")  # text after the newline is ignored
    assert tasks.verify_arith("37+12=", "49")  # no newline within the budget: what was generated
    assert not tasks.verify_arith("\n37*12=", "0444\n")  # a leading zero is wrong
    assert not tasks.verify_arith("\n37*12=", "4445")  # budget ran out on a longer number
    assert not tasks.verify_arith("\n37*12=", "")  # empty
    assert not tasks.verify_arith("\n37*12=", "\n444\n")  # empty before the newline
    assert not tasks.verify_arith("\n37*12=", "444*1\n")  # not only digits
    assert tasks.arith_answer("0444\nxyz") == "0444" and tasks.arith_answer("*3\n") is None


def test_chat_task_answers_gsm8k_numbers_and_lettered_choices():
    assert tasks.gsm8k_answer("so 3 + 4 = 7\n#### 1,234") == 1234.0  # the number after the last ####
    assert tasks.gsm8k_answer("She pays $12.50, then 3 more") == 3.0 and tasks.gsm8k_answer("none") is None
    assert tasks.gsm8k_steps("2*3=<<2*3=6>>6 and 6+1=<<6+1=7>>7\n#### 7") == 2
    assert [tasks.letter_answer(t) for t in ("B", " C. the dog", "A\n", "D)", "Apple", "The answer is B", "E", "")] \
        == ["B", "C", "A", "D", None, None, None, None]  # the letter first, among the item's choices
    assert tasks.letter_answer("E", n_choices=5) == "E"
    question = tasks.lettered_question(" A man sits.", ["reads. ", "runs", "sleeps", "eats"])
    assert question.splitlines()[2:8] == ["A man sits.", "", "A. reads.", "B. runs", "C. sleeps", "D. eats"]
    # MMLU-Pro's rows (B-Trans §5.1): the question is the text, up to 10 options A-J, the answer its index's letter
    rows = [{"question": "Which is a gas giant?", "options": ["Mars", *"abcdefgh", "Saturn"], "answer": "J",
             "answer_index": 9}, {"question": "2 + 2?", "options": ["3", "4", "5"], "answer": "B", "answer_index": 1}]
    problems = tasks.mmlu_pro_problems(rows)
    assert [(p["answer"], p["choices"]) for p in problems] == [("J", 10), ("B", 3)]
    assert problems[1]["question"] == "2 + 2?\n\nA. 3\nB. 4\nC. 5\n\nAnswer with the letter only."
    assert tasks.letter_answer("J. Saturn", n_choices=10) == "J" and tasks.letter_answer("D", n_choices=3) is None


@pytest.mark.slow
def test_gsm8k_answer_reads_the_number_after_the_last_marker_else_the_last_number():
    assert tasks.gsm8k_answer("9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == 18.0  # the dataset's own format
    assert tasks.gsm8k_answer("#### 3\nso #### 1,250 dollars, not 7") == 1250.0  # the last marker, separators out
    assert tasks.gsm8k_answer("She has 5 apples, then 12 - 5 = 7.") == 7.0  # no marker: the last number
    assert tasks.gsm8k_answer("#### none\nthe answer is -2.5") == -2.5  # a marker with no number after it
    assert tasks.gsm8k_answer("no digits here") is None


def test_chat_problems_read_gsm8k_splits_and_hellaswag_items(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    for split, n in (("train", 3), ("test", 2)):
        with open(tmp_path / "gsm8k" / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"question": f"{split} {i}?", "answer": f"{i}+1=<<{i}+1={i + 1}>>" * (i + 1)
                                     + f"\n#### {i + 1}"}) + "\n" for i in range(n))  # problem i: i + 1 steps
    assert tasks.chat_problems("gsm8k", tmp_path / "gsm8k", "train") == [("train 0?", 1.0), ("train 1?", 2.0),
                                                                        ("train 2?", 3.0)]
    assert tasks.chat_problems("gsm8k", tmp_path / "gsm8k", "val") == [("test 0?", 1.0), ("test 1?", 2.0)]
    assert tasks.chat_problems("gsm8k", tmp_path / "gsm8k", "train", max_calc_steps=2) == [("train 0?", 1.0),
                                                                                          ("train 1?", 2.0)]
    items = [{"context": "The cat", "choices": ["sat.", "flew.", "sang."], "label": 2}]
    with open(tmp_path / "mc.jsonl", "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    ((question, label),) = tasks.chat_problems("hellaswag", tmp_path / "mc.jsonl", "val")
    assert label == "C" and question == tasks.lettered_question("The cat", ["sat.", "flew.", "sang."])


def test_gsm8k_without_its_files_in_dataset_reads_the_local_copies_under_the_offline_variable(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    with open(tmp_path / "gsm8k" / "test.jsonl", "w") as f:
        f.write(json.dumps({"question": "1 + 1?", "answer": "1+1=<<1+1=2>>2\n#### 2"}) + "\n")
    monkeypatch.setenv("NANOLATENT_LOCAL_DATA", str(tmp_path))
    assert tasks.chat_problems("gsm8k", "openai/gsm8k", "val") == [("1 + 1?", 2.0)]


def test_replies_are_decoded_up_to_the_stop_and_chat_verify_reads_each_prompts_label(tmp_path):
    completions = torch.tensor([[1, 2, 0, 3], [3, 3, 3, 3]])
    assert grpo.replies(completions, lambda ids: "".join("|abc"[i] for i in ids), stop_id=0) == ["ab|", "cccc"]
    items = [{"context": "one", "choices": ["a", "b"], "label": 1},
             {"context": "two", "choices": ["a", "b"], "label": 0}]
    with open(tmp_path / "mc.jsonl", "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    template = tmp_path / "chat_template.jinja"  # beside the run's tokenizer, as convert.py writes it
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    meta = {"tokenizer": "hf", "tokenizer_file": str(tmp_path / "tokenizer.json")}
    load, verify = tasks.chat_task("hellaswag", tmp_path / "mc.jsonl", meta)
    prompts = load("val")
    assert prompts == [f"<user>{tasks.lettered_question(i['context'], i['choices'])}<assistant>" for i in items]
    assert verify(prompts[0], "B. b") and not verify(prompts[0], "A") and verify(prompts[1], "A")


def test_completion_mask_keeps_tokens_up_to_and_including_the_first_stop():
    completions = torch.tensor([[5, 6, 0, 7, 0], [5, 6, 7, 8, 9], [0, 1, 1, 1, 1]])
    mask = grpo.completion_mask(completions, stop_id=0)
    assert mask.tolist() == [[True, True, True, False, False], [True] * 5, [True, False, False, False, False]]


def test_one_grpo_step_raises_logprobs_of_positive_advantage_rollouts_and_lowers_negative_ones():
    model = tiny(sigma=0.3, noise_mode="sequence")
    ref = copy.deepcopy(model).requires_grad_(False)
    ref.config.noise_mode = "mean"
    prompt_ids = [[3, 7, 1, 13]] * 4
    completions, _ = grpo.rollouts(model, prompt_ids[:1], 4, 6, 1.0, gen(0), gen(1))
    mask = grpo.completion_mask(completions, stop_id=0)
    advantages = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])).flatten()

    def logp():
        with torch.no_grad(), grpo.noise_mode(model, "mean"):  # the update's model: the mean offset only (§5)
            return (grpo.completion_logprobs(model, prompt_ids, completions) * mask).sum(1)

    before = logp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    stats = grpo.grpo_update(model, ref, optimizer, prompt_ids, completions, mask, advantages, grad_clip=0.0)
    change = logp() - before
    assert torch.equal(change > 0, advantages > 0) and change.abs().min() > 1e-5
    assert stats["kl"] == 0.0 and stats["clip_frac"] == 0.0  # first step: model == reference, ratio exactly 1
    assert model.config.noise_mode == "sequence"  # restored after the update


def test_a_chunked_update_takes_the_whole_batchs_step():
    """update_batch: gradients summed over chunks of rollouts (each weighed by its share) give the one-batch update,
    through two clipped steps (updates=2: ratios away from 1) with a KL term, and the same stats."""
    model = tiny(sigma=0.3, noise_mode="sequence")
    ref = copy.deepcopy(model).requires_grad_(False)
    prompt_ids = [[3, 7, 1, 13]] * 3 + [[5, 2]] * 3  # two prompt lengths: each chunk pads to its own
    completions = torch.cat([grpo.rollouts(model, [ids], 3, 6, 1.0, gen(s), gen(s + 1))[0]
                             for s, ids in enumerate(prompt_ids[::3])])  # (6, 6)
    mask = grpo.completion_mask(completions, stop_id=0)
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.2, -0.5])
    results = []
    for chunk in (0, 2, 4):
        torch.manual_seed(0)
        net_c = copy.deepcopy(model)
        optimizer = torch.optim.SGD(net_c.parameters(), lr=0.5)  # Adam's first step, g / |g|, would amplify rounding
        stats = grpo.grpo_update(net_c, ref, optimizer, prompt_ids, completions, mask, advantages, updates=2,
                                 clip_eps=0.2, kl_coef=0.1, grad_clip=1.0, chunk=chunk)
        results.append((torch.cat([p.flatten() for p in net_c.parameters()]), stats))
    (whole, whole_stats), *chunked = results
    assert 0 < whole_stats["clip_frac"] < 1 and whole_stats["kl"] > 0  # the 2nd step clips some, left the reference
    for params, stats in chunked:
        assert torch.allclose(params, whole, atol=1e-6) and not torch.equal(params, torch.cat(
            [p.flatten() for p in model.parameters()]))
        assert all(math.isclose(stats[k], whole_stats[k], rel_tol=1e-4, abs_tol=1e-7) for k in whole_stats)


# ----------------------------------------------------------------------------------------------------------------
# the script


@pytest.fixture(scope="module")
def arith_ckpt(tmp_path_factory):
    """A tiny arithmetic dataset and a det model trained 2 iterations on it."""
    root, out = tmp_path_factory.mktemp("arith_data"), tmp_path_factory.mktemp("det_arith")
    run_script("prepare.py", "arith", "--num_train=1000", "--num_val=100", data_dir=root)
    train_det(root, out, "--dataset=arith", "--block_size=32", "--max_iters=2", "--eval_interval=2")
    return root, out


@pytest.mark.slow
def test_arith_prompts_are_the_val_problems_and_every_data_answer_verifies(arith_ckpt, monkeypatch):
    root, _ = arith_ckpt
    monkeypatch.setenv("NANOLATENT_DATA", str(root))
    meta = tokendata.load_meta("arith")
    lines = "".join(meta["chars"][t] for t in tokendata.load_tokens("arith", "val", meta)).split("\n")[:-1]
    prompts = tasks.load_prompts("arith", "arith", "val", meta)
    assert len(prompts) == len(lines) == 100
    assert prompts == ["\n" + line[:line.index("=") + 1] for line in lines]
    assert all(tasks.verify_arith(p, line.split("=")[1] + "\n") for p, line in zip(prompts, lines))
    assert not any(tasks.verify_arith(p, "0" + line.split("=")[1]) for p, line in zip(prompts, lines))


@pytest.mark.slow
def test_script_runs_two_grpo_steps_and_writes_a_checkpoint_load_model_reads(arith_ckpt, tmp_path):
    root, det_out = arith_ckpt
    proc = run_script("-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={tmp_path}", "--max_steps=2",
                      "--eval_interval=2", "--eval_prompts=6", "--eval_samples=2", "--prompts_per_step=2",
                      "--group_size=3", "--sigma=0.1", "--device=cpu", data_dir=root)
    assert "step 1/2: reward" in proc.stdout
    model, checkpoint = ckpt.load_model(tmp_path)
    assert checkpoint["model_type"] == "btrans" and checkpoint["iter_num"] == 2
    assert model.config.sigma == 0.1 and model.config.noise_mode == "sequence"
    assert checkpoint["config"]["dataset"] == "arith" and checkpoint["config"]["rollout"] == "minds"
    assert set(checkpoint) == {"model", "optimizer", "ref_model", "model_type", "model_config", "config", "meta",
                               "iter_num", "best_val_loss"}
    logged = records(tmp_path)
    assert [r["iter"] for r in logged if "reward" in r] == [0, 1]
    assert [r["iter"] for r in logged if "eval_pass@1" in r] == [0, 2]
    assert all(0.0 <= r["reward"] <= 1.0 and r["distinct"] <= 3 for r in logged if "reward" in r)


@pytest.mark.slow
def test_a_zero_step_run_evaluates_the_test_and_selection_sets_as_one_longer_test_set_would_and_saves_nothing(
        arith_ckpt, tmp_path):
    root, det_out = arith_ckpt
    args = ["--max_steps=0", "--eval_samples=2", "--prompts_per_step=2", "--group_size=2", "--device=cpu",
              f"--init_from={det_out}"]
    run_script("-m", "scripts.rlvr", *args, f"--out_dir={tmp_path / 'split'}", "--eval_prompts=6",
               "--select_prompts=5", "--sigma=0", "--temperature=0", data_dir=root)
    run_script("-m", "scripts.rlvr", *args, f"--out_dir={tmp_path / 'whole'}", "--eval_prompts=11", data_dir=root)
    (split,), (whole,) = records(tmp_path / "split"), records(tmp_path / "whole")
    assert not (tmp_path / "split" / "ckpt.pt").exists() and split["iter"] == 0
    # greedy decoding reads no draw: the selection set is the 5 val problems after the 6 test ones
    assert len(split["eval_greedy_correct"]) == 6 and split["eval_greedy"] == np.mean(split["eval_greedy_correct"])
    assert 11 * whole["eval_greedy"] == pytest.approx(6 * split["eval_greedy"] + 5 * split["select_greedy"])
    assert split["eval_greedy_correct"] == whole["eval_greedy_correct"][:6]
    # minds at sigma 0 decoded greedily are the mean model's greedy answers: GRPO's rollouts, measured as drawn
    assert split["select_rollout_pass@1"] == split["select_greedy"]


SIGTERM_MID_ROLLOUT = """
import os, signal, torch
_multinomial, calls = torch.multinomial, [0]
def multinomial(*args, **kwargs):  # SIGTERM while a rollout draws its tokens: at the 60th token drawn (step 4)
    calls[0] += 1
    if calls[0] == 60:
        os.kill(os.getpid(), signal.SIGTERM)
    return _multinomial(*args, **kwargs)
torch.multinomial = multinomial
"""


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_mid_rollout_resumes_to_the_weights_and_rewards_of_an_uninterrupted_one(
        arith_ckpt, tmp_path):
    """TTRL rewards (agreement with the group's majority) give this barely trained model's groups a learning signal,
    so the weights move at every step. Stopped by SIGTERM in a rollout, the run finishes that step, saves it and says
    how to go on; the same command with --init_from=resume then ends where the uninterrupted run ends."""
    root, det_out = arith_ckpt
    args = ["--max_steps=12", "--eval_interval=5", "--eval_prompts=6", "--eval_samples=2", "--prompts_per_step=2",
            "--group_size=4", "--sigma=0.1", "--learning_rate=1e-3", "--reward=ttrl", "--device=cpu"]
    run_script("-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={tmp_path / 'whole'}", *args, data_dir=root)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SIGTERM_MID_ROLLOUT)
    env = {**os.environ, "NANOLATENT_DATA": str(root), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path / "hook")}
    stopped = tmp_path / "stopped"
    proc = subprocess.run([sys.executable, "-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={stopped}", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.splitlines() == [f"stopped by SIGTERM: {stopped / 'ckpt.pt'} holds step 5; continue with the "
                                        f"same command and --init_from=resume"]
    assert "step 4/12: reward" in proc.stdout and "step 5/12: reward" not in proc.stdout  # step 4 was finished
    assert torch.load(stopped / "ckpt.pt", weights_only=True)["iter_num"] == 5
    proc = run_script("-m", "scripts.rlvr", "--init_from=resume", f"--out_dir={stopped}", *args, data_dir=root)
    assert "resuming at step 5" in proc.stdout
    whole, resumed = (torch.load(d / "ckpt.pt", weights_only=True) for d in (tmp_path / "whole", stopped))
    assert resumed["iter_num"] == whole["iter_num"] == 12
    assert resumed["config"]["init_from"] == str(det_out)
    moved = [k for k in whole["model"] if not torch.equal(whole["model"][k], whole["ref_model"][k])]
    assert len(moved) > 5  # the updates changed the weights: the equality below is not that of an idle run
    for key in whole["model"]:
        torch.testing.assert_close(resumed["model"][key], whole["model"][key], rtol=1e-5, atol=1e-6)
    logged = lambda d: [{k: v for k, v in r.items() if k != "step_s"} for r in records(d)]  # all but the timing
    assert [r["iter"] for r in logged(stopped) if "reward" in r] == list(range(12))
    assert [r.get("reward") for r in logged(stopped)] == [r.get("reward") for r in logged(tmp_path / "whole")]
    for mine, theirs in zip(logged(stopped), logged(tmp_path / "whole"), strict=True):  # kl, loss, evals, ...
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("existing, message", [
    (None, "does not exist: start one with --init_from=<a trained model>"),
    ("det", "checkpoint: give it as --init_from="),
])
def test_resume_without_an_rlvr_run_in_out_dir_is_one_line(arith_ckpt, tmp_path, existing, message):
    root, det_out = arith_ckpt
    out = det_out if existing else tmp_path / "none"
    proc = run_script("-m", "scripts.rlvr", "--init_from=resume", f"--out_dir={out}", data_dir=root, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_rlvr_never_replaces_a_run_unasked(run, data_root):
    """A trained run given as --out_dir (here also its --init_from): one line, the run as it was (as convert.py, in
    test_convert.py, and train.py's "scratch over a trained run")."""
    before = snapshot(run)
    proc = run_script("-m", "scripts.rlvr", "--task=letters", f"--init_from={run}", f"--out_dir={run}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"{run} already holds a run ({run / 'ckpt.pt'})", "--overwrite=True")
    assert snapshot(run) == before


@pytest.mark.slow
def test_script_refuses_ddp_with_one_clear_line(arith_ckpt, tmp_path, monkeypatch):
    root, det_out = arith_ckpt
    monkeypatch.setenv("RANK", "0")
    proc = run_script("-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={tmp_path}", data_dir=root, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "runs in one process" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--task=gsm8k"], "task=gsm8k prompts a chat model in its chat template, and "),  # a char-level model
    (["--task=nope"], "--task must be one of"),
    (["--max_calc_steps=1"], "max_calc_steps keeps GSM8K problems by their calculator steps: only with task=gsm8k"),
])
def test_script_refuses_a_task_the_model_cannot_take_in_one_line(arith_ckpt, tmp_path, args, message):
    root, det_out = arith_ckpt
    proc = run_script("-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={tmp_path}", *args, data_dir=root, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("config", sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "config",
                                                                                                   "rlvr_*.py"))))
def test_every_rlvr_config_sets_known_keys_of_the_right_types(config):
    """What rlvr.py's configurator reads from each of its configs: every key one of rlvr.py's settings or a B-Trans
    Config field (configure dies otherwise, naming the key), each value as the file gives it (of its default's type)."""
    defaults = {k: v for k, v in vars(rlvr).items() if not k.startswith("_") and isinstance(v, configurator.TYPES)}
    values, model_values = configurator.configure(defaults, [os.path.join(ROOT, config)],
                                                  model_fields=lambda values: models.config_fields("btrans"))
    file_values = configurator.read_config_file(os.path.join(ROOT, config))
    assert values["task"] in tasks.TASKS and len(file_values) > 3
    assert all({**values, **model_values}[k] == v for k, v in file_values.items())


def test_smollm2_rlvr_config_reads_the_hubs_hellaswag_offline_its_local_copy(tmp_path, monkeypatch):
    """The config names the hub's HellaSwag (it only assigns); its problems come from the local copy under
    NANOLATENT_LOCAL_DATA where there is one (multiple_choice.LOCAL_COPIES), as evaluate.py's --mc_file=hellaswag."""
    assert configurator.read_config_file(os.path.join(ROOT, "config/rlvr_smollm2.py"))["dataset"] == "hellaswag"
    (tmp_path / "hellaswag").mkdir()
    item = {"context": "A man", "choices": ["walks.", "flies.", "sings.", "swims."], "label": 0}
    (tmp_path / "hellaswag" / "hellaswag_val_sample1000.jsonl").write_text(json.dumps(item) + "\n")
    monkeypatch.setenv(tokendata.LOCAL_DATA_ENV, str(tmp_path))
    assert tasks.chat_problems("hellaswag", "hellaswag", "val") == [(tasks.lettered_question("A man", item["choices"]),
                                                                    "A")]


@pytest.mark.slow
def test_a_resumed_run_trains_at_the_learning_rate_it_is_given_and_says_it_changed(arith_ckpt, tmp_path):
    root, det_out = arith_ckpt
    args = ["--eval_interval=5", "--eval_prompts=4", "--eval_samples=2", "--prompts_per_step=2", "--group_size=2",
            "--device=cpu"]
    run_script("-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={tmp_path}", "--max_steps=1", *args,
               data_dir=root)
    proc = run_script("-m", "scripts.rlvr", "--init_from=resume", f"--out_dir={tmp_path}", "--max_steps=2",
                      "--learning_rate=1e-3", "--weight_decay=0.1", *args, data_dir=root)
    assert "resuming with learning_rate=0.001 (was 1e-05), weight_decay=0.1 (was 0.0)" in proc.stdout
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert checkpoint["iter_num"] == 2 and checkpoint["config"]["learning_rate"] == 1e-3
    assert [(g["lr"], g["weight_decay"]) for g in checkpoint["optimizer"]["param_groups"]] == [(1e-3, 0.1), (1e-3, 0.0)]


@pytest.mark.slow
def test_two_sigterms_50_ms_apart_stop_in_one_line_with_a_whole_checkpoint(arith_ckpt, tmp_path):
    """The second SIGTERM lands while the process exits (torch's atexit callbacks), or while it saves: the default
    handler is back by then, or the save is dropped as a second signal asks, with no traceback either way and no
    temporary file; a checkpoint written is whole."""
    root, det_out = arith_ckpt
    out, err = tmp_path.with_name(f"{tmp_path.name}.out"), tmp_path.with_name(f"{tmp_path.name}.err")
    proc = start_script("-m", "scripts.rlvr", f"--init_from={det_out}", f"--out_dir={tmp_path}", "--max_steps=50",
                        "--eval_interval=5", "--eval_prompts=4", "--eval_samples=2", "--prompts_per_step=2",
                        "--group_size=2", "--device=cpu", data_dir=root, out=out, err=err)
    wait_for_line(out, "step 3/", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    stderr = err.read_text()
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM) and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "stopped by" in stderr
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]
    if (tmp_path / "ckpt.pt").exists():  # the second signal came after the save (else: before it, nothing saved)
        # the step under way when the first signal lands is finished and saved: 4, or 5 when the log line was read late
        assert ckpt.load_model(tmp_path)[1]["iter_num"] in (4, 5)
