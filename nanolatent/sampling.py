"""Sampling with pinned latents and scoring one text token by token: what sample.py, evaluate.py --task=tokens and
the explorer's page (scripts/explore.py) compute, one function each, so the page shows exactly the scripts' texts and
numbers."""

import contextlib
import math

import torch
import torch.nn.functional as F

from nanolatent import common, cpu, models

LATENTS = ("independent", "shared", "posterior")


def check_length(ids, block_size, what="the prompt", hint=""):
    if len(ids) > block_size:
        common.die(f"{what} has {len(ids)} tokens, more than the context (block_size={block_size}){hint}")


def pin_latents(model, prompt, how, generator, prompt_latents="encoder", reference=None):
    """The latents of num_samples = prompt.size(0) sequences: 'independent' a draw each, 'shared' one draw for all
    (one prompt-Z draw and one sequence of per-token codes for the Free Transformer), 'posterior' the codes the
    Free Transformer's encoder infers from `reference` (1, T) token ids. Free: the prompt's Z from the encoder on the
    prompt (§3.2), or with prompt_latents='prior' from the uniform prior as well. None: the model has none."""
    n = prompt.size(0)
    consistent_with = prompt[:1] if prompt_latents == "encoder" else None
    if how == "independent":
        return model.sample_latents(n, generator, prompt=consistent_with)
    if how == "shared":
        return models.repeat_latents(model.sample_latents(1, generator, prompt=consistent_with), n)
    if model.latent_kind != "code":
        common.die(f"--latents=posterior needs a model with an encoder (free); this one's latents are "
                   f"{model.latent_kind!r}")
    return models.repeat_latents(model.posterior_latents(reference, generator), n)


@torch.no_grad()
def sample(model, ids, num_samples, max_new_tokens, *, seed, latent_seed=-1, latents="independent",
           prompt_latents="encoder", reference=None, temperature=0.8, top_k=0, dtype="float32", onednn=True,
           compile=False, on_token=None):
    """num_samples continuations of the prompt `ids` (token ids): (tokens (num_samples, T + max_new_tokens), the
    pinned latents or None). The tokens are drawn from a generator seeded by `seed`, the latents from one seeded by
    latent_seed (-1: seed), so either can be held while the other varies. reference: token ids for 'posterior'.
    on_token(tokens (num_samples, 1)) sees each new token but the last as it is fed back (the explorer streams them);
    it changes no draw, and an exception it raises ends the generation."""
    device = model.tok_emb.weight.device
    torch.manual_seed(seed)
    token_generator = torch.Generator(device).manual_seed(seed)
    latent_generator = torch.Generator(device).manual_seed(seed if latent_seed < 0 else latent_seed)
    check_length(ids, model.config.block_size)
    prompt = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (num_samples, T)
    if latents == "posterior":
        check_length(reference, model.config.block_size, "the --reference", ": the encoder reads it whole; shorten it")
        reference = torch.tensor([reference], dtype=torch.long, device=device)  # (1, T_ref)
    pinned = pin_latents(model, prompt, latents, latent_generator, prompt_latents, reference)
    # The decode step compiled once for every position: the position is an int that changes at each step (dynamic).
    step = (common.first_call(torch.compile(model.forward, dynamic=True), "compiling the decode step") if compile
            else None)
    if on_token is not None:
        decode_step = step or model

        def step(idx_next, **kwargs):
            on_token(idx_next)
            return decode_step(idx_next, **kwargs)
    products = contextlib.nullcontext() if compile or not onednn else \
        cpu.inference_linears(model, common.DTYPES[dtype], batch_size=num_samples)
    try:
        with products:
            out = model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k or None, latents=pinned,
                               generator=token_generator, step=step)
    except ValueError as e:
        common.die(str(e))
    return out, pinned


def code_bits(codes, n_bits):
    """Free Transformer codes as strings of their H bits, most significant first: [int] -> ['01101001', ...]."""
    return [format(int(c), f"0{n_bits}b") for c in codes]


def entropy(p):
    """H(p) in nats over the last axis; xlogy makes 0 log 0 = 0. (..., V) -> (...)"""
    return -torch.special.xlogy(p, p).sum(-1)


@torch.no_grad()
def token_uncertainty(model, ids, n_passes, generator, autocast=contextlib.nullcontext(), onednn=True,
                      dtype="float32"):
    """Each predicted token of one text (ids[1:] given what precedes it), over M = n_passes passes with fresh
    latents (det: one pass): nll -log p̄(y), entropy H(p̄), expected_entropy mean_m H(p_m) (aleatoric) and mi
    H(p̄) - mean_m H(p_m) (epistemic), in nats, as lists of floats; evaluate.py's definitions, token by token. As in
    evaluate.MCStats, the passes enter as differences to the first, so a deterministic model's mi is exactly 0."""
    device = model.tok_emb.weight.device
    check_length(ids[:-1], model.config.block_size, "the text", " (its last token is only predicted); shorten it")
    if len(ids) < 2:
        common.die("the text has fewer than 2 tokens: nothing to predict (the first token is the context)")
    x = torch.tensor([ids[:-1]], dtype=torch.long, device=device)  # (1, T)
    y = torch.tensor(ids[1:], dtype=torch.long, device=device)  # (T,)
    products = cpu.inference_linears(model, common.DTYPES[dtype]) if onednn else contextlib.nullcontext()
    with products:
        M = 1 if model.latent_kind == "none" else n_passes
        for m in range(M):
            with autocast:
                latents = None if model.latent_kind == "none" else model.sample_latents(1, generator)
                logits = model(x, y[None], latents=latents)[0][0]  # (T, V): targets ask for every position
            log_p = F.log_softmax(logits.float(), dim=-1)  # (T, V)
            p, log_py = log_p.exp(), log_p.gather(1, y[:, None]).squeeze(1)
            if m == 0:
                p_first, h_first, lse_y = p, entropy(p), log_py
                sum_dp, sum_dh = torch.zeros_like(p), torch.zeros_like(h_first)
            else:
                sum_dp += p - p_first
                sum_dh += entropy(p) - h_first
                lse_y = torch.logaddexp(lse_y, log_py)
    h_bar = entropy(p_first + sum_dp / M)  # (T,)
    mean_h = h_first + sum_dh / M  # (T,)
    return {"nll": (-(lse_y - math.log(M))).tolist(), "entropy": h_bar.tolist(), "expected_entropy": mean_h.tolist(),
            "mi": (h_bar - mean_h).tolist(), "passes": M}
