"""The statistics behind the README's verdicts (docs/reproductions.md, "How a verdict is given"): paired differences
over seeds with their 95% Student-t interval and p, a bootstrap over items, Holm's adjustment over the judged rows, the
no-model baselines of the regime check (add-one and Kneser–Ney counts), and the verdict those rules give. numpy and
the standard library only (scipy is optional here)."""

import math

import numpy as np

MARGIN = 0.2  # nats by which every arm must beat the best no-model baseline for the regime to count (rule 3)
DISCOUNT = 0.75  # Kneser–Ney's absolute discount, the textbook value, not tuned (Chen and Goodman 1998 fit 0.7-0.8)
FEW_ITEMS = 1000  # under this many evaluated items or problems, a bootstrap over items joins the t interval (rule 2)
RESAMPLES = 2000


def t_tail(x, df):
    """P(T > x) for Student t with df degrees of freedom, x >= 0: 1/2 minus the density's integral from 0 to x by
    Simpson's rule on 20,000 intervals."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    u = np.linspace(0.0, x, 20001)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(u * u / df))
    return max(0.5 - x / 60000 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()), 0.0)


def t_quantile(p, df):
    """Student t's p-quantile (0.5 < p < 1) with df degrees of freedom: bisection on its tail (t(0.975, 2) = 4.3027
    as in every table)."""
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_tail(mid, df) > 1 - p else (lo, mid)
    return (lo + hi) / 2


def paired(paper_arm, other_arm):
    """The effect (rule 2): per-seed differences paper_arm - other_arm (values one per seed, in the same seed order,
    already signed so that positive is the paper's direction), their mean, sd (ddof 1) and 95% t interval (None with
    one seed)."""
    d = np.asarray(paper_arm, float) - np.asarray(other_arm, float)
    n, mean = len(d), float(d.mean())
    if n < 2:
        return dict(n=n, diffs=d.tolist(), mean=mean, sd=None, lo=None, hi=None, p=None)
    sd = float(d.std(ddof=1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    # the paired t test's two-sided p (None where every difference is equal: no spread to test against)
    p = 2 * float(t_tail(abs(mean) / (sd / math.sqrt(n)), n - 1)) if sd > 0 else None
    return dict(n=n, diffs=d.tolist(), mean=mean, sd=sd, lo=mean - half, hi=mean + half, p=p)


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


def kneser_ney(train, vocab_size, discount=DISCOUNT):
    """The interpolated Kneser–Ney bigram counted on the token stream `train`, and the unigram with the same absolute
    discount, each interpolated down to the uniform 1/V so that every id of the vocabulary has mass:
        unigram(w)  = max(c(w) - D, 0) / N + D n(w: c(w) > 0) / N / V
        cont(w)     = max(N1+(. w) - D, 0) / N1+(. .) + D n(w: N1+(. w) > 0) / N1+(. .) / V
        bigram(w|v) = max(c(v w) - D, 0) / c(v .) + D N1+(v .) / c(v .) cont(w),   cont(w) where c(v .) = 0
    c(v .) counts v as the first of a training pair, N1+(v .) the distinct words after v, N1+(. w) the distinct words
    before w, N1+(. .) the distinct pairs. Returns (unigram, bigram): unigram(w), bigram(v, w) on arrays of ids."""
    train, V, D = np.asarray(train, np.int64), vocab_size, discount
    counts = np.bincount(train, minlength=V)
    p_uni = np.maximum(counts - D, 0) / len(train) + D * (counts > 0).sum() / len(train) / V  # (V,)
    keys, pair_counts = np.unique(train[:-1] * V + train[1:], return_counts=True)  # sparse: V * V does not fit
    context = np.bincount(train[:-1], minlength=V)  # c(v .)
    after, before = np.bincount(keys // V, minlength=V), np.bincount(keys % V, minlength=V)  # N1+(v .), N1+(. w)
    p_cont = np.maximum(before - D, 0) / len(keys) + D * (before > 0).sum() / len(keys) / V  # (V,)

    def bigram(v, w):
        v, w = np.asarray(v, np.int64), np.asarray(w, np.int64)
        query = v * V + w
        at = np.clip(np.searchsorted(keys, query), 0, len(keys) - 1)
        c = np.where(keys[at] == query, pair_counts[at], 0)
        cv = np.maximum(context[v], 1)
        return np.where(context[v] > 0, np.maximum(c - D, 0) / cv + D * after[v] / cv * p_cont[w], p_cont[w])
    return (lambda w: p_uni[np.asarray(w, np.int64)]), bigram


def ngram_baselines(train, val, starts, T, vocab_size):
    """Cross-entropy (nats/token) of the no-model baselines counted on the training stream `train`, on exactly the
    tokens evaluate.py scores: the targets val[s+1 : s+T+1] of each window start s, each bigram conditioned on the
    token before it. Returns {"unigram", "bigram" (add-one), "kn_unigram", "kn_bigram" (kneser_ney), "tokens"}."""
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
    kn_uni, kn_bi = kneser_ney(train, V)
    nll = lambda p: float(-np.log(p).mean())
    return dict(unigram=nll(p_uni), bigram=nll(p_bi), kn_unigram=nll(kn_uni(targets)),
                kn_bigram=nll(kn_bi(prev, targets)), tokens=len(targets))


BASELINES = ("unigram", "bigram", "kn_unigram", "kn_bigram")  # the keys of ngram_baselines' no-model CEs


def regime(arm_ces, baselines, margin=MARGIN):
    """Rule 3: every arm's CE at least `margin` nats below the best (lowest) no-model baseline; baselines: a dict
    holding BASELINES' CEs. -> (reached, the best baseline's key)"""
    best = min(BASELINES, key=lambda k: baselines[k])
    return max(arm_ces) <= baselines[best] - margin, best


def floor(paper_arm, other_arm):
    """Both arms take one and the same value in every seed (a floor or a ceiling, e.g. no run ever moved from its
    start): the comparison is degenerate, there is nothing to judge at this scale (rule 4)."""
    return len(set(map(float, paper_arm)) | set(map(float, other_arm))) == 1


def verdict(effect, regime_reached=True, tested=True, structural_zero=False, degenerate=False):
    """The rules' verdict, the first that applies (rule 4). effect: paired()'s dict (after widest()). A seed whose
    difference is exactly 0 (a tie) does not go the paper's way."""
    if not tested:
        return "not tested"
    if structural_zero:
        return "not judged"
    if not regime_reached or degenerate:
        return "not at this scale"
    n, lo, hi = effect["n"], effect["lo"], effect["hi"]
    if n < 3:  # three seeds make a pilot: fewer give no verdict, whatever their interval
        return "pilot"
    if lo is not None and lo > 0:
        return "reproduces"
    if hi is not None and hi < 0:
        return "against the paper"
    if n < 5:
        return "pilot"
    return "direction only" if all(d > 0 for d in effect["diffs"]) else "not shown"


JUDGED = ("reproduces", "against the paper", "direction only", "not shown", "pilot")  # verdicts read off an interval


def holm(ps):
    """Holm's step-down adjustment of the p values `ps` (one family): the i-th smallest becomes the running maximum of
    min(1, (m - j + 1) p_(j)) over j <= i. Same order as given."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def formatted(effect, fmt):
    """'mean [lo, hi]' of a paired effect, each number in format fmt ('.3f', '+.4f'); the mean alone without an
    interval (one seed)."""
    text = format(effect["mean"], fmt)
    return text if effect["lo"] is None else f"{text} [{effect['lo']:{fmt}}, {effect['hi']:{fmt}}]"


def interval(effect):
    """'+0.120 [+0.050, +0.190]': the mean paired difference and its interval (the mean alone for one seed); one
    decimal where the interval reaches 1 or more."""
    digits = 1 if max(abs(v) for v in (effect["mean"], effect["lo"] or 0, effect["hi"] or 0)) >= 1 else 3
    return formatted(effect, f"+.{digits}f") + (" (one seed)" if effect["lo"] is None else "")
