"""The metrics: Monte Carlo statistics of M stochastic passes (per token, and summed over batches: evaluate.py's
table, the explorer's and the studies' per-token scores), the population metrics of K generations (pass@k, majority
vote, diversity), and a model evaluated by them (evaluate.py's tasks)."""

import math
from collections import Counter
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from nanolatent import common, multiple_choice, tasks

# ----------------------------------------------------------------------------------------------------------------
# Monte Carlo metrics: pure functions of log-probabilities, no model involved


def entropy(p):
    """H(p) in nats over the last axis; xlogy makes 0 log 0 = 0. (..., V) -> (...)"""
    return -torch.special.xlogy(p, p).sum(-1)


@torch.no_grad()
def pass_statistics(passes, targets):
    """Per-token statistics of M passes, evaluate.py's definitions token by token: passes yields the M log-softmaxes
    (N, V) one at a time (or is a (M, N, V) tensor), targets is (N,). Only a few (N, V) tensors live at once, never
    (M, N, V). Every cross-pass quantity enters as a difference to the first pass (p̄ = p_1 + (1/M) sum_m (p_m - p_1),
    likewise the entropies and p_m(y)): identical passes (det, or M = 1) give p̄ = p_1 bit for bit and mi, cond_var and
    the flips exactly 0, not rounding noise. -> {"p_bar" (N, V), "entropy" H(p̄), "expected_entropy" mean_m H(p_m),
    "mi" H(p̄) - mean_m H(p_m), "nll" -log p̄(y), "cond_var" Var_m p_m(y), each (N,); "argmaxes" M x (N,); "passes" M}"""
    targets = targets.reshape(-1, 1)  # (N, 1)
    for m, log_p in enumerate(passes):
        log_p = log_p.to(torch.promote_types(log_p.dtype, torch.float32))  # (N, V)
        p, log_py = log_p.exp(), log_p.gather(1, targets).squeeze(1)  # (N, V), (N,)
        h = entropy(p)  # (N,)
        if m == 0:
            p_first, h_first, py_first, lse_y, argmaxes = p, h, log_py.exp(), log_py, [p.argmax(-1)]
            sum_dp, sum_dh = torch.zeros_like(p), torch.zeros_like(h)
            sum_dpy, sum_dpy2 = torch.zeros_like(h), torch.zeros_like(h)
        else:
            sum_dp += p - p_first
            sum_dh += h - h_first
            d = log_py.exp() - py_first
            sum_dpy += d
            sum_dpy2 += d * d
            lse_y = torch.logaddexp(lse_y, log_py)
            argmaxes.append(p.argmax(-1))
    M = m + 1
    p_bar = p_first + sum_dp / M  # (N, V)
    h_bar, mean_h = entropy(p_bar), h_first + sum_dh / M  # (N,) each
    cond_var = (sum_dpy2 / M - (sum_dpy / M) ** 2).clamp_min(0)  # Var_m p_m(y) = Var_m (p_m(y) - p_1(y))
    return {"p_bar": p_bar, "entropy": h_bar, "expected_entropy": mean_h, "mi": h_bar - mean_h,
            "nll": -(lse_y - math.log(M)),  # -log p̄(y), from the log-softmaxes (logsumexp), never averaged logits
            "cond_var": cond_var, "argmaxes": argmaxes, "passes": M}


class MCStats:
    """Running sums of the Monte Carlo metrics (evaluate.py's docstring defines them), batch by batch: add(passes,
    targets) takes pass_statistics' arguments."""

    def __init__(self, n_bins=15, cvar_alpha=0.05):
        self.n_bins, self.cvar_alpha = n_bins, cvar_alpha
        self.sums = Counter()  # float sums over tokens
        self.n = 0  # tokens
        self.passes = None
        self.token_nll = []  # per-token NLL (CPU), for CVaR
        self.bins = torch.zeros(3, n_bins, dtype=torch.float64)  # per ECE bin: count, sum of confidence, correct

    @torch.no_grad()
    def add(self, passes, targets):
        s = pass_statistics(passes, targets)
        M, p_bar, targets = s["passes"], s["p_bar"], targets.reshape(-1, 1)
        if self.passes not in (None, M):
            raise ValueError(f"every batch needs the same number of passes ({self.passes}), got {M}")
        self.passes = M
        pred = p_bar.argmax(-1)  # (N,) the same call as the passes' argmax: ties break alike
        conf = p_bar.gather(1, pred[:, None]).squeeze(1)  # (N,) top-1 confidence of p̄
        correct = (pred == targets.squeeze(1)).double()
        py_bar = p_bar.gather(1, targets).squeeze(1)
        brier = p_bar.pow(2).sum(-1) - 2 * py_bar + 1  # sum_v (p̄_v - onehot_v)^2 expanded
        flips = sum((a != pred).double() for a in s["argmaxes"]) / M  # (N,)
        for name, value in [("nll", s["nll"]), ("acc", correct), ("brier", brier), ("entropy", s["entropy"]),
                            ("expected_entropy", s["expected_entropy"]), ("mi", s["mi"]), ("cond_var", s["cond_var"]),
                            ("flip_rate", flips)]:
            self.sums[name] += value.double().sum().item()
        self.n += targets.size(0)
        self.token_nll.append(s["nll"].double().cpu())
        b = (conf.double() * self.n_bins).long().clamp(max=self.n_bins - 1).cpu()  # conf == 1.0 -> last bin
        for row, value in enumerate((torch.ones_like(conf), conf, correct)):
            self.bins[row].index_add_(0, b, value.double().cpu())
        return self

    def result(self):
        out = {name: total / self.n for name, total in self.sums.items()}
        out["ppl"] = math.exp(out["nll"])
        count, conf, correct = self.bins
        out["ece"] = ((correct - conf).abs().sum() / self.n).item()
        out["epistemic_ratio"] = out["mi"] / out["entropy"] if out["entropy"] > 0 else 0.0
        nll = torch.cat(self.token_nll)
        worst = torch.topk(nll, math.ceil(self.cvar_alpha * nll.numel())).values
        out["cvar_nll"] = worst.double().mean().item()
        out["tokens"], out["passes"] = self.n, self.passes
        order = ["nll", "ppl", "acc", "ece", "brier", "entropy", "expected_entropy", "mi", "epistemic_ratio",
                 "cond_var", "flip_rate", "cvar_nll", "tokens", "passes"]
        return {k: out[k] for k in order}


def mc_metrics(log_probs, targets, n_bins=15, cvar_alpha=0.05):
    """The metrics of M passes over N tokens at once: log_probs (M, N, V) log-softmaxes, targets (N,)."""
    return MCStats(n_bins, cvar_alpha).add(log_probs, targets).result()



# ----------------------------------------------------------------------------------------------------------------
# population metrics: pass@k, majority vote, diversity


def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al. 2021) from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), as the
    numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_curve(correct, n, ks):
    """{k: pass@k averaged over prompts} from the number of correct samples of each prompt, n samples each."""
    return {k: float(np.mean([pass_at_k(n, int(c), k) for c in correct])) for k in ks}


def majority_answer(answers):
    """The most common answer, None ones (unparseable) left out as in self-consistency (Wang et al. 2022); a tie
    goes to the answer seen first. None when no answer parses."""
    counts = Counter(a for a in answers if a is not None)
    return counts.most_common(1)[0][0] if counts else None


def distinct_n(seqs, n):
    """Distinct n-grams over a group of sequences (Li et al. 2016): unique n-grams / all n-grams, pooled."""
    grams = [tuple(s[i:i + n]) for s in seqs for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def edit_distance(a, b):
    """Levenshtein distance (insertions, deletions, substitutions, each 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def pairwise_distance(seqs):
    """Mean over pairs of edit_distance(a, b) / max(len a, len b): 0 for identical, 1 for entirely different."""
    pairs = [(a, b) for i, a in enumerate(seqs) for b in seqs[i + 1:]]
    if not pairs:
        return 0.0
    return sum(edit_distance(a, b) / max(len(a), len(b), 1) for a, b in pairs) / len(pairs)


def cosine_distance(embeddings):
    """Mean over pairs of rows of 1 - cos(a, b) (B-Trans §5.1's semantic diversity of a group's embeddings, (K, d)):
    0 for identical directions, 1 for orthogonal, 2 for opposite."""
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    k = len(unit)
    if k < 2:
        return 0.0
    cos = unit @ unit.T  # (K, K)
    return float((k * k - cos.sum()) / (k * (k - 1)))  # the diagonal's K ones leave K(K-1) off-diagonal terms


# ----------------------------------------------------------------------------------------------------------------
# a model evaluated by them: evaluate.py's tasks (lm, mc, population), one function each

LATENTS = {"none": "none (deterministic)", "noise": "fresh noise per pass", "mind": "one mind per pass",
           "code": "every Z_t from the uniform prior per pass"}  # Model.latent_kind -> what a pass draws


def lm_windows(n_tokens, T, doc_len=None, max_tokens=0):
    """Start offsets of non-overlapping windows (T inputs, T targets): every T tokens of the stream, or the start
    of every fixed-length sequence (datasets with doc_len, like the synthetic task, as train.py batches them)."""
    if doc_len:
        starts = list(range(0, n_tokens - doc_len + 1, doc_len))
    else:
        starts = list(range(0, n_tokens - T, T))
    if max_tokens:
        starts = starts[:max(1, math.ceil(max_tokens / T))]
    return starts


@torch.no_grad()
def evaluate_lm(model, data, starts, T, n_passes, generator, *, batch_size=8, iw_samples=0, n_bins=15,
                cvar_alpha=0.05, autocast=nullcontext()):
    """Monte Carlo metrics of model on the windows data[s:s+T] -> data[s+1:s+T+1], the mean of its forward(x, y)
    stats, the sequence-level mixture's NLL, and for a model with an encoder (Free) the ELBO and the importance-weighted
    bound."""
    device = model.tok_emb.weight.device
    mc, stats, bounds, seq_nll, n_seqs = MCStats(n_bins, cvar_alpha), Counter(), Counter(), Counter(), 0
    for i in common.progress(range(0, len(starts), batch_size), desc="lm batches"):
        rows = [torch.from_numpy(data[s:s + T + 1].astype("int64")) for s in starts[i:i + batch_size]]
        xy = torch.stack(rows).to(device)
        x, y = xy[:, :-1], xy[:, 1:]  # (B, T) each
        B = x.size(0)
        with autocast:
            # The model's own diagnostics: forward(x, y) as in training (EVE band stats; Free: encoder, KL, ELBO).
            logits, _, batch_stats = model(x, y)  # (B, T, V)
        stats.update({k: float(v) * B for k, v in batch_stats.items()})

        seq_ll = []  # (B,) log prod_t p_m(y_t) of each pass: the sequence-level mixture

        def passes():
            for m in range(1 if model.latent_kind == "none" else n_passes):
                if model.latent_kind != "none":  # fresh latents per pass: EVE eps, B-Trans minds, Free prior Z
                    with autocast:
                        pass_logits = model(x, y, latents=model.sample_latents(B, generator))[0]  # (B, T, V)
                log_p = F.log_softmax((logits if model.latent_kind == "none" else pass_logits).float(), dim=-1)
                seq_ll.append(log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1).double().sum(1))  # (B,)
                yield log_p.flatten(0, 1)  # (B*T, V)
        mc.add(passes(), y.reshape(-1))
        seq_nll["sum"] -= (torch.logsumexp(torch.stack(seq_ll), 0) - math.log(len(seq_ll))).sum().item()
        if model.latent_kind == "code" and iw_samples:
            bounds["iw_bound"] += iw_bound(model, x, y, iw_samples, generator, autocast).sum().item()
        n_seqs += B
    out = {"latents": LATENTS[model.latent_kind], **mc.result()}
    # -1/T log mean_m prod_t p_m(y_t): the windows' likelihood under the population when a latent is frozen for a
    # whole window (a B-Trans mind, Eq. 3); nll above averages per token. Equal for a deterministic model.
    out["seq_nll"] = seq_nll["sum"] / (n_seqs * T)
    if model.latent_kind == "code":  # Free Transformer: the honest likelihood bounds beside the prior-Z metrics
        # -ELBO per token, nats: -log p(y|z) at one encoder sample z ~ q(Z|x) per sequence + the exact KL(q || uniform)
        out["neg_elbo"] = stats.pop("elbo") / n_seqs
        stats["ce_posterior"] = stats.pop("ce")  # CE given the encoder's Z, which reads the tokens: not a likelihood
        if iw_samples:
            out["iw_bound"] = bounds["iw_bound"] / (n_seqs * T)
            out["iw_samples"] = iw_samples
    out.update({f"stats/{k}": v / n_seqs for k, v in stats.items()})
    return out


@torch.no_grad()
def iw_bound(model, x, y, K, generator, autocast=nullcontext()):
    """Importance-weighted bound (Burda et al. 2016) with the encoder as proposal, per sequence:
    -log (1/K) sum_k p(y|z_k) p(z_k) / q(z_k|x), z_k ~ q(Z|x), p(z) uniform (-H log 2 per token). Z_t acts on every
    later token, so the weights are per sequence, not per token. Returns (B,) nats per sequence."""
    log_w = []
    for _ in range(K):
        with autocast:
            codes, log_q = model.posterior(x, generator)  # (B, T) each
            logits = model(x, y, latents=codes)[0]  # (B, T, V)
        log_py = F.log_softmax(logits.float(), dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (B, T)
        log_w.append(log_py.sum(1) + model.log_prior(codes).sum(1) - log_q.float().sum(1))  # (B,)
    return -(torch.logsumexp(torch.stack(log_w), dim=0) - math.log(K))  # (B,)


def evaluate_mc(model, examples, encode, decode, n_passes, seed, *, autocast=nullcontext(), mixture="token", eot=None,
                items=None):
    """acc: argmax of the summed log-likelihood; acc_char: of the sum / the characters scored (the whole choice, or
    the tail that fits the context window; the harness' acc_norm); acc_completion: of the mean per token (the Free
    Transformer paper's Appendix D definition). Stochastic models score with the `mixture` of n_passes passes
    (multiple_choice.score_choices), example i with the latents of multiple_choice.example_generator(seed, i). items:
    a list that receives one dict per example: the per-choice log-likelihoods (of a stochastic model under both
    mixtures, on the same draws), the prediction of each metric, truncation."""
    hits, truncated = Counter(), 0
    mixtures = ("token", "sequence") if n_passes > 1 and items is not None else ()
    for i, ex in enumerate(common.progress(examples, desc="mc examples")):
        pairs = [multiple_choice.choice_tokens(encode, ex["context"], choice, eot) for choice in ex["choices"]]
        draws = lambda: multiple_choice.example_generator(model, seed, i)  # the same latents for every mixture
        ll, n_tokens, cut = multiple_choice.score_choices(model, pairs, n_passes, draws(), autocast, mixture)
        truncated += cut
        chars = [len(c) if n == len(cont) else len(decode(cont[len(cont) - n:]))
                 for c, n, (_, cont) in zip(ex["choices"], n_tokens, pairs)]
        scores = {"acc": ll, "acc_char": [s / max(n, 1) for s, n in zip(ll, chars)],
                  "acc_completion": [s / max(n, 1) for s, n in zip(ll, n_tokens)]}
        pred = {name: max(range(len(values)), key=values.__getitem__) for name, values in scores.items()}
        for name, k in pred.items():
            hits[name] += k == ex["label"]
        if items is not None:
            score = lambda m: multiple_choice.score_choices(model, pairs, n_passes, draws(), autocast, m)[0]
            lls = {m: ll if m == mixture else score(m) for m in mixtures} or {"none": ll}
            items.append({"index": i, "label": ex["label"], "loglikelihoods": lls, "tokens": n_tokens,
                          "chars": chars, "pred": pred, "truncated": cut})
    return {"latents": LATENTS[model.latent_kind],
            **{k: hits[k] / len(examples) for k in ("acc", "acc_char", "acc_completion")},
            "mixture": mixture if n_passes > 1 else "none", "examples": len(examples), "passes": n_passes,
            "truncated": truncated}


@torch.no_grad()
def evaluate_population(model, prompts, encode, decode, K, generator, *, max_new_tokens=64, temperature=1.0,
                        top_k=0, n=4):
    """K minds per prompt (latents from sample_latents, one generation each) on the letters task: mean pass@1 and
    pass@K, majority-vote accuracy over the K answers, distinct-n of the group and mean pairwise edit distance."""
    device = model.tok_emb.weight.device
    totals = Counter()
    for prompt in common.progress(prompts, desc="population prompts"):
        idx = torch.tensor([encode(prompt)] * K, dtype=torch.long, device=device)
        # K independent draws consistent with the prompt: the Free Transformer's prompt Z from its encoder (§3.2)
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k or None,
                           latents=model.sample_latents(K, generator, prompt=idx), generator=generator)
        texts = [decode(row[idx.size(1):]) for row in out.tolist()]
        answers = [tasks.letters_answer(t) for t in texts]
        c = sum(a == prompt[0] for a in answers)
        totals["pass@1"] += pass_at_k(K, c, 1)
        totals[f"pass@{K}"] += pass_at_k(K, c, K)
        totals["majority_acc"] += majority_answer(answers) == prompt[0]
        totals[f"distinct_{n}"] += distinct_n(texts, n)
        totals["pairwise_edit"] += pairwise_distance(texts)
    return {"latents": LATENTS[model.latent_kind],
            **{k: v / len(prompts) for k, v in totals.items()}, "prompts": len(prompts), "minds": K}
