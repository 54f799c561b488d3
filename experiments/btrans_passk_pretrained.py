"""B-Trans Pass@K on a real pretrained model (§5.1, Fig. 2, with GSM8K in place of MMLU-Pro): SmolLM2-135M-Instruct,
imported offline, on the first `num_problems` GSM8K test problems.

    python convert.py gguf --src=SmolLM2-135M-Instruct.Q4_1.gguf --out_dir=out-smollm2   # or convert.py hf
    python -m experiments.btrans_passk_pretrained --out_dir=out-smollm2 --num_problems=8 --time_only=True
    python -m experiments.btrans_passk_pretrained --out_dir=out-smollm2 --num_problems=...

Each problem is asked in the run's chat template (common.chat_prompt, as sample.py --chat=True), and n
completions of `max_new_tokens` are drawn per problem and seed from three arms at the same decoding budget:
  temperature   the det model at `temperature` (the paper's "high-temperature sampling" baseline),
  minds         B-Trans minds (one eps per completion, §4.3; sigma and sigma_scale below) at the same temperature,
  greedy minds  the same minds at temperature 0: all diversity from the minds.
A completion ends at the first <|im_end|>; its answer is the number after the last "####", else its last number,
checked against GSM8K's. pass@k (k = 1 ... n, unbiased) is averaged over problems, per seed; the table gives mean ±
std over seeds and marks (*) only differences from temperature whose mean ± std intervals do not overlap.
--time_only=True times one problem of one arm and prints what the whole run would take.
"""

import json
import os
import time

import numpy as np
import torch

import common
import configurator
import rlvr
import tasks

out_dir = "out-smollm2"
gsm8k = "../shared/data/gsm8k/test.jsonl"
num_problems = 8  # the first problems of the test split
n = 8  # completions per problem, arm and seed
ks = (1, 2, 4, 8)
max_new_tokens = 256
temperature = 1.0  # the paper's high temperature; the greedy minds' excepted
sigma = 0.03  # relative to each gain: +0.08 nats and 15% argmax flips on SmolLM2 (experiments/btrans_sigma.py)
sigma_scale = "gain"
seeds = (1, 2, 3)
time_only = False  # time one problem of the minds arm and stop
json_out = "assets/btrans_passk_pretrained.json"
device = "cpu"
configurator.apply(globals())

if not os.path.exists(gsm8k):
    common.die(f"{gsm8k} not found: GSM8K's test.jsonl (openai/grade-school-math) is expected there")
with open(gsm8k) as f:
    problems = [json.loads(line) for line in f][:num_problems]
det, checkpoint = common.load_model(out_dir, device)
det.eval()
minds = common.load_model(out_dir, device, "btrans", checkpoint=checkpoint, sigma=sigma, sigma_scale=sigma_scale)[0]
minds.eval()
encode, decode = common.tokenizer(checkpoint["meta"])
end_ids = encode("<|im_end|>")
if len(end_ids) != 1:
    common.die(f"{out_dir}'s tokenizer has no <|im_end|> token: this experiment needs SmolLM2's ChatML vocabulary")


def correct_counts(arm, seed, problem_ids):
    net = det if arm == "temperature" else minds
    T = 0.0 if arm == "greedy minds" else temperature
    tokens, latents = (torch.Generator(device).manual_seed(common.seed_of(seed, i)) for i in range(2))
    prompt_ids = [encode(common.chat_prompt(checkpoint["meta"], problems[i]["question"])) for i in problem_ids]
    completions, _ = rlvr.rollouts(net, prompt_ids, n, max_new_tokens, T, tokens, latents)
    counts = []
    for p, i in enumerate(problem_ids):
        truth = tasks.gsm8k_answer(problems[i]["answer"])
        ok = 0
        for row in completions[p * n:(p + 1) * n].tolist():
            row = row[:row.index(end_ids[0])] if end_ids[0] in row else row
            ok += tasks.gsm8k_answer(decode(row)) == truth
        counts.append(ok)
    return np.array(counts)


arms = ("temperature", "minds", "greedy minds")
if time_only:
    t0 = time.time()
    correct_counts("minds", seeds[0], [0])
    per = time.time() - t0
    print(f"one problem, one arm, one seed: n={n} completions of {max_new_tokens} tokens in {per:.1f} s; the whole "
          f"run ({num_problems} problems x {len(arms)} arms x {len(seeds)} seeds) ~ "
          f"{per * num_problems * len(arms) * len(seeds) / 60:.0f} min")
    raise SystemExit

print(f"{out_dir}: {num_problems} GSM8K test problems, n={n} per arm and seed, T={temperature}, minds sigma={sigma} "
      f"({sigma_scale}), {max_new_tokens} new tokens, seeds {list(seeds)}")
t0 = time.time()
curves = {}
for arm in arms:
    counts = [correct_counts(arm, seed, range(num_problems)) for seed in seeds]
    curves[arm] = np.array([list(tasks.pass_at_k_curve(c, n, range(1, n + 1)).values()) for c in counts])
    print(f"{arm}: pass@1 {curves[arm][:, 0].mean():.3f} ± {curves[arm][:, 0].std():.3f} "
          f"({(time.time() - t0) / 60:.1f} min so far)", flush=True)

ref = curves["temperature"]
print("\n| arm | " + " | ".join(f"k={k}" for k in ks) + " |")
print("|---|" + "---|" * len(ks))
for arm, c in curves.items():
    cells = [f"{c[:, k - 1].mean():.3f} ± {c[:, k - 1].std():.3f}"
             + ("*" if arm != "temperature" and tasks.intervals_apart(c[:, k - 1], ref[:, k - 1]) else "")
             for k in ks]
    print(f"| {arm} | " + " | ".join(cells) + " |")
os.makedirs(os.path.dirname(json_out), exist_ok=True)
with open(json_out, "w") as f:
    json.dump({"out_dir": out_dir, "num_problems": num_problems, "n": n, "max_new_tokens": max_new_tokens,
               "temperature": temperature, "sigma": sigma, "sigma_scale": sigma_scale, "seeds": list(seeds),
               "minutes": (time.time() - t0) / 60,
               "pass_at_k_per_seed": {arm: c.round(6).tolist() for arm, c in curves.items()}}, f, indent=1)
print(f"wrote {json_out}")
