"""EVE variational Transformer ("variational neurons", paper: eve_variational_neurons.txt): the det decoder whose
feed-forward computation is a bank of local variational neurons (§3.2, §3.4).

Per block and token, neuron i infers a posterior q(z_i | u, h_i) = N(mu_q, sigma_q^2) from u = RMSNorm(x) and its
memory h_i, samples z_i = mu_q + sigma_q * eps (§3.2), decodes an activation y_i = g(z_i) and the bank is projected
back to model width. The memory is the mean of a local autoregressive prior p(z_i | h_i) = N(mu_p, sigma_p^2),
h = mu_p(t) = f_AR(mu_p(t-1), z(t-1)) (§3.3), linear, so the posterior reading it keeps training parallel (one scan).
A KL term, a latent-energy band penalty and a homeostat (§3.3) join the cross-entropy in one objective (§3.6).

The paper numbers no equations; comments cite its sections and the symbols it uses. Where it leaves a detail open
(decoder g, form of f_AR, L_AR, control penalty, head layer weights: see its README) the choice is marked "choice:".
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# Building blocks. model_eve.py, model_free.py and model_btrans.py repeat these verbatim, in this order, so the
# files diff cleanly side by side: only what each paper changes shows up in `diff model_det.py model_<x>.py`.
# EVE changes the feed-forward (VariationalMLP, kept under the name `mlp`), the loss and the head, which reads the
# blocks through layer weights (§4.2). variational=False keeps that head with det's SwiGLU: EVE's deterministic twin,
# since §4.1 keeps the head the same in both arms of the comparison.


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain and no bias (Zhang & Sennrich 2019)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def precompute_rope(head_dim, max_len, theta, scaling=None):
    """Rotary position embeddings (Su et al. 2021): channels j and j + hd/2 of a head turn by pos * theta^(-2j/hd);
    tables of cos and signed sin, (max_len, hd), so apply_rope needs no split. scaling = (factor, low_freq_factor,
    high_freq_factor, original context): Llama 3.1's remap ("llama3"), wavelengths over original / low stretched by
    factor, under original / high kept, linear in original / wavelength between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (hd/2,)
    if scaling is not None:
        factor, low, high, original = scaling
        blend = (original * inv_freq / (2 * math.pi) - low) / (high - low)  # < 0: stretched, > 1: kept
        inv_freq = torch.lerp(inv_freq / factor, inv_freq, blend.clamp(0, 1))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (max_len, hd/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (max_len, hd) each


def apply_rope(x, cos, sin):
    """x (B, nh, T, hd) rotated by cos, sin (T, hd) of precompute_rope: (x with its halves swapped) * sin + x * cos,
    in float32 as the tables are. The swap is a roll by hd/2: one new tensor, two passes in place, no chunk and cat."""
    return x.roll(x.size(-1) // 2, dims=-1).float().mul_(sin).addcmul_(x, cos).type_as(x)


class KVCache(nn.Module):
    """Preallocated keys/values of one layer, indexed by position (gpt-fast), so a decode step has static shapes."""

    def __init__(self, batch_size, n_kv_head, max_len, head_dim, device, dtype):
        super().__init__()
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, start_pos, k, v):
        """Store k, v (B, n_kv, T, hd) at positions start_pos, ..., start_pos + T - 1. -> keys and values (B, n_kv, S,
        hd) of the S = start_pos + T positions filled so far, and the (T, S) causal mask (None for one query)."""
        end = start_pos + k.size(2)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        pos = torch.arange(start_pos, end, device=k.device)  # (T,)
        mask = None if k.size(2) == 1 else torch.arange(end, device=k.device) <= pos.unsqueeze(1)  # (T, S)
        return self.k[:, :, :end], self.v[:, :, :end], mask

    def repeat(self, n):
        """Every cached sequence n times over, rows b n, ..., b n + n - 1 continuing sequence b."""
        self.k, self.v = self.k.repeat_interleave(n, dim=0), self.v.repeat_interleave(n, dim=0)


class PriorCache(nn.Module):
    """The AR prior's state of one layer in generation (§3.3): the prior mean of the next position, mu_p(t + 1)."""

    def __init__(self, batch_size, n_latent, device, dtype):
        super().__init__()
        self.register_buffer("mean", torch.zeros(batch_size, n_latent, device=device, dtype=dtype), persistent=False)


class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): n_head query heads share n_kv_head key/value heads."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.wq = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        # Qwen3: an RMSNorm over each head's queries and over its keys (one gain of hd, shared by the heads)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else nn.Identity()
        self.kv_cache = None  # a KVCache while generate() runs

    def forward(self, x, cos, sin, start_pos):
        B, T, _ = x.shape
        # One matmul per weight, kept apart as Llama checkpoints keep them
        q = self.q_norm(self.wq(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(self.wk(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # after the norms, as Qwen3 applies them
        if self.kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        else:
            k, v, mask = self.kv_cache.update(start_pos, k, v)  # (B, n_kv, S, hd) each, (T, S) or None
            # A kv head's rep query heads as rep * T rows: the cache read as is (enable_gqa would copy it rep times)
            rep = self.n_head // self.n_kv_head
            q = q.reshape(B, self.n_kv_head, rep * T, self.head_dim)  # (B, n_kv, rep T, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.repeat(rep, 1))
            y = y.view(B, self.n_head, T, self.head_dim)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def gaussian_kl(logvar_q, var_q, sq_dist, logvar_p):
    """KL(N(mu_q, var_q) || N(mu_p, e^logvar_p)) per coordinate in nats (§3.3's KL, closed form), sq_dist = (mu_q -
    mu_p)^2. Linear in logvar_q, var_q and sq_dist: their token means give the mean KL (logvar_p is static)."""
    return 0.5 * (logvar_p - logvar_q + (var_q + sq_dist) * torch.exp(-logvar_p) - 1.0)


def scan(x, a, k=8):
    """h[t] = a h[t-1] + x[t] along dim 1 of x (B, T, D), a (D,), in chunks of k positions (as linear-attention
    codebases do): k - 1 steps in all chunks at once, the T/k chunk ends by doubling with a^k, then a^i times the end of
    the chunk before at position i of a chunk. k + log2(T/k) ops, out of place: torch.compile fuses each stage."""
    B, T, D = x.shape
    x = torch.cat([x, x.new_zeros(B, -T % k, D)], dim=1).view(B, -1, k, D)  # (B, n, k, D), 0 after T
    powers = a ** torch.arange(1, k + 1, device=a.device, dtype=a.dtype).unsqueeze(1)  # (k, D): a^1 ... a^k
    h = list(x.unbind(2))  # k of (B, n, D)
    for i in range(1, k):  # within every chunk at once
        h[i] = torch.addcmul(h[i], h[i - 1], a)
    ends, s, a_s = h[-1], 1, powers[-1]  # (B, n, D): the chunks' last
    while s < ends.size(1):  # the ends' own recurrence with a^k, by doubling (Hillis & Steele 1986): log2(n) steps
        ends = torch.cat([ends[:, :s], torch.addcmul(ends[:, s:], ends[:, :-s], a_s)], dim=1)
        s, a_s = 2 * s, a_s * a_s
    carried = torch.cat([ends.new_zeros(B, 1, D), ends[:, :-1]], dim=1)  # (B, n, D): the end of the chunk before
    h = torch.addcmul(torch.stack(h, dim=2), carried.unsqueeze(2), powers)  # position i: + a^(i+1) carried
    return h.view(B, -1, D)[:, :T]


class VariationalMLP(nn.Module):
    """§3.2/§3.4: a bank of n_neurons local variational neurons in place of the SwiGLU feed-forward. Like SwiGLU it
    holds three matrices of n_embd x (n_neurons * latent_dim): w_mu, w_logvar (the posterior) and w2 (back to C)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        N, dz = config.n_neurons, config.latent_dim
        D = N * dz  # latent coordinates of the layer, neuron-major: coordinate n * dz + j is dim j of neuron n
        # §3.2/§3.4 posterior q(z_i | u, h_i) = N(mu_q,i, diag(sigma_q,i^2)), of these arguments only. Choice: linear
        # heads on u, with posterior_memory mu_q,i = w_mu,i . u + c_i h_i (below); sigma_q reads u only: z affine in h.
        self.w_mu = nn.Linear(config.n_embd, D, bias=False)
        self.w_logvar = nn.Linear(config.n_embd, D, bias=True)  # bias: sigma_q starts at config.sigma_init
        # §3.2 decoder y = g_theta(z). Choice: per neuron y_i = silu(d_i . z_i + c_i), a gain vector d_i (dz,) and a
        # bias c_i; elementwise, so the decoder adds no matmul. With dz = 1 it starts as y_i = silu(z_i).
        self.dec_gain = nn.Parameter(torch.full((N, dz), 1.0 / math.sqrt(dz)))
        self.dec_bias = nn.Parameter(torch.zeros(N))
        self.w2 = nn.Linear(N, config.n_embd, bias=False)  # "projected back to the model space" (§3.4)
        if config.ar_prior:
            # §3.3 local AR prior, mu_p(t) = f_AR(mu_p(t-1), z(t-1)). Choice: mu_p(t) = a mu_p(t-1) + b z(t-1) per
            # coordinate, mu_p(0) = m0, the memory h = mu_p (§3.2), a static learned scale (§3.3 gives no update).
            # With the posterior reading h, z(t) = e(t) + c h(t), e = w_mu u + sigma_q eps the innovation, so
            # h(t) = (a + b c) h(t-1) + b e(t-1): the loop's pole is a + b c. Choice: tanh(ar_a) in (-1, 1) is that
            # pole, alpha, and a = alpha - b c, so the recurrence stays stable whatever b and c learn (c = 0: a = alpha)
            self.ar_a = nn.Parameter(torch.full((D,), math.atanh(config.ar_a_init)))  # alpha = tanh(ar_a)
            self.ar_b = nn.Parameter(torch.full((D,), config.ar_b_init))
            self.prior_m0 = nn.Parameter(torch.zeros(D))
            self.prior_logvar = nn.Parameter(torch.zeros(D))  # sigma_p = 1 at init
        # §3.2 q(z | x, h). Choice: mu_q = w_mu u + c h, c = tanh(mem_gain) per coordinate; |c| < 1 keeps the L_AR and
        # KL fixed point h = mu_q finite (h = w_mu u / (1 - c)), and b sets h's scale. h = 0 at init (b = m0 = 0): the
        # model starts as the x-only posterior; c != 0 lets the task gradient reach b and m0 from the first step.
        memory = config.ar_prior and config.posterior_memory
        self.mem_gain = nn.Parameter(torch.full((D,), math.atanh(config.mem_gain_init))) if memory else None
        self.register_buffer("mu2_ema", torch.full((N,), config.mu2_target))  # §3.3 control: each neuron's mu^2 EMA
        self.register_buffer("beta_unit", torch.full((N,), config.kl_beta))  # its KL weight (the beta controller)
        # (2, N) detached [KL_u, mu2_u], the mean over the training forwards since the last update_controllers (a
        # step's micro-batches; under activation checkpointing each one twice, which leaves the mean as it is), and
        # how many forwards that mean holds: a step measures its whole batch, on one process as on several
        self.stash = self.stash_forwards = None
        self.prior_cache = None  # a PriorCache while generate() runs

    def forward(self, u, eps, start_pos=0, with_aux=False):
        """u = RMSNorm(x) (B, T, C), eps (B, T, D) -> (update (B, T, C), aux: KL_u, mu2_u (N,), L_AR, sigma or None)"""
        cfg, cache, N, dz = self.config, self.prior_cache, self.config.n_neurons, self.config.latent_dim
        # the memory h = mu_p: scanned over the positions; at one position the cached state (B, 1, D), a copy
        mu_p = cache.mean.unsqueeze(1).clone() if cache is not None and u.size(1) == 1 else None
        if mu_p is None and cfg.ar_prior and start_pos > 0:
            raise ValueError("the AR prior needs the state of earlier positions: decode with the KV cache")
        y, means, following = self.bank(self.w_mu(u), self.w_logvar(u), eps, mu_p)  # (B, T, N), (D,) each
        if cache is not None:
            cache.mean.copy_(following.detach())
        out = self.w2(y)  # (B, T, C)
        if not with_aux:
            return out, None
        # The objective needs only means over the tokens (B, T); the KL is linear in them: closed forms on (D,) vectors
        logvar_p = self.prior_logvar.clamp(cfg.logvar_min, cfg.logvar_max) if cfg.ar_prior else y.new_zeros(())
        kl = gaussian_kl(means["logvar_q"], means["var_q"], means["sq_dist"], logvar_p)  # (D,) §3.3 KL; fixed: N(0, I)
        aux = {"kl_u": kl.view(N, dz).sum(-1),  # (N,) KL of each neuron, summed over its dims, mean over tokens
               "mu2_u": means["mu2"].view(N, dz).mean(-1),  # (N,) §3.3 latent energy mu^2 = mean_j mu_q,j^2 over tokens
               "ar": means["ar"].mean() if cfg.ar_prior else y.new_zeros(()), "sigma": means["sigma_q"].detach().mean()}
        if self.training:  # for update_controllers: the per-unit measurements, averaged over the step's forwards
            measured = torch.stack([aux["kl_u"], aux["mu2_u"]]).detach()  # (2, N)
            if self.stash is None:
                self.stash, self.stash_forwards = measured, measured.new_ones(())  # a tensor count: one graph
            else:
                self.stash_forwards = self.stash_forwards + 1
                self.stash = self.stash + (measured - self.stash) / self.stash_forwards  # the running mean
        return out, aux

    def bank(self, m, r, eps, mu_p=None):
        """The neurons between the products, element-wise (§3.2, §3.3): from m = w_mu u, r = w_logvar u and eps (B, T,
        D), and at a decode step the cached memory mu_p (B, 1, D), to the decoder's output y (B, T, N), the token means
        the objective reads ((D,) each, by name) and the memory of the next position (B, D; None without the AR prior).
        nanolatent/eve_bank.py computes the same with its backward written out (tests/test_eve_bank.py)."""
        cfg, (B, T, D), N = self.config, m.shape, self.config.n_neurons
        logvar_q = r.clamp(cfg.logvar_min, cfg.logvar_max)  # clipped log sigma_q^2
        sigma_q = torch.exp(0.5 * logvar_q)
        e = m + sigma_q * eps  # §3.2 z = mu + sigma_q eps, of mu's part read from u alone: the innovation
        following = None
        if cfg.ar_prior:
            mu_p, following = self.prior_mean(e, mu_p)  # (B, T, D), (B, D)
        # §3.2 q(z | x, h): mu_q = w_mu u + c h with the memory h = mu_p, and z = mu_q + sigma_q eps = e + c h
        c = torch.tanh(self.mem_gain) if self.mem_gain is not None else None  # (D,)
        mu_q, z = (m, e) if c is None else (m + c * mu_p, e + c * mu_p)
        y = F.silu((z * self.dec_gain.view(D)).view(B, T, N, -1).sum(-1) + self.dec_bias)  # §3.2 y = g(z), (B, T, N)
        means = {"logvar_q": logvar_q.mean((0, 1)), "var_q": sigma_q.pow(2).mean((0, 1)),
                 "mu2": mu_q.pow(2).mean((0, 1)), "sigma_q": sigma_q.mean((0, 1)),
                 "sq_dist": (mu_q if mu_p is None else mu_q - mu_p).pow(2).mean((0, 1))}  # the KL's (mu_q - mu_p)^2
        if cfg.ar_prior:
            # L_AR (§3.6, "present when the autoregressive prior is active"). Choice: the prior's squared one-step
            # error at the posterior mean, (mu_p(t) - sg[mu_q(t)])^2: the stop-gradient keeps it from pulling the
            # posterior (the KL does, weighted by beta); it trains f_AR, asking past latents to predict the next (§3.3)
            means["ar"] = (mu_p - mu_q.detach()).pow(2).mean((0, 1))
        return y, means, following

    def prior_mean(self, e, mu_p=None):
        """§3.3 the AR prior's mean, the memory h = mu_p(t) = alpha mu_p(t-1) + b e(t-1), mu_p(0) = m0 (alpha the loop's
        pole: see __init__), from the innovations e (B, T, D); at a decode step mu_p (B, 1, D) is the cached state.
        -> mu_p (B, T, D), which sees e(< t) only, and the next position's (B, D)."""
        alpha, b = torch.tanh(self.ar_a), self.ar_b  # (D,) each
        if mu_p is None:  # every position at once: the linear recurrence as a scan
            mu_p = scan(torch.cat([self.prior_m0.expand(len(e), 1, -1), b * e[:, :-1]], dim=1), alpha)
        return mu_p, alpha * mu_p[:, -1] + b * e[:, -1]


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)) with variational neurons (§3.4), or det's
    SwiGLU in EVE's deterministic twin (config.variational False)."""

    def __init__(self, config):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = VariationalMLP(config) if config.variational else MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, start_pos, eps, with_aux):
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin, start_pos))
        if eps is None:  # the deterministic twin
            return x + self.dropout(self.mlp(self.mlp_norm(x))), None
        update, aux = self.mlp(self.mlp_norm(x), eps, start_pos, with_aux)  # §3.4: u = RMSNorm(x), bank, project
        return x + self.dropout(update), aux


def sample_next_token(logits, temperature, top_k, generator):
    """One token per row from (B, V) logits; temperature 0 means greedy decoding."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)


# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    block_size: int = 256  # context length: RoPE tables and the KV cache are sized for it
    vocab_size: int = 65  # set from the dataset's meta.json by train.py
    n_layer: int = 4  # a tiny default that trains on a 2-core CPU in minutes
    n_head: int = 4  # query heads
    n_kv_head: int = 2  # key/value heads; n_head % n_kv_head == 0 (GQA halves the KV cache here)
    n_embd: int = 128  # model width
    head_dim: int = None  # query/key/value width of a head; None = n_embd / n_head (Qwen3-0.6B: 128, not 1024 / 16)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE (Qwen3's q_norm and k_norm)
    ffn_hidden: int = None  # SwiGLU width; None = 8/3 * n_embd rounded up to ffn_multiple_of (Llama)
    ffn_multiple_of: int = 32  # keeps the SwiGLU matmuls on hardware-friendly sizes
    rope_theta: float = 10000.0  # RoPE base frequency (Llama-2 value)
    rope_scaling: tuple = None  # Llama 3.1's long-context RoPE (precompute_rope): (8, 1, 4, 8192) in Llama-3.1-8B
    norm_eps: float = 1e-5  # RMSNorm epsilon
    dropout: float = 0.0  # on each residual branch's output while training (nanoGPT's resid_dropout); 0: none
    tie_embeddings: bool = True  # lm_head shares tok_emb's matrix (Press & Wolf 2017); False: its own, as in TinyLlama
    layer_weights: bool = True  # §4.2 the head reads a softmax mix of the blocks' outputs (EVE's runs report w_l)
    # False: EVE's deterministic twin, det's SwiGLU in place of the neuron bank and everything else equal (the
    # baseline of §4: the same attention, embeddings, head and its layer weights)
    variational: bool = True
    # EVE variational neurons (§3.2, §3.4). The paper gives no sizes or coefficients; these defaults are ours.
    n_neurons: int = None  # neurons per block; None = ffn_hidden // latent_dim: latent width D = det's SwiGLU width
    latent_dim: int = 1  # d_z, latent dimensions per neuron
    sigma_init: float = 0.8  # initial sigma_q of every neuron (the paper reports sigma_mean = 0.89 in §4.4)
    logvar_min: float = -6.0  # log sigma^2 (posterior and prior) clipped to [logvar_min, logvar_max]
    logvar_max: float = 2.0
    ar_prior: bool = True  # §3.3 autoregressive local prior; False: the fixed prior N(0, I)
    posterior_memory: bool = True  # §3.2 q(z | x, h): mu_q reads the memory h = mu_p (with ar_prior); False: q(z | x)
    mem_gain_init: float = 0.5  # initial c of mu_q = w_mu u + c h, in (-1, 1)
    ar_a_init: float = 0.5  # initial AR coefficient a of mu_p(t) = a mu_p(t-1) + b z(t-1) (= the pole alpha, c = 0)
    ar_b_init: float = 0.0  # initial b: the prior starts as N(0, 1) (m0 = 0) and learns its dynamics
    # §3.6 objective L = CE + beta KL + L_control + alpha_AR L_AR
    kl_beta: float = 0.2  # beta; KL counted in nats per neuron and token, summed over layers (see objective())
    alpha_ar: float = 0.1  # alpha_AR
    mu2_target: float = 0.10  # §3.3 target latent energy mu^2_target
    mu2_band: tuple = (0.08, 0.145)  # §3.3 admissible band around the target
    control_weight: float = 1.0  # weight of the squared-hinge band penalty L_control; 0 turns it off
    homeostat: bool = True  # §3.3 "homeostatic regulation": rescale each neuron's mu weights toward the target
    homeostat_ema: float = 0.9  # decay of the per-neuron EMA of mu^2 (~10 steps: one rescale period)
    homeostat_warmup: int = 100  # optimizer steps before the first rescale
    homeostat_every: int = 10  # steps between rescales
    homeostat_max_step: float = 0.05  # per rescale, each neuron's mu scales by a factor in [1/(1+m), 1+m]
    beta_control: bool = False  # optional per-unit beta controller keeping each unit's KL inside kl_band
    kl_band: tuple = (0.05, 0.30)  # nats per unit
    beta_rate: float = 0.01  # per step, a unit's beta is multiplied or divided by 1 + beta_rate
    beta_range: tuple = (0.01, 2.0)  # bounds of a unit's beta
    n_samples: int = 1  # training draws per token; > 1 averages the objective over that many draws

    def __post_init__(self):
        # Shapes; types, counts >= 1, rope_theta and norm_eps > 0 are checked by nanolatent/models.typed_values
        if self.head_dim is None and self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}: n_embd / n_head "
                             "must be whole (or head_dim set) and n_head / n_kv_head whole (GQA)")
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        if self.head_dim % 2: raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        scaling = self.rope_scaling
        if scaling is not None and not (len(scaling) == 4 and scaling[0] >= 1 and 0 <= scaling[1] < scaling[2]):
            raise ValueError(f"rope_scaling={scaling}: (factor >= 1, low_freq_factor < high_freq_factor, context)")
        if self.ffn_hidden is None:  # Llama's 8/3 * n_embd, rounded up to a multiple of ffn_multiple_of
            self.ffn_hidden = self.ffn_multiple_of * math.ceil(int(8 * self.n_embd / 3) / self.ffn_multiple_of)
        if self.n_neurons is None:
            self.n_neurons = max(1, self.ffn_hidden // self.latent_dim)
        self.n_latent = self.n_neurons * self.latent_dim  # D, latent coordinates per block
        # §3.3: sigma_init within the clip, tanh-parametrised gains inside (-1, 1), the energy target inside its band
        if not (self.logvar_min <= 2 * math.log(self.sigma_init) <= self.logvar_max and -1 < self.ar_a_init < 1
                and -1 < self.mem_gain_init < 1 and self.mu2_band[0] <= self.mu2_target <= self.mu2_band[1]):
            raise ValueError(f"need logvar_min <= 2 log sigma_init <= logvar_max, ar_a_init={self.ar_a_init} and "
                             f"mem_gain_init={self.mem_gain_init} in (-1, 1), mu2_band[0] <= mu2_target <= mu2_band[1]")
        if self.homeostat_ema >= 1 or self.kl_band[0] > self.kl_band[1] or not 0 < self.beta_range[0] <= self.beta_range[1]:
            raise ValueError(f"need homeostat_ema={self.homeostat_ema} < 1, kl_band={self.kl_band} and beta_range="
                             f"{self.beta_range} ordered (low, high), beta_range[0] > 0")


class Model(nn.Module):
    @property
    def latent_kind(self):
        """What each stochastic pass draws, for the scripts: a fresh eps for every neuron and token (twin: nothing)."""
        return "noise" if self.config.variational else "none"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # an imported checkpoint may bring a head of its own (scripts/convert.py)
            self.lm_head.weight = self.tok_emb.weight  # tied embeddings (Press & Wolf 2017)
        cos, sin = precompute_rope(config.head_dim, config.block_size, config.rope_theta, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        # EVE §4.2 head layer weights w_1..w_L (softmax of these logits; uniform at init, the paper gives none).
        self.layer_logits = nn.Parameter(torch.zeros(config.n_layer)) if config.layer_weights else None
        self.register_buffer("ctrl_step", torch.zeros((), dtype=torch.long))  # update_controllers calls so far
        self.apply(self._init_weights)
        # GPT-2 scaling: each residual branch adds to the stream, so its output projection starts smaller.
        for name, p in self.named_parameters():
            if name.endswith(("attn.wo.weight", "mlp.w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        for block in self.blocks if config.variational else ():
            # u = RMSNorm(x) has unit mean square, so std sqrt(mu2_target / C) starts every neuron at E[mu_q^2] =
            # mu2_target (§3.3); a zero w_logvar starts every sigma_q at exactly sigma_init.
            nn.init.normal_(block.mlp.w_mu.weight, mean=0.0, std=math.sqrt(config.mu2_target / config.n_embd))
            nn.init.zeros_(block.mlp.w_logvar.weight)
            nn.init.constant_(block.mlp.w_logvar.bias, 2 * math.log(config.sigma_init))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=False):
        """Every parameter once (a tied head/embedding once). non_embedding=True leaves out an untied embedding:
        a lookup, no matmul, so not part of the 6N of flops_per_token (nanoGPT's get_num_params)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding and not self.config.tie_embeddings else n

    def forward(self, idx, targets=None, latents=None, start_pos=0):
        """idx (B, T) -> (logits, loss, stats). latents (B, block_size, n_layer, D) pin eps (sample_latents),
        None draws them from the global RNG. With targets: logits (B, T, V) and the §3.6 objective (targets == -1 not
        in the CE); without: the last position's (B, 1, V). start_pos > 0 continues a KV cache (generate()). One
        forward is one stochastic pass: §3.5's Monte Carlo average is evaluate.py's."""
        cfg = self.config
        B, T = idx.shape
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds block_size={self.config.block_size}")
        if start_pos > 0 and self.blocks[0].attn.kv_cache is None:
            raise ValueError("start_pos > 0 continues a KV cache: setup_kv_cache(), then a call at position 0")
        pos = start_pos + torch.arange(T, device=idx.device)  # (T,) absolute positions
        # n_samples > 1 in training: the batch repeated S times with independent eps, the objective averaged over them
        S = cfg.n_samples if self.training and targets is not None and latents is None else 1
        if S > 1:
            idx, targets = idx.repeat(S, 1), targets.repeat(S, 1)
        p = self.tok_emb.weight
        if not cfg.variational:
            eps = None
        elif latents is None:
            eps = torch.randn(S * B, T, cfg.n_layer, cfg.n_latent, device=p.device, dtype=p.dtype)  # §3.2 eps
        else:
            eps = latents[:, pos.to(latents.device)].to(p.device, p.dtype)  # (B, T, L, D)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, hd) each
        x = self.tok_emb(idx)  # (B, T, C)
        outs, auxs = [], []
        for i, block in enumerate(self.blocks):
            x, aux = block(x, cos, sin, start_pos, None if eps is None else eps[:, :, i], targets is not None)
            outs.append(x if targets is not None else x[:, [-1], :])
            auxs.append(aux)
        x = self.norm_f(self.head_input(outs))
        if targets is None:
            return self.lm_head(x), None, {}  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        loss, stats = self.objective(ce, logits, auxs) if cfg.variational else (ce, {"ce": ce.detach()})
        if S > 1:  # the logits of the S-draw predictive mean, log (1/S) sum_s softmax(y_s) (§3.5)
            logprobs = F.log_softmax(logits.float(), dim=-1).view(S, B, T, -1)
            logits = torch.logsumexp(logprobs, dim=0) - math.log(S)  # (B, T, V)
        return logits, loss, stats

    def head_input(self, outs):
        """The head's input from the blocks' outputs x^(1..L), each (B, T, C). Choice for the head layer weights
        (§4.2-4.5 report w_1..w_L, summing to 1): sum_l w_l x^(l), w = softmax(layer_logits) (ELMo). Off: x^(L)."""
        if self.layer_logits is None:
            return outs[-1]
        w = F.softmax(self.layer_logits, dim=0).to(outs[-1].dtype)  # (L,)
        return sum(w_l * x for w_l, x in zip(w, outs))  # (B, T, C)

    def objective(self, ce, logits, auxs):
        """-> §3.6's L = L_LM + beta L_KL + L_control + alpha_AR L_AR (KL in nats a neuron, token), §4.2's stats"""
        cfg = self.config
        lo, hi = cfg.mu2_band
        kl_u = torch.stack([aux["kl_u"] for aux in auxs])  # (L, N) per-unit KL averaged over tokens
        mu2_u = torch.stack([aux["mu2_u"] for aux in auxs])  # (L, N) per-neuron latent energy over tokens
        beta = torch.stack([b.mlp.beta_unit for b in self.blocks]) if cfg.beta_control else cfg.kl_beta
        kl_term = (beta * kl_u).mean(1).sum()  # beta L_KL (per-unit beta under the beta controller)
        # L_control (choice, §3.3 band): squared hinge on each neuron's batch energy mean_t mu^2 outside mu2_band, not
        # per token, so the variation that carries information is free; the homeostat pulls toward mu2_target.
        band = F.relu(lo - mu2_u).pow(2) + F.relu(mu2_u - hi).pow(2)  # (L, N)
        control = cfg.control_weight * band.mean(1).sum()
        ar = sum(aux["ar"] for aux in auxs)
        loss = ce + kl_term + control + cfg.alpha_ar * ar
        # Diagnostics (§3.3, §4.2), all 0-dim and detached. Band fractions are over the L * N neurons' batch energies.
        kl_u, mu2_u = kl_u.detach(), mu2_u.detach()
        stats = {"ce": ce.detach(), "kl": kl_u.mean(1).sum(), "control": control.detach(), "ar": ar.detach()}
        stats.update({f"{k}_{i}": v[i].mean() for k, v in (("kl", kl_u), ("mu2", mu2_u)) for i in range(cfg.n_layer)})
        stats.update(band_in=((mu2_u >= lo) & (mu2_u <= hi)).float().mean(), band_low=(mu2_u < lo).float().mean(),
                     band_high=(mu2_u > hi).float().mean())  # fractions inside, below and above the band
        stats["target_gap"] = (mu2_u - cfg.mu2_target).abs().mean()  # mean |mu^2 - mu^2_target| over neurons
        stats["active_frac"] = (kl_u > 1e-4).float().mean()  # units with KL_u > 1e-4 nats
        stats["sigma"] = sum(aux["sigma"] for aux in auxs) / cfg.n_layer  # mean sigma_q (§4.4's sigma_mean)
        if self.layer_logits is not None:
            stats.update({f"w_{i}": w for i, w in enumerate(F.softmax(self.layer_logits.detach(), dim=0))})
        # Non-finite logits, per-unit KL and mu^2: a NaN in any token's posterior reaches its unit's means, no new pass
        stats["nonfinite"] = sum((~torch.isfinite(t)).sum() for t in (logits.detach(), kl_u, mu2_u))
        return loss, stats

    @torch.no_grad()
    def update_controllers(self, all_reduce=None, skipped=False):
        """§3.3 control after each optimizer step, from the KL_u and mu2_u each block measured over the step's training
        forwards (all_reduce averages them over processes: every rank updates alike, as one process would); skipped:
        the step was not taken (a non-finite loss), its measurements are dropped and the controllers stay: mu2_ema,
        an EMA of each neuron's mu^2; beta_control: a unit's beta times or divided by 1 + beta_rate while its KL is
        above or below kl_band;
        homeostat: from homeostat_warmup on, every homeostat_every steps, each neuron's w_mu rows (and EMA) scaled by
        sqrt(mu2_target / EMA) within [1/(1+m), 1+m] (posterior_memory: h carries sigma_q eps too; the EMA corrects)."""
        cfg = self.config
        mlps = [block.mlp for block in self.blocks]
        if not cfg.variational or any(m.stash is None for m in mlps):
            return  # no training forward since the last update
        if skipped:  # a NaN measured there would reach mu2_ema and, at the next rescale, w_mu
            for m in mlps:
                m.stash = m.stash_forwards = None
            return
        measured = torch.stack([m.stash for m in mlps]).to(mlps[0].mu2_ema.dtype)  # (L, 2, N), as the buffers
        if all_reduce is not None:
            all_reduce(measured)
        step = int(self.ctrl_step)
        since = step - cfg.homeostat_warmup
        rescale = cfg.homeostat and since >= 0 and since % cfg.homeostat_every == 0
        for m, (kl_u, mu2_u) in zip(mlps, measured):
            m.stash = m.stash_forwards = None
            m.mu2_ema.copy_(mu2_u) if step == 0 else m.mu2_ema.lerp_(mu2_u, 1.0 - cfg.homeostat_ema)
            if cfg.beta_control:
                up, down = kl_u > cfg.kl_band[1], kl_u < cfg.kl_band[0]
                factor = torch.where(up, 1.0 + cfg.beta_rate, torch.where(down, 1.0 / (1.0 + cfg.beta_rate), 1.0))
                m.beta_unit.mul_(factor).clamp_(*cfg.beta_range)
            if rescale:
                bound = 1.0 + cfg.homeostat_max_step
                scale = (cfg.mu2_target / m.mu2_ema.clamp_min(1e-12)).sqrt().clamp(1.0 / bound, bound)  # (N,)
                m.w_mu.weight.view(cfg.n_neurons, cfg.latent_dim, -1).mul_(scale.view(-1, 1, 1))
                m.mu2_ema.mul_(scale.pow(2))
        self.ctrl_step += 1

    def sample_latents(self, batch_size, generator=None, prompt=None):
        """Pinned noise: the eps of every neuron at every position and layer, (B, block_size, n_layer, D) ~ N(0, I):
        same latents, same output. Drawn on the generator's device, so a CPU generator gives the same latents on any
        device. `prompt` is ignored: eps ~ N(0, I) whatever the tokens (§3.2); the posterior reads them."""
        cfg, p = self.config, self.tok_emb.weight
        if not cfg.variational:
            return None  # the deterministic twin: nothing to pin
        device = p.device if generator is None else generator.device
        eps = torch.randn(batch_size, cfg.block_size, cfg.n_layer, cfg.n_latent, generator=generator, device=device)
        return eps.to(p.device, p.dtype)

    def setup_kv_cache(self, batch_size, max_len):
        p = self.tok_emb.weight
        for block in self.blocks:
            block.attn.kv_cache = KVCache(batch_size, self.config.n_kv_head, max_len, self.config.head_dim,
                                          p.device, p.dtype)
            if self.config.variational and self.config.ar_prior:  # §3.3: the AR prior's state travels with the cache
                block.mlp.prior_cache = PriorCache(batch_size, self.config.n_latent, p.device, p.dtype)
                block.mlp.prior_cache.mean.copy_(block.mlp.prior_m0.detach())  # mu_p(0) = m0: a decode step at 0

    def clear_kv_cache(self):
        for block in self.blocks:
            block.attn.kv_cache = None
            if self.config.variational:
                block.mlp.prior_cache = None

    def repeat_kv_cache(self, n):
        """Continue every cached sequence n ways (rows b n, ..., b n + n - 1 continue sequence b): a context computed
        once, then each of n continuations against it (multiple-choice scoring)."""
        for block in self.blocks:
            block.attn.kv_cache.repeat(n)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, latents=None, generator=None, step=None):
        """Append max_new_tokens to idx (B, T): one prefill of the prompt, then one cached step per token (step: self's
        forward unless a script passes a compiled one). The neurons' noise is pinned for the whole call: `latents`, or
        one draw of sample_latents(B, generator). Tokens are drawn between steps, from `generator`."""
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.config.block_size:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} exceeds the context "
                             f"(block_size={self.config.block_size}); shorten the prompt or ask for fewer tokens")
        if latents is None:
            latents = self.sample_latents(B, generator)
        step = step or self
        self.setup_kv_cache(B, total)
        try:
            logits, _, _ = self(idx, latents=latents, start_pos=0)  # (B, 1, V)
            for pos in range(T, total):
                idx_next = sample_next_token(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)
                if pos + 1 < total:
                    logits, _, _ = step(idx_next, latents=latents, start_pos=pos)
        finally:
            self.clear_kv_cache()
        return idx

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay on matrices and embeddings only (>= 2-D), never on norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # The fused kernel updates every tensor in one pass, with no parameter-sized temporaries (on a CPU too).
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cpu", "cuda"))

    def flops_per_token(self):
        """Training FLOPs per token, PaLM appendix B as in nanoGPT: 6N for the weights (the tied head in, the embedding
        lookup not), 12 L nh hd T for attention scores, 3x the neurons' elementwise forward per latent coordinate: 11 to
        sample and decode (clip, exp, mu + sigma eps, d z + c, silu), 6 for the KL's and mu^2's means; AR prior: 4 for
        the scan, 8 for its drive, the KL distance and L_AR, 3 more with posterior_memory. Times n_samples."""
        cfg = self.config
        prior = 4 + 8 + 3 * cfg.posterior_memory if cfg.ar_prior else 0
        variational = 3 * (17 + prior) * cfg.n_layer * cfg.n_latent if cfg.variational else 0
        dense = 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size
        return cfg.n_samples * (dense + variational)
