"""GRPO with B-Trans minds (Yang & Zhang, "Many Minds from One Model", §5): rollouts of a population of minds, group
advantages, the clipped policy-gradient objective (Shao et al. 2024, DeepSeekMath Eq. 3) and its update, and the
majority-vote reward of label-free test-time RL (§5.3). scripts/rlvr.py runs them; the studies reuse the rollouts."""

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nanolatent import metrics

@contextmanager
def noise_mode(model, mode):
    """Switch the B-Trans offsets for a while: 'mean' (mu only) to update and evaluate (§5)."""
    saved, model.config.noise_mode = model.config.noise_mode, mode
    try:
        yield
    finally:
        model.config.noise_mode = saved


@torch.no_grad()
def rollouts(model, prompt_ids, G, max_new_tokens, temperature, generator, latent_generator):
    """G completions of each prompt, as the model's noise_mode samples them: (P * G, max_new_tokens) token ids,
    prompt-major, and the latents of each row ((P * G, n_norms, C) in 'sequence' mode, else None).

    In 'sequence' mode row r is mind latents[r], drawn once before its first token and frozen through the prefill
    and every cached decode step (§4.3). Latents come from their own generator, so the token draws are those of the
    det model at the same seed (at sigma = 0 the rollouts are the det model's, tested). Prompts of equal length share
    one generate() call; the model has no padding mask, so prompts of other lengths go in other calls."""
    P, device = len(prompt_ids), model.tok_emb.weight.device
    completions, latents = torch.empty(P, G, max_new_tokens, dtype=torch.long, device=device), None
    for T in sorted({len(ids) for ids in prompt_ids}):
        rows = [i for i, ids in enumerate(prompt_ids) if len(ids) == T]
        idx = torch.tensor([prompt_ids[i] for i in rows], device=device).repeat_interleave(G, dim=0)  # (n*G, T)
        pinned = model.sample_latents(idx.size(0), latent_generator)  # None for det, 'token' and 'mean'
        out = model.generate(idx, max_new_tokens, temperature=temperature, latents=pinned, generator=generator)
        completions[rows] = out[:, T:].view(len(rows), G, max_new_tokens)
        if pinned is not None:
            if latents is None:
                latents = pinned.new_empty(P, G, *pinned.shape[1:])
            latents[rows] = pinned.view(len(rows), G, *pinned.shape[1:])
    return completions.flatten(0, 1), None if latents is None else latents.flatten(0, 1)


def completion_mask(completions, stop_id):
    """(N, L) bool: the tokens up to and including the first stop token ('\\n'); all of them when there is none.
    What follows the stop (the model's next problem) is neither scored nor trained on."""
    is_stop = (completions == stop_id).long()
    return (is_stop.cumsum(1) - is_stop) == 0  # no stop strictly before this position


def completion_logprobs(model, prompt_ids, completions):
    """log pi(token | prefix) of every completion token under model as it is (its noise_mode), (N, L), in one forward.
    Rows are right-padded to the longest prompt: the model is causal, so padding changes nothing before it."""
    N, L = completions.shape
    lens = torch.tensor([len(ids) for ids in prompt_ids], device=completions.device)
    seqs = torch.zeros(N, int(lens.max()) + L, dtype=torch.long, device=completions.device)
    for i, ids in enumerate(prompt_ids):
        seqs[i, :len(ids)] = torch.tensor(ids)
        seqs[i, len(ids):len(ids) + L] = completions[i]
    logits, _, _ = model(seqs[:, :-1], targets=seqs[:, 1:])  # (N, T, V): targets ask for every position
    pos = (lens - 1)[:, None] + torch.arange(L, device=lens.device)  # (N, L) positions predicting the completion
    logits = logits.gather(1, pos[..., None].expand(-1, -1, logits.size(-1)))  # (N, L, V)
    return F.log_softmax(logits.float(), dim=-1).gather(-1, completions[..., None]).squeeze(-1)  # (N, L)


def replies(completions, decode, stop_id):
    """Each completion decoded up to and including its first stop token (completion_mask): the reply that is scored."""
    lengths = completion_mask(completions, stop_id).sum(1).tolist()
    return [decode(row[:n]) for row, n in zip(completions.tolist(), lengths)]


def group_advantages(rewards, eps=1e-4):
    """(P, G) rewards -> (P, G) advantages (r - mean) / (std + eps) within each group, std with Bessel's correction
    (torch.std, as TRL's GRPOTrainer). A group whose rewards are all equal gets advantage 0: no signal."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)


def grpo_loss(logp, old_logp, ref_logp, mask, advantages, clip_eps=0.2, kl_coef=0.0):
    """GRPO's objective (Shao et al. 2024, Eq. 3), negated: per token -min(rho A, clip(rho, 1 - eps, 1 + eps) A)
    + beta KL, rho = pi / pi_old, averaged over each completion's tokens, then over completions. The KL to the
    reference is the k3 estimator pi_ref / pi - log(pi_ref / pi) - 1 (Schulman 2020): >= 0 at every token.
    logp, old_logp, ref_logp, mask: (N, L); advantages: (N,). Returns (loss, stats)."""
    A = advantages[:, None]  # (N, 1): one advantage for every token of a completion
    ratio = (logp - old_logp).exp()
    policy = -torch.min(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)  # (N, L)
    log_r = ref_logp - logp
    kl = log_r.exp() - log_r - 1  # (N, L)
    m = mask.float()
    per_seq = lambda x: (x * m).sum(1) / m.sum(1).clamp_min(1)  # (N,) mean over each completion's tokens
    loss = (per_seq(policy) + kl_coef * per_seq(kl)).mean()
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return loss, {"kl": per_seq(kl).mean().item(), "clip_frac": per_seq(clipped).mean().item()}


def grpo_update(model, ref, optimizer, prompt_ids, completions, mask, advantages, updates=1, clip_eps=0.2,
                kl_coef=0.0, grad_clip=1.0, chunk=0):
    """updates optimizer steps on one batch of rollouts; the stats of the last. With chunk > 0, each step's forward
    and backward take `chunk` rollouts at a time and their gradients add up to the whole batch's (grpo_loss is a mean
    over completions: a chunk of n of N weighs n / N), for the memory of a chunk.

    §5: "we inject stochasticity only during rollout ... keeping the update phase deterministic by using the mean
    shift only". The log-probabilities here are those of the mean model (offset mu, no eps), but the rollouts were
    sampled from perturbed models (minds, or token-wise noise). So rho = pi_mean / pi_mean_old is not the true
    importance weight of the behaviour policy: that one would be the minds' marginal, an integral over eps with no
    closed form (or each mind's own probability, which would train every mind instead of the mean). The objective
    treats the rollouts as if the mean model had sampled them. The paper accepts this bias, we do too: the update
    stays deterministic and on-policy for the mean model, with the minds acting as a proposal that explores. With
    updates = 1, old_logp is this very forward, detached: rho = 1 exactly, the clip never acts, and the gradient is
    the plain policy gradient mean A grad log pi_mean (the clip matters only for updates > 1)."""
    N = len(prompt_ids)
    parts = [slice(i, i + (chunk or N)) for i in range(0, N, chunk or N)]
    with noise_mode(model, "mean"):
        with torch.no_grad():
            ref_logp = [completion_logprobs(ref, prompt_ids[p], completions[p]) for p in parts]
        old_logp = [None] * len(parts)
        for u in range(updates):
            optimizer.zero_grad(set_to_none=True)
            totals = {}  # the stats of the whole batch: each chunk's weighed by its share
            for j, p in enumerate(parts):
                logp = completion_logprobs(model, prompt_ids[p], completions[p])
                if u == 0:
                    old_logp[j] = logp.detach()
                loss, stats = grpo_loss(logp, old_logp[j], ref_logp[j], mask[p], advantages[p], clip_eps, kl_coef)
                weight = len(prompt_ids[p]) / N
                (loss * weight).backward()
                for key, value in {"loss": loss.item(), **stats}.items():
                    totals[key] = totals.get(key, 0.0) + value * weight
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
    return totals


def ttrl_rewards(answers):
    """§5.3: 1 for a rollout whose answer is its group's majority answer, else 0; no label is read.
    metrics.majority_answer's rules: None (unparseable) answers never vote and never win; a tie goes to the answer
    seen first in the group; a group with no parseable answer gets 0 everywhere."""
    majority = metrics.majority_answer(answers)
    return [float(a is not None and a == majority) for a in answers]
