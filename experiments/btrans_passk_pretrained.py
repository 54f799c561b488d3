"""B-Trans Pass@K on a real pretrained model (§5.1, Fig. 2): SmolLM2-135M-Instruct, imported offline, or the paper's
own Qwen3 and Llama-3.x Instruct models (docs/pretrained.md), on the paper's MMLU-Pro, on GSM8K, on HellaSwag as
lettered multiple choice (MMLU-Pro's format) or on HellaSwag scored by the multiple-choice code (evaluate.py --task=mc).

    python -m scripts.convert gguf --src=SmolLM2-135M-Instruct.Q4_1.gguf --out_dir=out-smollm2   # or scripts/convert.py hf
    python -m experiments.btrans_passk_pretrained --benchmark=hellaswag --num_problems=100
    python -m experiments.btrans_passk_pretrained --benchmark=hellaswag_mc --num_problems=60 --seeds=1,2,3,4,5
    python -m experiments.btrans_passk_pretrained --benchmark=hellaswag_mc --score=char --num_problems=32
    python -m experiments.btrans_passk_pretrained --benchmark=gsm8k --num_problems=8 --time_only=True
    python -m experiments.btrans_passk_pretrained --benchmark=gsm8k --max_steps=1 --num_problems=12

Each problem is asked in the run's chat template (tokendata.chat_prompt, as sample.py --chat=True), and n answers are
drawn per problem and seed from three arms at the same decoding budget:
  temperature   the det model at `temperature` (the paper's "high-temperature sampling" baseline),
  minds         n B-Trans minds (one eps each, §4.3; sigma and sigma_scale below) at the same temperature,
  greedy minds  the same minds at temperature 0: all diversity from the minds.
A seed draws its n minds once, as a population that answers every problem (§5.1).
gsm8k      the first `num_problems` test problems (with max_steps > 0: of those whose reference solution has at most
           max_steps calculator steps, an easier real split); completions of max_new_tokens end at the end of
           the turn (tokendata.turn_end: <|im_end|>, <|eot_id|>); the answer is the number after the last "####",
           else the last number (tasks.gsm8k_answer).
hellaswag  the first `num_problems` items of HellaSwag's validation sample, the four endings as A-D
           (tasks.lettered_question); the answer is the reply's first token, right when it is the item's letter
           (tasks.letter_answer): every arm's first token is drawn from the prefill's logits, as generate() draws it.
mmlu_pro   the first `num_problems` questions of MMLU-Pro's test split (B-Trans §5.1), the options as A-J, answered
           as hellaswag's items are: the letter, the reply's first token (the paper does not say how it reads one).
hellaswag_mc  the same items, no chat template: each ending's log-likelihood after the context, summed over its
           tokens, by the multiple-choice code (multiple_choice.score_choices, as evaluate.py --task=mc scores them);
           an answer is an ending drawn from the softmax of the four at `temperature` (the model's own probability of
           each ending, renormalised over the four: what sampling the model gives, restricted to them), by det or by
           each mind with its own log-likelihoods; greedy minds answer with their most likely ending. A uniform
           guesser's pass@k, 1 - (3/4)^k, is printed beside. score='char': each ending's log-likelihood per
           character times the four endings' mean character count (the summed log-likelihood each would have at the
           item's common length: its argmax is evaluate.py's acc_char, the harness' acc_norm), then drawn the same way.
pass@k (k = 1 ... n, unbiased) is averaged over problems, per seed; the table gives mean ± std over seeds and marks (*)
only differences from temperature whose mean ± std intervals do not overlap; every count and curve goes to json_out,
the curves to its figure (--from_json=True redraws both from the JSON, running nothing). Matrix products go through
oneDNN on a CPU (cpu.inference_linears: float rounding apart from F.linear). --time_only=True times one problem.
"""

import json
import os
import time

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch
import torch.nn.functional as F

from experiments import study
from nanolatent import ckpt, common, cpu, metrics, multiple_choice, speedups, tasks, tokendata

out_dir = "out-smollm2"
benchmark = "hellaswag"  # 'gsm8k', lettered multiple choice: 'hellaswag' or 'mmlu_pro' (the paper's); 'hellaswag_mc'
#                           HellaSwag scored by the multiple-choice code
# '' = GSM8K's test split from the hub (openai/gsm8k); offline, test.jsonl under $NANOLATENT_LOCAL_DATA (the same file)
gsm8k = tokendata.local_data("gsm8k/test.jsonl")
# a jsonl or the hub's 'hellaswag' (its validation split); offline, and for docs/pretrained.md's numbers, the 1,000-item
# validation sample under $NANOLATENT_LOCAL_DATA: a random subset, so its first items are not the hub's
hellaswag = tokendata.local_data("hellaswag/hellaswag_val_sample1000.jsonl", "hellaswag")
# a jsonl of MMLU-Pro's rows (question, options, answer_index), or '' = its test split from the hub (TIGER-Lab/MMLU-Pro)
mmlu_pro = tokendata.local_data("mmlu_pro/test.jsonl")
num_problems = 100  # the first problems of the benchmark (after the max_steps filter)
max_steps = 0  # gsm8k: keep problems whose reference takes at most this many calculator steps (0: every problem)
n = 16  # answers per problem, arm and seed: pass@k for k = 1 ... n
ks = (1, 2, 4, 8, 16)  # the table's columns
max_new_tokens = 256  # gsm8k
temperature = 1.0  # the paper's high temperature; the greedy minds' excepted
score = "sum"  # hellaswag_mc: what an ending's draw is the softmax of: 'sum' (its log-likelihood), 'char' (per character,
#                times the item's mean ending length: the length-normalised score at the endings' own scale)
sigma = 0.03  # relative to each gain: +0.08 nats and 15% argmax flips on SmolLM2 (experiments/btrans_sigma.py)
sigma_scale = "gain"
seeds = (1, 2, 3)
time_only = False  # time one problem (three arms, one seed) and stop
from_json = False  # print the table and draw the figure from json_out, running nothing
json_out = ""  # '' = assets/btrans_passk_pretrained_<benchmark>.json; the figure beside it, .png
device = "cpu"
kernels = "fast"  # 'plain': the model file's own modules, no speed-up applied from outside (docs/models.md)
dtype = "float32"  # of the weights: bfloat16 halves the memory (on a GPU, as the paper's models are published)
# Qwen3's chat template thinks before it answers unless enable_thinking is false: a lettered answer must be the
# reply's first token, so Qwen3 runs set thinking=False there (other templates ignore the variable)
thinking = True
config, _ = configurator.apply(globals())
configurator.require(config, positive=("num_problems", "n"), non_negative=("max_steps", "temperature"),
                     choices={"benchmark": ("gsm8k", "hellaswag", "mmlu_pro", "hellaswag_mc"), "score": ("sum", "char"),
                              "dtype": tuple(common.DTYPES), "kernels": speedups.KERNELS})
speedups.use(kernels)
if score != "sum" and benchmark != "hellaswag_mc":
    common.die(f"--score={score} scores endings: it goes with --benchmark=hellaswag_mc")
if max(ks) > n:
    common.die(f"ks={ks} asks for pass@{max(ks)} from n={n} answers: raise n or drop the larger k")
json_out = json_out or f"assets/btrans_passk_pretrained_{benchmark}{'' if score == 'sum' else '_' + score}.json"
ARMS = ("temperature", "minds", "greedy minds")
HUB = {"gsm8k": ("openai/gsm8k", "main"), "mmlu_pro": ("TIGER-Lab/MMLU-Pro", None)}  # (path, name) of a test split


def problems_named(benchmark, max_steps, score):
    """What the problems are, in words (the log's first line, the figure's title)."""
    return {"gsm8k": "GSM8K test problems" + (f" of at most {max_steps} calculator steps" if max_steps else ""),
            "hellaswag": "HellaSwag validation items as lettered multiple choice",
            "hellaswag_mc": "HellaSwag validation items, endings scored "
                            + ("per character" if score == "char" else "by their log-likelihood"),
            "mmlu_pro": "MMLU-Pro test questions"}[benchmark]


def report(run):
    """The table (mean ± std over seeds at each of ks; * where an arm's interval and temperature's do not overlap)
    and the figure beside json_out (pass@k against k, mean over seeds, band min-max), from a run's JSON record."""
    curves = {arm: np.array(c) for arm, c in run["pass_at_k_per_seed"].items()}  # (seeds, n) per arm
    ref = curves["temperature"]
    print("\n| arm | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for arm, c in curves.items():
        cells = [study.mean_std(c[:, k - 1])
                 + ("*" if arm != "temperature" and study.intervals_apart(c[:, k - 1], ref[:, k - 1]) else "")
                 for k in ks]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    if run["benchmark"] == "hellaswag_mc":  # a uniform guesser's pass@k over four endings
        print("| chance | " + " | ".join(f"{1 - 0.75 ** k:.3f}" for k in ks) + " |")
    if study.one_seed_note(run["seeds"]):
        print(f"\n{study.one_seed_note(run['seeds'])}")
    plt = common.pyplot("the table is above; the figure")
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, c in curves.items():
        k = np.arange(1, c.shape[1] + 1)
        ax.plot(k, c.mean(0), marker=".", label=arm)
        ax.fill_between(k, c.min(0), c.max(0), alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_title(f"{os.path.basename(os.path.normpath(run['out_dir']))}: {run['num_problems']} "
                 f"{problems_named(run['benchmark'], run['max_steps'], run.get('score'))}\nn={run['n']}, "
                 f"T={run['temperature']}, minds sigma={run['sigma']} ({run['sigma_scale']}); mean of "
                 f"{len(run['seeds'])} seeds, band: min-max", fontsize=9)
    ax.legend()
    fig.tight_layout()
    study.save_figure(fig, json_out)


if from_json:
    study.report_from_json(json_out, report)
source = {"gsm8k": gsm8k, "hellaswag": hellaswag, "mmlu_pro": mmlu_pro, "hellaswag_mc": hellaswag}[benchmark]
if source and not os.path.exists(source) and source != "hellaswag":
    common.die(f"{source} not found: pass --{benchmark}=<its jsonl> (GSM8K's test.jsonl from openai/grade-school-math, "
               f"HellaSwag's validation jsonl, or MMLU-Pro's rows)")
if benchmark in ("gsm8k", "mmlu_pro"):
    hub = HUB[benchmark]
    if source:
        with open(source) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        try:
            import datasets
            rows = datasets.load_dataset(*hub, split="test")
        except Exception as e:
            common.die(f"{hub[0]} did not load from the hub ({type(e).__name__}): pass --{benchmark}=<a local jsonl>")
if benchmark == "gsm8k":
    problems = [p for p in rows if not max_steps or tasks.gsm8k_steps(p["answer"]) <= max_steps]
    problems = [{"question": p["question"], "answer": tasks.gsm8k_answer(p["answer"])} for p in problems]
elif benchmark == "mmlu_pro":
    problems = tasks.mmlu_pro_problems(rows)
elif benchmark == "hellaswag_mc":
    problems = multiple_choice.load_mc_examples(source)  # {context, choices, label}
else:
    problems = [{"question": tasks.lettered_question(ex["context"], ex["choices"]),
                 "answer": tasks.LETTERS[ex["label"]], "choices": len(ex["choices"])}
                for ex in multiple_choice.load_mc_examples(source)]
problems = problems[:num_problems]
# One model in memory, whatever the arm: the minds, and det as the same model with its offsets off (noise_mode
# 'mean', mu = 0: det's logits bit for bit, tests/test_btrans.py), so an 8B model's weights are held once.
minds, checkpoint = ckpt.load_model(out_dir, device, "btrans", sigma=sigma, sigma_scale=sigma_scale)
checkpoint.pop("model")  # the model holds the weights now
minds.eval()
for p in minds.parameters():  # the weights only, as sample.py --dtype: RoPE's tables stay float32
    p.data = p.data.to(common.DTYPES[dtype])
encode, decode = tokendata.tokenizer(checkpoint["meta"])
end_id = tokendata.turn_end(checkpoint["meta"], encode)
if end_id is None and benchmark != "hellaswag_mc":  # hellaswag_mc scores endings: no chat turn to end
    common.die(f"{out_dir}'s tokenizer_config.json names no end of turn of one token (eos_token): this experiment "
               f"asks an Instruct model in its chat template")
if benchmark == "hellaswag_mc":  # (context, ending) token pairs, as evaluate.py --task=mc makes them
    prompts = [[multiple_choice.choice_tokens(encode, p["context"], choice) for choice in p["choices"]]
               for p in problems]
    # the scores' scale per ending: 1 (sums), or the item's mean character count / the ending's
    scales = [torch.ones(len(p["choices"])) if score == "sum" else
              torch.tensor([np.mean([len(c) for c in p["choices"]]) / len(c) for c in p["choices"]])
              for p in problems]
else:
    prompts = [encode(tokendata.chat_prompt(checkpoint["meta"], p["question"], enable_thinking=thinking))
               for p in problems]


def arm_model(arm):
    """The model an arm samples from: det ('mean': the offsets' mean, 0) for temperature, else the minds."""
    minds.config.noise_mode = "mean" if arm == "temperature" else "sequence"
    return minds


def gsm8k_correct(seed, i, population):
    """{arm: correct answers of n} for GSM8K problem i: n completions of each arm, decoded to max_new_tokens."""
    correct = {}
    for arm in ARMS:
        T = 0.0 if arm == "greedy minds" else temperature
        idx = torch.tensor([prompts[i]], device=device).expand(n, -1)
        tokens = torch.Generator(device).manual_seed(common.seed_of(seed, ARMS.index(arm), i))  # beside the logits
        rows = arm_model(arm).generate(idx, max_new_tokens, T, latents=None if arm == "temperature" else population,
                                       generator=tokens)[:, idx.size(1):].tolist()
        rows = [row[:row.index(end_id)] if end_id in row else row for row in rows]
        correct[arm] = sum(tasks.gsm8k_answer(decode(row)) == problems[i]["answer"] for row in rows)
    return correct


def lettered_correct(seed, i, population, det_logits):
    """{arm: correct answers of n} for lettered item i (HellaSwag, MMLU-Pro): each arm's first token, from the
    prompt's logits (det's are the same for every seed: computed once per item)."""
    tokens = torch.Generator().manual_seed(common.seed_of(seed, i))
    mind_logits = arm_model("minds")(torch.tensor([prompts[i]], device=device).expand(n, -1),
                                     latents=population)[0][:, -1].float().cpu()  # (n, V)
    draws = {"temperature": torch.multinomial(F.softmax(det_logits / temperature, dim=-1), n, replacement=True,
                                              generator=tokens).view(n),
             "minds": torch.multinomial(F.softmax(mind_logits / temperature, dim=-1), 1, generator=tokens).view(n),
             "greedy minds": mind_logits.argmax(-1)}
    return {arm: sum(tasks.letter_answer(decode([t]), problems[i]["choices"]) == problems[i]["answer"]
                     for t in ids.tolist()) for arm, ids in draws.items()}


def scored_correct(seed, i, det_ll):
    """{arm: correct answers of n} for item i scored by the multiple-choice code: det draws n endings from the softmax
    of its scores det_ll (C,) at `temperature`, each mind one from its own, greedy minds take their most likely. The
    minds are score_choices' passes from the seed's generator: the same n minds for every item."""
    tokens = torch.Generator().manual_seed(common.seed_of(seed, i))
    population = torch.Generator().manual_seed(common.seed_of(seed, 0))
    minds_ll = torch.tensor(multiple_choice.score_choices(arm_model("minds"), prompts[i], n, population,
                                                          mixture="none")[0]) * scales[i]  # (n, C): mind m is pass m
    draws = {"temperature": torch.multinomial(F.softmax(det_ll / temperature, dim=-1), n, replacement=True,
                                              generator=tokens),
             "minds": torch.multinomial(F.softmax(minds_ll / temperature, dim=-1), 1, generator=tokens).view(n),
             "greedy minds": minds_ll.argmax(-1)}
    return {arm: int((ids == problems[i]["label"]).sum()) for arm, ids in draws.items()}


def run(problem_ids):
    """(seeds, problems, arms) correct counts."""
    counts = np.zeros((len(seeds), len(problem_ids), len(ARMS)), dtype=int)
    with torch.no_grad(), cpu.inference_linears(minds, common.DTYPES[dtype]):
        for p, i in enumerate(common.progress(problem_ids, desc=f"{benchmark} problems")):
            if benchmark == "hellaswag_mc":  # det's log-likelihoods of the endings: the same for every seed
                det_ll = torch.tensor(multiple_choice.score_choices(arm_model("temperature"), prompts[i], 1, None,
                                                                    mixture="none")[0][0]) * scales[i]  # (C,)
            elif benchmark != "gsm8k":
                det_logits = arm_model("temperature")(torch.tensor([prompts[i]], device=device))[0][0, -1].float().cpu()
            for s, seed in enumerate(seeds):
                if benchmark == "hellaswag_mc":
                    counts[s, p] = [scored_correct(seed, i, det_ll)[arm] for arm in ARMS]
                    continue
                population = minds.sample_latents(n, torch.Generator().manual_seed(common.seed_of(seed, 0)))
                correct = (gsm8k_correct(seed, i, population) if benchmark == "gsm8k"
                           else lettered_correct(seed, i, population, det_logits))
                counts[s, p] = [correct[arm] for arm in ARMS]
            if (p + 1) % 10 == 0:
                print(f"{p + 1}/{len(problem_ids)} problems, {(time.time() - t0) / 60:.1f} min; correct so far "
                      + ", ".join(f"{arm} {counts[:, :p + 1, a].sum()}" for a, arm in enumerate(ARMS)), flush=True)
    return counts


print(f"{out_dir}: the first {len(problems)} {problems_named(benchmark, max_steps, score)}, n={n} per arm and seed, "
      f"T={temperature}, minds sigma={sigma} ({sigma_scale}), seeds {list(seeds)}")
t0 = time.time()
if time_only:
    all_seeds, seeds = seeds, seeds[:1]
    run([0])
    per = time.time() - t0
    print(f"one problem, one seed, three arms: {per:.1f} s; the whole run ({len(problems)} problems x "
          f"{len(all_seeds)} seeds) ~ {per * len(problems) * len(all_seeds) / 60:.0f} min")
    raise SystemExit
counts = run(range(len(problems)))
minutes = (time.time() - t0) / 60
settings = {"out_dir": out_dir, "benchmark": benchmark, "source": os.path.basename(source) or HUB[benchmark][0],
            "max_steps": max_steps, "num_problems": len(problems), "n": n, "temperature": temperature, "sigma": sigma,
            "sigma_scale": sigma_scale, **({"max_new_tokens": max_new_tokens} if benchmark == "gsm8k" else {}),
            **({"score": score} if benchmark == "hellaswag_mc" else {})}
if os.path.exists(json_out):  # seeds another invocation wrote with the same settings join this run's (one per process)
    with open(json_out) as f:
        earlier = json.load(f)
    if all(earlier.get(name) == value for name, value in settings.items()):
        kept = [(seed, c) for seed, c in zip(earlier["seeds"], earlier["correct_per_seed_problem_arm"])
                if seed not in seeds]
        order = sorted([*kept, *zip(seeds, counts.tolist())])
        seeds, counts = [seed for seed, _ in order], np.array([c for _, c in order])
        minutes += earlier["minutes"]
        print(f"{json_out}: seeds {[seed for seed, _ in kept]} kept from an earlier run with the same settings")
curves = {arm: np.array([list(metrics.pass_at_k_curve(counts[s, :, a], n, range(1, n + 1)).values())
                         for s in range(len(seeds))]) for a, arm in enumerate(ARMS)}  # (seeds, n) per arm
record = {**settings, "seeds": list(seeds), "minutes": minutes, "correct_per_seed_problem_arm": counts.tolist(),
          "arms": list(ARMS), "pass_at_k_per_seed": {arm: c.round(6).tolist() for arm, c in curves.items()}}
os.makedirs(os.path.dirname(json_out) or ".", exist_ok=True)
with open(json_out, "w") as f:
    json.dump(record, f, indent=1)
print(f"wrote {json_out}")
report(record)
