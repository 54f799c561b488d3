"""The statistics behind the README's verdicts (docs/reproductions.md, "How a verdict is given"): paired differences
over seeds with their 95% Student-t interval, a bootstrap over items, the add-one unigram and bigram baselines of the
regime check, and the verdict those rules give. numpy and the standard library only (scipy is optional here)."""

import math

import numpy as np

MARGIN = 0.2  # nats by which every arm must beat the better no-model baseline for the regime to count (rule 3)
FEW_ITEMS = 1000  # under this many evaluated items or problems, a bootstrap over items joins the t interval (rule 2)
RESAMPLES = 2000


def t_quantile(p, df):
    """Student t's p-quantile (0.5 < p < 1) with df degrees of freedom: bisection on its CDF, 1/2 plus the density's
    integral from 0 to x by Simpson's rule on 20,000 intervals (t(0.975, 2) = 4.3027 as in every table)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x):
        u = np.linspace(0.0, x, 20001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(u * u / df))
        return 0.5 + x / 60000 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired(paper_arm, other_arm):
    """The effect (rule 2): per-seed differences paper_arm - other_arm (values one per seed, in the same seed order,
    already signed so that positive is the paper's direction), their mean, sd (ddof 1) and 95% t interval (None with
    one seed)."""
    d = np.asarray(paper_arm, float) - np.asarray(other_arm, float)
    n, mean = len(d), float(d.mean())
    if n < 2:
        return dict(n=n, diffs=d.tolist(), mean=mean, sd=None, lo=None, hi=None)
    sd = float(d.std(ddof=1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return dict(n=n, diffs=d.tolist(), mean=mean, sd=sd, lo=mean - half, hi=mean + half)


def bootstrap(paper_items, other_items, resamples=RESAMPLES, seed=0):
    """Percentile 95% interval of the mean paired difference over seeds when items are resampled: paper_items and
    other_items are (seeds, items) arrays, the same items in the same order; one resample of item indices serves every
    seed and both arms (the items are shared, rule 2)."""
    a, b = np.asarray(paper_items, float), np.asarray(other_items, float)  # (S, I)
    idx = np.random.default_rng(seed).integers(0, a.shape[1], size=(resamples, a.shape[1]))  # (R, I)
    means = (a - b)[:, idx].mean(axis=(0, 2))  # (R,)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def widest(effect, interval):
    """The effect with the wider of its t interval and another (the bootstrap's), as the rules' verdict takes it."""
    if interval is None or effect["lo"] is not None and effect["hi"] - effect["lo"] >= interval[1] - interval[0]:
        return {**effect, "source": "t"}
    return {**effect, "lo": interval[0], "hi": interval[1], "source": "bootstrap"}


def ngram_baselines(train, val, starts, T, vocab_size):
    """Cross-entropy (nats/token) of the add-one unigram and add-one bigram models counted on the training stream
    `train`, on exactly the tokens evaluate.py scores: the targets val[s+1 : s+T+1] of each window start s, each
    bigram conditioned on the token before it. Returns (unigram, bigram, tokens)."""
    train, val, V = np.asarray(train, np.int64), np.asarray(val, np.int64), vocab_size
    targets = np.concatenate([val[s + 1:s + T + 1] for s in starts])
    prev = np.concatenate([val[s:s + T] for s in starts])
    unigram = np.bincount(train, minlength=V)
    p_uni = (unigram[targets] + 1) / (len(train) + V)
    pairs = train[:-1] * V + train[1:]  # bigram ids, counted sparsely: V * V does not fit for GPT-2's vocabulary
    keys, counts = np.unique(pairs, return_counts=True)
    query = prev * V + targets
    at = np.clip(np.searchsorted(keys, query), 0, len(keys) - 1)
    pair_counts = np.where(keys[at] == query, counts[at], 0)
    context = np.bincount(train[:-1], minlength=V)  # each context's count as the first token of a training bigram
    p_bi = (pair_counts + 1) / (context[prev] + V)
    return float(-np.log(p_uni).mean()), float(-np.log(p_bi).mean()), len(targets)


def regime(arm_ces, unigram, bigram, margin=MARGIN):
    """Rule 3: every arm's CE at least `margin` nats below the better (lower) of the two no-model baselines."""
    return max(arm_ces) <= min(unigram, bigram) - margin


def verdict(effect, regime_reached=True, tested=True, structural_zero=False):
    """The rules' verdict, the first that applies (rule 4). effect: paired()'s dict (after widest())."""
    if not tested:
        return "not tested"
    if structural_zero:
        return "not judged"
    if not regime_reached:
        return "not at this scale"
    n, lo, hi = effect["n"], effect["lo"], effect["hi"]
    if n < 3:  # three seeds make a pilot: fewer give no verdict, whatever their interval
        return "pilot"
    if lo is not None and lo > 0:
        return "reproduces"
    if hi is not None and hi < 0:
        return "not reproduced"
    if n < 5:
        return "pilot"
    return "direction only" if all(d > 0 for d in effect["diffs"]) else "not reproduced"


def interval(effect):
    """'+0.120 [+0.050, +0.190]': the mean paired difference and its interval (the mean alone for one seed); one
    decimal where the interval reaches 1 or more."""
    digits = 1 if max(abs(v) for v in (effect["mean"], effect["lo"] or 0, effect["hi"] or 0)) >= 1 else 3
    if effect["lo"] is None:
        return f"{effect['mean']:+.{digits}f} (one seed)"
    return f"{effect['mean']:+.{digits}f} [{effect['lo']:+.{digits}f}, {effect['hi']:+.{digits}f}]"
