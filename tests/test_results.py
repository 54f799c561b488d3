"""The README's results table is experiments/results.py's output, and every row's statistics hold when recomputed here
from its per-seed values with lines of this file's own (statistics.stdev, a printed t table, the rules of
docs/reproductions.md written out again): a wrong statistic in experiments/stats.py fails these tests."""

import json
import math
import os
import re
import statistics

import numpy as np
import pytest

from conftest import LOCAL_DATA, ROOT, local_skip, run_script
from experiments import results, stats

# Student t's 97.5th percentiles, df = 1..10: NIST/SEMATECH e-Handbook of Statistical Methods, §1.3.6.7.2
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 31: 2.040, 99: 1.984}
MARGIN = 0.2  # rule 3's nats


def readme_cells(measured):
    """The cells of the README's row whose 'we measured' cell is `measured` (claims repeat: "the same, SmolLM2-135M")."""
    with open(f"{ROOT}/README.md", encoding="utf-8") as f:
        lines = results.readme_table(f.read()).splitlines()[2:]
    (line,) = [line for line in lines if line.split(" | ")[2] == measured]
    return [c.strip() for c in line.strip("| \n").split(" | ")]


def rules(n, mean, lo, hi, diffs, reached, tested, structural):
    """The verdict words of docs/reproductions.md, written out again."""
    if not tested:
        return "not tested"
    if structural:
        return "not judged"
    if not reached:
        return "not at this scale"
    if n < 3:
        return "pilot"
    if lo > 0:
        return "reproduces"
    if hi < 0:
        return "not reproduced"
    if n < 5:
        return "pilot"
    return "direction only" if min(diffs) > 0 else "not reproduced"


def close(printed, value):
    """printed (a number as the table rounds it) equals value to its last printed digit."""
    digits = len(printed.split(".")[1])
    return abs(float(printed) - value) <= 0.5 * 10 ** -digits + 1e-9


def test_t_quantile_matches_the_printed_table():
    for df, t in T975.items():
        assert stats.t_quantile(0.975, df) == pytest.approx(t, abs=6e-4)


def test_ngram_baselines_equal_counting_by_hand():
    train, val, V, T = [0, 1, 2, 1, 0, 1, 2, 2, 0], [1, 2, 0, 1, 1, 2, 0, 0, 2], 5, 3
    starts = [0, 3]  # targets val[1:4], val[4:7]
    uni, bi = {}, {}
    for a in train:
        uni[a] = uni.get(a, 0) + 1
    for a, b in zip(train, train[1:]):
        bi[a, b] = bi.get((a, b), 0) + 1
    pairs = [(val[j - 1], val[j]) for s in starts for j in range(s + 1, s + T + 1)]
    want_uni = -sum(math.log((uni.get(b, 0) + 1) / (len(train) + V)) for a, b in pairs) / len(pairs)
    want_bi = -sum(math.log((bi.get((a, b), 0) + 1) / (sum(c for (x, _), c in bi.items() if x == a) + V))
                   for a, b in pairs) / len(pairs)
    unigram, bigram, tokens = stats.ngram_baselines(train, val, starts, T, V)
    assert tokens == 6 and unigram == pytest.approx(want_uni, rel=1e-12) and bigram == pytest.approx(want_bi, rel=1e-12)


def test_bootstrap_resamples_the_same_items_in_both_arms():
    rng = np.random.default_rng(0)
    other = rng.normal(size=(3, 50))
    assert stats.bootstrap(other + 0.5, other) == pytest.approx((0.5, 0.5))  # paired items: no spread at all
    lo, hi = stats.bootstrap(other + rng.normal(0.5, 1.0, size=(3, 50)), other)
    assert lo < 0.5 < hi and hi - lo > 0.2


@pytest.mark.parametrize("diffs, reached, tested, structural, want", [
    ([0.3, 0.2, 0.25], True, True, False, "reproduces"),
    ([-0.3, -0.2, -0.25], True, True, False, "not reproduced"),
    ([0.3, -0.2, 0.25], True, True, False, "pilot"),  # 3 seeds, the interval holds 0: run to 5
    ([0.3, 0.01, 0.25, 0.02, 0.6], True, True, False, "direction only"),  # every seed the paper's way, around 0
    ([0.3, -0.2, 0.25, -0.1, 0.02], True, True, False, "not reproduced"),  # 5 seeds disagreeing
    ([0.3, 0.2, 0.25], False, True, False, "not at this scale"),
    ([0.3, 0.2, 0.25], True, False, False, "not tested"),
    ([0.3, 0.2, 0.25], True, True, True, "not judged"),
    ([0.3], True, True, False, "pilot"),
    ([0.2, 0.21], True, True, False, "pilot"),  # 2 seeds: an interval that excludes 0 is still no verdict
])
def test_verdict_follows_the_rules(diffs, reached, tested, structural, want):
    effect = stats.paired(diffs, [0.0] * len(diffs))
    assert stats.verdict(effect, reached, tested, structural) == want


def test_readme_table_is_the_functions_output():
    with open(f"{ROOT}/README.md", encoding="utf-8") as f:
        assert results.readme_table(f.read()) == results.table()
    with open(f"{ROOT}/{results.REPRO}", encoding="utf-8") as f:
        assert results.between(f.read(), results.SETTINGS_BEGIN, results.SETTINGS_END) == results.eve_tables()


@pytest.mark.parametrize("row", results.rows(), ids=lambda row: row["claim"])
def test_each_rows_interval_regime_and_verdict_recomputed(row):
    cells = readme_cells(row["measured"])
    claim, paper, measured, n_cell, interval_cell, regime_cell, verdict_cell, study = cells
    d = [p - o for p, o in zip(row["paper_arm"], row["other"])]
    n, mean = len(d), sum(d) / len(d)
    assert n_cell == str(n) and n == len(row["other"])
    numbers = re.findall(r"[+-]\d+\.\d+", interval_cell)
    assert close(numbers[0], mean)
    lo = hi = None
    if n > 1:
        half = T975[n - 1] * statistics.stdev(d) / math.sqrt(n)
        lo, hi = mean - half, mean + half
        if "(bootstrap)" in interval_cell:  # the bootstrap's interval shown: it must be the wider one
            assert row["bootstrap"][1] - row["bootstrap"][0] > hi - lo
            lo, hi = row["bootstrap"]
        elif "(t ≥ boot.)" in interval_cell:
            assert row["bootstrap"][1] - row["bootstrap"][0] <= hi - lo
        assert close(numbers[1], lo) and close(numbers[2], hi), (interval_cell, lo, hi)
    else:
        assert "one seed" in interval_cell
    regime = row["regime"]
    if "ces" in regime:  # a language model: every arm at least MARGIN below the better add-one baseline
        reached = max(regime["ces"]) <= min(regime["unigram"], regime["bigram"]) - MARGIN
        turned = re.search(r"turned (\d+)/(\d+)", regime_cell)
        if turned:
            reached = reached and 2 * int(turned[1]) > int(turned[2])
        assert regime_cell.startswith("yes" if reached else "no") and regime["reached"] == reached
        assert close(re.search(r"unigram (\d+\.\d+)", regime_cell)[1], regime["unigram"])
    want = rules(n, mean, lo, hi, d, regime["reached"], row["tested"], row["structural"])
    assert verdict_cell == want
    visible = re.sub(r"\]\([^)]*\)", "]", "| " + " | ".join(cells) + " |")
    assert len(visible) <= 200, visible  # the table stays readable; numbers are one link away


def test_diversity_row_recomputed_from_the_studys_json():
    """§5.1's row from assets/btrans_diversity_smollm2.json read here: each seed's mean over the prompts of minds at
    T = 1 and det at T*, T* the search's probe closest to the minds' NLL, the regime (every seed's NLL gap under 0.1
    nats), the cell's numbers, and a bootstrap over the prompts of this file's own (another generator: equal to the
    row's within the resampling's noise)."""
    with open(os.path.join(ROOT, "assets", "btrans_diversity_smollm2.json")) as f:
        runs = json.load(f)["runs"]
    prompts = {arm: [r["arms"][arm]["diversity"] for r in runs] for arm in ("minds, T=1", "det, T=1", "det, T*")}
    seed_means = {arm: [statistics.mean(v) for v in values] for arm, values in prompts.items()}
    gaps = []
    for r in runs:
        target = statistics.mean(r["arms"]["minds, T=1"]["nll"])
        best = min(r["probes"], key=lambda p: abs(p["nll"] - target))
        assert r["matched_temperature"] == best["temperature"] == r["arms"]["det, T*"]["temperature"]
        assert statistics.mean(r["arms"]["det, T*"]["nll"]) == pytest.approx(best["nll"], abs=1e-9)
        assert r["probes"][0]["temperature"] == 1.0 and len(r["probes"]) <= 4
        gaps.append(abs(best["nll"] - target))
        assert all(len(r["arms"][arm][k]) >= 32 for arm in prompts for k in ("nll", "diversity"))
    row = results.judged(results.btrans_diversity())
    assert row["paper_arm"] == pytest.approx(seed_means["minds, T=1"], abs=1e-12)
    assert row["other"] == pytest.approx(seed_means["det, T*"], abs=1e-12)
    assert row["regime"]["reached"] == (max(gaps) < 0.1)
    minds, matched, t_star, raw = re.findall(r"[+-]?\d+\.\d+", readme_cells(row["measured"])[2])
    assert close(t_star, statistics.mean(r["matched_temperature"] for r in runs))
    assert close(minds, statistics.mean(seed_means["minds, T=1"]))
    assert close(matched, statistics.mean(seed_means["det, T*"]))
    assert close(raw, statistics.mean(seed_means["minds, T=1"]) - statistics.mean(seed_means["det, T=1"]))
    diff = np.array(prompts["minds, T=1"]) - np.array(prompts["det, T*"])  # (seeds, prompts)
    rng = np.random.default_rng(12345)
    means = [diff[:, rng.integers(0, diff.shape[1], diff.shape[1])].mean() for _ in range(4000)]
    lo, hi = np.percentile(means, [2.5, 97.5])
    tolerance = 0.15 * (hi - lo)
    assert abs(row["bootstrap"][0] - lo) < tolerance and abs(row["bootstrap"][1] - hi) < tolerance


def test_passk_smollm2_row_recomputed_from_the_studys_counts():
    """SmolLM2's Pass@K row from its study's correct counts read here: the per-character study, 16 answers per arm,
    item and seed; each seed's unbiased pass@k for every k (1 - C(n - c, k) / C(n, k), averaged over items),
    the row's pass@16 per seed of minds and det, and the regime stated with the protocol (det's pass@1 per item, the
    mean over seeds: the lower end of its 95% t interval over the items above chance, 0.25)."""
    with open(os.path.join(ROOT, "assets", results.PASSK_SMOLLM2)) as f:
        record = json.load(f)
    n, arms = record["n"], record["arms"]
    counts = record["correct_per_seed_problem_arm"]  # [seed][problem][arm]
    assert (record["score"], n, record["temperature"]) == ("char", 16, 1.0)
    assert len(counts[0]) == record["num_problems"] >= 32 and len(counts) == len(record["seeds"])
    curve = lambda seed, a, k: statistics.mean(1 - math.comb(n - c[a], k) / math.comb(n, k) for c in counts[seed])
    for a, name in enumerate(arms):
        for s in range(len(counts)):
            assert record["pass_at_k_per_seed"][name][s] == pytest.approx([curve(s, a, k) for k in range(1, n + 1)],
                                                                          abs=1e-6)
    row = results.judged(results.passk_smollm2())
    assert row["paper_arm"] == pytest.approx([curve(s, arms.index("minds"), n) for s in range(len(counts))])
    assert row["other"] == pytest.approx([curve(s, arms.index("temperature"), n) for s in range(len(counts))])
    det = arms.index("temperature")
    per_item = [statistics.mean(counts[s][i][det] / n for s in range(len(counts))) for i in range(len(counts[0]))]
    low = statistics.mean(per_item) - T975[len(per_item) - 1] * statistics.stdev(per_item) / math.sqrt(len(per_item))
    assert row["regime"]["reached"] == (low > 0.25)
    pass1, printed_low = re.search(r"pass@1 (\d\.\d+) \(low (\d\.\d+)\)", row["regime"]["text"]).groups()
    assert close(pass1, statistics.mean(per_item)) and abs(float(printed_low) - low) < 2e-3


def test_eve_rows_take_their_per_seed_values_from_evaluates_json():
    prefix = "eve_primary" if results.exists("eve_primary.json") else "eve_study"
    with open(os.path.join(ROOT, "assets", f"{prefix}_m1.json")) as f:
        nll = {name.rsplit("/", 1)[1]: r["nll"] for name, r in json.load(f)["results"].items()}
    seeds = sorted(int(k.split("-s")[1]) for k in nll if k.startswith("eve-"))
    seeds = [s for s in seeds if f"det-s{s}" in nll]
    row = results.judged(results.eve_ce())
    assert row["paper_arm"] == [-nll[f"eve-s{s}"] for s in seeds] and row["other"] == [-nll[f"det-s{s}"] for s in seeds]


@pytest.mark.slow
def test_regime_baselines_recount_on_the_prepared_data(tmp_path):
    """assets/regime_baselines.json against a count made here, on the WritingPrompts sample prepared afresh as
    docs/reproductions.md prepares it, from the offline copy NANOLATENT_LOCAL_DATA points at."""
    names = [f"writingprompts/wp_sample_{split}.jsonl" for split in ("train", "test")]
    if local_skip(*names):
        pytest.skip(local_skip(*names))
    files = [os.path.join(LOCAL_DATA, name) for name in names]
    run_script("prepare.py", "text", f"--input={files[0]}", f"--val_input={files[1]}", "--fields=prompt,story",
               "--max_docs=100", "--vocab=used", "--name=wp_sample_cpu", data_dir=tmp_path)
    with open(os.path.join(ROOT, "assets", "regime_baselines.json")) as f:
        table = json.load(f)
    folder = tmp_path / "wp_sample_cpu"
    train, val = (np.fromfile(folder / f"{s}.bin", dtype=np.uint16).tolist() for s in ("train", "val"))
    with open(folder / "meta.json") as f:
        V = json.load(f)["vocab_size"]
    counts, pairs, contexts = {}, {}, {}
    for a, b in zip([None] + train[:-1], train):
        counts[b] = counts.get(b, 0) + 1
        if a is not None:
            pairs[a, b] = pairs.get((a, b), 0) + 1
            contexts[a] = contexts.get(a, 0) + 1
    for name in ("eve_paper_protocol_m1.json", "eve_primary_m1.json"):
        entry = table[name]
        assert entry["dataset"] == "wp_sample_cpu" and entry["train_tokens"] == len(train)
        T = entry["seq_len"]
        windows = range(0, T * entry["windows"], T)
        targets = [(val[s + j - 1], val[s + j]) for s in windows for j in range(1, T + 1)]
        assert len(targets) == entry["tokens"]
        unigram = -sum(math.log((counts.get(w, 0) + 1) / (len(train) + V)) for _, w in targets) / len(targets)
        bigram = -sum(math.log((pairs.get((a, w), 0) + 1) / (contexts.get(a, 0) + V)) for a, w in targets) / len(targets)
        assert entry["unigram"] == pytest.approx(unigram, rel=1e-9) and entry["bigram"] == pytest.approx(bigram, rel=1e-9)


def test_eve_arms_table_recomputed_from_evaluates_json():
    """The primary setting's arm-by-arm table: each arm's CE mean ± std and EVE − arm's paired interval, from
    evaluate.py's one-pass JSON, with this file's own lines."""
    prefix = "eve_primary" if results.exists("eve_primary.json") else "eve_study"
    with open(os.path.join(ROOT, "assets", f"{prefix}_m1.json")) as f:
        nll = {name.rsplit("/", 1)[1]: r["nll"] for name, r in json.load(f)["results"].items()}
    arms = {}
    for name, value in nll.items():
        arm, seed = name.rsplit("-s", 1)
        arms.setdefault(arm, {})[int(seed)] = value
    seeds = sorted(set.intersection(*(set(v) for v in arms.values())))
    lines = [line for line in results.eve_arms_table().splitlines() if line.startswith("| ") and "---" not in line]
    assert sorted(line.split(" | ")[0][2:] for line in lines[1:]) == sorted(arms)
    for line in lines[1:]:
        arm, ce, versus = line[2:].split(" | ")[:3]
        values = [arms[arm][s] for s in seeds]
        m, sd = re.findall(r"\d+\.\d+", ce)
        assert close(m, sum(values) / len(values)) and close(sd, statistics.stdev(values))
        if arm == "eve":
            assert versus == "–"
            continue
        d = [arms["eve"][s] - arms[arm][s] for s in seeds]
        mean, half = sum(d) / len(d), T975[len(d) - 1] * statistics.stdev(d) / math.sqrt(len(d))
        printed = re.findall(r"[+-]\d+\.\d+", versus)
        assert close(printed[0], mean) and close(printed[1], mean - half) and close(printed[2], mean + half)


def own_auroc(scores, positive):
    """AUROC by the rank-sum formula, ranks counted here: 1 + the scores below + half the other scores equal."""
    s, pos = np.asarray(scores, float), np.asarray(positive, bool)
    ranks = 1 + (s[None, :] < s[:, None]).sum(1) + ((s[None, :] == s[:, None]).sum(1) - 1) / 2
    n1, n0 = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)


def test_the_studys_auroc_equals_a_rank_sum_counted_here():
    from experiments import eve_uncertainty
    rng = np.random.default_rng(7)
    for _ in range(5):
        scores, positive = rng.integers(0, 9, size=40), rng.random(40) < 0.4  # ties among 9 values
        assert eve_uncertainty.auroc(scores, positive) == pytest.approx(own_auroc(scores, positive), abs=1e-12)


def test_eve_uncertainty_rows_recomputed_from_the_json():
    """The two §5 rows' per-seed values from assets/eve_uncertainty.json: the document AUROCs from the per-document
    scores by the rank sum above, the mean over the out-of-domain texts, det's better baseline per seed; and each EVE
    run's mean MI and error rate are evaluate.py's on the same windows (assets/eve_primary_m8.json, where it has the
    run)."""
    with open(os.path.join(ROOT, "assets", "eve_uncertainty.json")) as f:
        record = json.load(f)
    p, runs = record["protocol"], record["runs"]
    seeds, texts = p["seeds"], ["tinystories", "shakespeare"]
    assert p["ood_texts"] == texts and p["baselines"] == ["one_minus_maxprob", "entropy"]

    def document_auroc(name, key):
        docs = runs[name]["documents"]
        ind = docs["wp_val"][key]
        assert len(ind) == p["windows"] == 339
        values = [own_auroc(ind + docs[t][key], [0] * len(ind) + [1] * len(docs[t][key])) for t in texts]
        assert all(len(docs[t][key]) >= 100 for t in texts)
        return sum(values) / len(values)
    errors, ood = results.eve_mi_errors(), results.eve_mi_ood()
    assert errors["paper_arm"] == [runs[f"eve-s{s}"]["token_auroc"]["mi"] for s in seeds]
    assert errors["other"] == [max(runs[f"det-s{s}"]["token_auroc"][k] for k in p["baselines"]) for s in seeds]
    assert ood["paper_arm"] == pytest.approx([document_auroc(f"eve-s{s}", "mi") for s in seeds], abs=1e-12)
    assert ood["other"] == pytest.approx([max(document_auroc(f"det-s{s}", k) for k in p["baselines"]) for s in seeds],
                                         abs=1e-12)
    with open(os.path.join(ROOT, "assets", "eve_primary_m8.json")) as f:
        evaluated = {name.rsplit("/", 1)[1]: r for name, r in json.load(f)["results"].items()}
    checked = [name for name in runs if name in evaluated]
    assert checked, "no run of the study is in evaluate.py's JSON"
    for name in checked:
        assert runs[name]["error_rate"] == pytest.approx(1 - evaluated[name]["acc"], abs=1e-12)
        if name.startswith("eve"):
            assert runs[name]["mean"]["mi"] == pytest.approx(evaluated[name]["mi"], rel=1e-5)
            assert runs[name]["mean"]["flip"] == pytest.approx(evaluated[name]["flip_rate"], rel=1e-9)


def test_uncertainty_table_in_the_docs_is_the_functions_output():
    with open(f"{ROOT}/{results.REPRO}", encoding="utf-8") as f:
        docs = results.between(f.read(), results.UNCERTAINTY_BEGIN, results.UNCERTAINTY_END)
    assert docs == results.uncertainty_table()


def test_grpo_rows_recomputed_from_each_runs_evaluations():
    """The toy GRPO rows (assets/rlvr_rule.json): the rule's sigma and T from its probes, each run's peak from its
    evaluations (the selection set's best greedy, the earliest of ties), read on the test set, and the rows' per-seed
    values and per-problem items from those."""
    with open(os.path.join(ROOT, "assets", "rlvr_rule.json")) as f:
        record = json.load(f)
    rule = record["calibration"]
    target = rule["greedy"] - record["gap"]
    for knob in ("temperature", "sigma"):
        best = min(rule[knob].items(), key=lambda kv: abs(kv[1] - target))[0]
        assert rule["chosen"][knob] == float(best)
    assert record["knobs"]["minds"] == {"temperature": 0.0, "sigma": rule["chosen"]["sigma"]}
    assert record["knobs"]["temperature"] == {"temperature": rule["chosen"]["temperature"], "sigma": 0.0}
    want = {}
    for mode, runs in record["runs"].items():
        assert len(runs) == len(record["seeds"]) == 5
        for run in runs:
            evals = run["evals"]
            assert [e["iter"] for e in evals] == list(range(0, record["steps"] + 1, record["eval_interval"]))
            best = max(select["select_greedy"] for select in evals)
            peak = next(e for e in evals if e["select_greedy"] == best)
            assert run["peak step"] == peak["iter"] and run["greedy at peak"] == peak["eval_greedy"]
            for at, value in (("before", run["greedy before"]), ("after", run["greedy after"]),
                              ("at peak", run["greedy at peak"])):
                assert len(run[f"correct {at}"]) == record["eval_prompts"]
                assert sum(run[f"correct {at}"]) / record["eval_prompts"] == pytest.approx(value, abs=1e-12)
        want[mode, "after"] = [r["greedy after"] - r["greedy before"] for r in runs]
        want[mode, "at peak"] = [r["greedy at peak"] - r["greedy before"] for r in runs]
    grpo, ttrl = results.grpo_toy(), results.ttrl_toy()
    assert grpo["paper_arm"] == want["minds", "after"] and grpo["other"] == want["temperature", "after"]
    assert ttrl["paper_arm"] == want["ttrl-minds", "at peak"] and ttrl["other"] == want["ttrl-temperature", "at peak"]
    for row, (paper, other), at in ((grpo, ("minds", "temperature"), "after"),
                                    (ttrl, ("ttrl-minds", "ttrl-temperature"), "at peak")):
        items = [[[a - b for a, b in zip(r[f"correct {at}"], r["correct before"])] for r in record["runs"][mode]]
                 for mode in (paper, other)]
        assert np.array_equal(row["items"][0], items[0]) and np.array_equal(row["items"][1], items[1])
