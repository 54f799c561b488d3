"""B-Trans ("Many Minds from One Model", Yang & Zhang): the det decoder with a random offset after every RMSNorm.

Each wrapped norm computes h' = RMSNorm(h) + mu + sigma * eps (§4.1 Eq. 4). One eps per sequence, frozen for the
prompt and every generated token (§3.2 Eq. 3, §4.3), makes each batch row a different "mind" of the same weights.
Training (train() mode) uses the mean offset mu alone by default, as the paper's §5 does; the minds are drawn in eval()
mode: sampling, evaluation and RL rollouts.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# Building blocks. model_eve.py, model_free.py and model_btrans.py repeat these verbatim, in this order, so the
# files diff cleanly side by side: only what each paper changes shows up in `diff model_det.py model_<x>.py`.


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain and no bias (Zhang & Sennrich 2019)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class BayesianBiasNorm(RMSNorm):
    """§4.1 Eq. 4: RMSNorm(x) + mu + sigma * eps. The gain keeps RMSNorm's name `weight`, so det checkpoints load:
    mu and log_sigma are the only new parameters (missing from a det state_dict, never unexpected)."""

    def __init__(self, config, sigma):
        super().__init__(config.n_embd, config.norm_eps)
        # §4.1: mu is a hyperparameter that "can be 0 in RMSNorm": zeros, frozen unless config.learn_mu.
        self.mu = nn.Parameter(torch.zeros(config.n_embd), requires_grad=config.learn_mu)
        # Beyond the paper (§7 future work): a learned spread, one scalar per wrapped norm, positive as exp(.).
        self.log_sigma = nn.Parameter(torch.full((1,), math.log(sigma))) if config.learn_sigma else None
        self.fixed_sigma = sigma  # the spread when it is not learned (a float: no state_dict key)
        self.sigma_scale = config.sigma_scale

    @property
    def sigma(self):
        return self.fixed_sigma if self.log_sigma is None else self.log_sigma.exp()

    def forward(self, x, eps=None):
        # eps is (B, 1, C) per sequence, (B, T, C) per token, or None for the mean offset alone (§5 update phase).
        if eps is not None and self.sigma_scale == "gain":  # ours: w * (x_hat + sigma eps) in distribution
            eps = eps * self.weight.abs()  # (B, 1 or T, C)
        elif eps is not None and self.sigma_scale == "mean_gain":
            eps = eps * self.weight.abs().mean()
        offset = self.mu if eps is None else self.mu + self.sigma * eps  # (C,) or like eps
        return super().forward(x) + offset  # (B, T, C)

    def kl(self, prior_sigma):
        """Beyond the paper: KL(N(mu, sigma^2 I) || N(0, prior_sigma^2 I)) of this offset, summed over channels."""
        log_ratio = 2 * (self.log_sigma - math.log(prior_sigma))  # (1,) log(sigma^2 / prior_sigma^2)
        per_channel = 0.5 * (log_ratio.exp() - 1 - log_ratio)  # (1,) the variance term, the same in every channel
        return per_channel.sum() * self.mu.numel() + 0.5 * (self.mu / prior_sigma).pow(2).sum()


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


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config, layer):
        super().__init__()
        self.attn_norm = BayesianBiasNorm(config, config.sigmas[2 * layer])
        self.attn = Attention(config)
        self.mlp_norm = BayesianBiasNorm(config, config.sigmas[2 * layer + 1])
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, start_pos, attn_eps, mlp_eps):
        x = x + self.dropout(self.attn(self.attn_norm(x, attn_eps), cos, sin, start_pos))
        x = x + self.dropout(self.mlp(self.mlp_norm(x, mlp_eps)))
        return x


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
    # B-Trans (§4.1 Eq. 4). The paper gives no sigma; 0.02 is the default of the only public re-implementation.
    sigma: float = 0.02  # spread of the offset population, the same in every wrapped norm
    # Or one sigma per wrapped norm, in forward order (attn_norm, mlp_norm of each block, then norm_f): 2L+1 of them.
    sigma_per_layer: tuple = None
    # What sigma is relative to. 'absolute': Eq. 4 as written, sigma * eps. Ours, the default: 'gain', sigma * |w| * eps
    # per channel (w the norm's gain), the same in distribution as w * (RMSNorm's unit-RMS output + sigma * eps): sigma
    # is a fraction of the normalised signal whatever the gains (SmolLM2-135M's mean |w| per norm spans 0.027-1.81, so
    # an absolute 0.02 is 74% of one norm's signal and 1% of another's; experiments/btrans_sigma.py). 'mean_gain':
    # sigma * mean |w| * eps, one scale per norm. A model trained from scratch has gains near 1: all three agree there.
    sigma_scale: str = "gain"
    # 'sequence': one eps per row, frozen for the whole sequence (§3.2 Eq. 3, §4.3); 'token': a fresh eps at every
    # position and every call (§6.1 ablation, Eq. 2); 'mean': mu only, deterministic (§5: the RL update phase).
    # noise_mode is what forward computes in eval() mode: sampling, evaluation, RL rollouts.
    noise_mode: str = "sequence"
    # ...and train_noise_mode in train() mode. §5: "in all training settings, we inject stochasticity only during
    # rollout ..., keeping the update phase deterministic by using the mean shift only"; 'sequence' or 'token' train
    # with the noise instead (an ablation, ours).
    train_noise_mode: str = "mean"
    # Whether norm_f, the last norm before the head, carries the noise too. The paper wraps "RMSNorm layers" and
    # does not say; on the final norm an eps is a per-sequence bias of the logits (W_head eps). Ours; False: mu only.
    final_norm_noise: bool = True
    learn_mu: bool = False  # §4.1 treats mu as a hyperparameter ("can be 0 in RMSNorm"): frozen at 0 by default
    # Beyond the paper (§7 future work): learn one sigma per wrapped norm, with a KL to a N(0, prior_sigma^2) prior
    learn_sigma: bool = False
    prior_sigma: float = 0.02  # = the default sigma, so the KL is 0 at initialisation when mu = 0
    kl_weight: float = 1e-6  # ~ 1 / training tokens: the ELBO spreads the one global KL over every token

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
        self.n_norms = 2 * self.n_layer + 1  # every hidden-size RMSNorm is wrapped (§4: attn, mlp, final)
        self.sigmas = (self.sigma,) * self.n_norms if self.sigma_per_layer is None else tuple(self.sigma_per_layer)
        if len(self.sigmas) != self.n_norms or min(self.sigmas) < 0:
            raise ValueError(f"sigma_per_layer needs 2 * n_layer + 1 = {self.n_norms} sigmas >= 0: {self.sigmas}")
        if self.learn_sigma and (min(self.sigmas) <= 0 or self.sigma_scale != "absolute"):  # the KL of sigma * eps
            raise ValueError("learn_sigma learns log(sigma) of the offset sigma * eps: sigmas > 0, sigma_scale='absolute'")
        if self.sigma_scale not in ("absolute", "gain", "mean_gain") or not {self.noise_mode, self.train_noise_mode} <= {
                "sequence", "token", "mean"}:
            raise ValueError(f"sigma_scale={self.sigma_scale!r} must be 'absolute', 'gain' or 'mean_gain'; noise_mode="
                             f"{self.noise_mode!r}, train_noise_mode={self.train_noise_mode!r} 'sequence', 'token' or 'mean'")


class Model(nn.Module):

    @property
    def noise_mode(self):
        """The noise this forward applies: config.train_noise_mode in train() mode (§5: 'mean'), else noise_mode."""
        return self.config.train_noise_mode if self.training else self.config.noise_mode

    @property
    def latent_kind(self):
        """What each stochastic pass draws, for the scripts: one mind per sequence (§4.3), fresh noise at every token
        (§6.1), or nothing in 'mean' mode (§5), whose one pass is all there is."""
        return {"sequence": "mind", "token": "noise", "mean": "none"}[self.noise_mode]

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.norm_f = BayesianBiasNorm(config, config.sigmas[-1])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # an imported checkpoint may bring a head of its own (scripts/convert.py)
            self.lm_head.weight = self.tok_emb.weight  # tied embeddings (Press & Wolf 2017)
        cos, sin = precompute_rope(config.head_dim, config.block_size, config.rope_theta, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 scaling: each residual branch adds to the stream, so its output projection starts smaller.
        for name, p in self.named_parameters():
            if name.endswith(("attn.wo.weight", "mlp.w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=False):
        """Every parameter once (a tied head/embedding once). non_embedding=True leaves out an untied embedding:
        a lookup, no matmul, so not part of the 6N of flops_per_token (nanoGPT's get_num_params)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding and not self.config.tie_embeddings else n

    def norms(self):
        """The wrapped norms in forward order, the order of sample_latents' second axis and of sigma_per_layer."""
        return [norm for block in self.blocks for norm in (block.attn_norm, block.mlp_norm)] + [self.norm_f]

    def forward(self, idx, targets=None, latents=None, start_pos=0, generator=None):
        """idx (B, T) token ids -> (logits, loss, stats); row b is computed by mind latents[b] (B, n_norms, C).

        With targets: logits (B, T, V) and loss = mean cross-entropy (targets == -1 are ignored), plus kl_weight * KL
        when learn_sigma. Without: logits of the last position only, (B, 1, V). start_pos > 0 continues a KV cache
        (generate()). The mode is self.noise_mode: config.train_noise_mode in train(), config.noise_mode in eval() (both
        switchable between calls). latents=None in 'sequence' mode draws a fresh mind per row, and 'token' mode its eps
        at every position, from `generator` (the global RNG when None); 'token' and 'mean' modes ignore latents."""
        B, T = idx.shape
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds block_size={self.config.block_size}")
        if start_pos > 0 and self.blocks[0].attn.kv_cache is None:
            raise ValueError("start_pos > 0 continues a KV cache: setup_kv_cache(), then a call at position 0")
        pos = start_pos + torch.arange(T, device=idx.device)  # (T,) absolute positions
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, hd) each
        eps = self.offset_noise(B, T, latents, start_pos, generator)  # n_norms tensors (B, 1 or T, C), or Nones
        x = self.tok_emb(idx)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, start_pos, eps[2 * i], eps[2 * i + 1])
        x = self.norm_f(x, eps[-1] if self.config.final_norm_noise else None)  # off: mu only, the other minds' eps kept
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None, {}  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        stats = {"ce": loss.detach()}
        if self.config.learn_sigma:  # beyond the paper (§7): ELBO-style penalty on the learned offset posterior
            kl = sum(norm.kl(self.config.prior_sigma) for norm in self.norms())
            loss = loss + self.config.kl_weight * kl
            stats["kl"] = kl.detach()
        return logits, loss, stats

    def offset_noise(self, B, T, latents, start_pos, generator=None):
        """The eps of each wrapped norm for this call, per self.noise_mode; fresh draws come from `generator`."""
        cfg, p, mode = self.config, self.tok_emb.weight, self.noise_mode
        if mode == "mean":  # §5: "keeping the update phase deterministic by using the mean shift only"
            return [None] * cfg.n_norms
        if mode == "token":  # §6.1 ablation (Eq. 2): resampled at every position and every forward pass
            device = p.device if generator is None else generator.device  # as in sample_latents
            eps = torch.randn(B, cfg.n_norms, T, cfg.n_embd, generator=generator, device=device)
            return eps.to(p.device, p.dtype).unbind(1)
        # 'sequence', §3.2 Eq. 3 / §4.3: one eps per row, frozen for the prompt and every decode step after it.
        if latents is None:
            if start_pos > 0:
                raise ValueError("a KV-cache decode step must reuse the prefill's latents (§4.3); pass latents=")
            latents = self.sample_latents(B, generator)
        if latents.shape != (B, cfg.n_norms, cfg.n_embd):
            raise ValueError(f"latents {tuple(latents.shape)} must be (B, n_norms, n_embd) = "
                             f"{(B, cfg.n_norms, cfg.n_embd)}")
        return latents.unsqueeze(2).unbind(1)  # n_norms x (B, 1, C): broadcast over positions

    def sample_latents(self, batch_size, generator=None, prompt=None):
        """batch_size minds: eps ~ N(0, I) of every wrapped norm, (B, n_norms, C) (§3.2: "draw a noise vector once
        and freeze it"). Drawn on the generator's device, so a CPU generator gives the same minds on any device.
        None in 'token' and 'mean' modes (self.noise_mode), which have nothing to pin. `prompt` is ignored: a mind is
        drawn independently of any text (§4.3: sampled once at initialization, before the prompt is read)."""
        if self.noise_mode != "sequence":
            return None
        p, cfg = self.tok_emb.weight, self.config
        device = p.device if generator is None else generator.device
        eps = torch.randn(batch_size, cfg.n_norms, cfg.n_embd, generator=generator, device=device)
        return eps.to(p.device, p.dtype)  # (B, n_norms, C)

    def setup_kv_cache(self, batch_size, max_len):
        p = self.tok_emb.weight
        for block in self.blocks:
            block.attn.kv_cache = KVCache(batch_size, self.config.n_kv_head, max_len, self.config.head_dim,
                                          p.device, p.dtype)

    def clear_kv_cache(self):
        for block in self.blocks:
            block.attn.kv_cache = None

    def repeat_kv_cache(self, n):
        """Continue every cached sequence n ways (rows b n, ..., b n + n - 1 continue sequence b): a context computed
        once, then each of n continuations against it (multiple-choice scoring)."""
        for block in self.blocks:
            block.attn.kv_cache.repeat(n)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, latents=None, generator=None, step=None):
        """Append max_new_tokens to idx (B, T): one prefill of the prompt, then one cached step per token (step: self's
        forward unless a script passes a compiled one). Row b is generated by mind latents[b]; latents=None draws B
        minds from `generator` once, first (§4.3). Tokens are drawn between steps, and in 'token' mode every step's eps
        (compiled or not), from `generator`, so a seed reproduces the generation."""
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.config.block_size:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} exceeds the context "
                             f"(block_size={self.config.block_size}); shorten the prompt or ask for fewer tokens")
        if latents is None:
            latents = self.sample_latents(B, generator)  # §4.3 (1) Initialization: sample once and cache
        step = step or self
        self.setup_kv_cache(B, total)
        try:
            logits, _, _ = self(idx, latents=latents, start_pos=0, generator=generator)  # (B, 1, V)
            for pos in range(T, total):
                idx_next = sample_next_token(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)
                if pos + 1 < total:  # §4.3 (2) Generation: every step applies the same frozen eps
                    logits, _, _ = step(idx_next, latents=latents, start_pos=pos, generator=generator)
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
        """Training FLOPs per token (forward + backward), PaLM appendix B as in nanoGPT: 6N for the weights
        (the tied head's matmul included, the embedding lookup not) plus 12 * L * nh * hd * T for attention scores.
        B-Trans adds no matmul (§4.3: "an element-wise addition of a cached tensor"): mu and log_sigma are left out
        of N, and the offset costs 3 FLOPs per element per token, n_norms * C elements: 1 for the add forward, <= 2
        backward (its gradient passes x unchanged; the sums for learned mu, sigma). mu + sigma * eps is per row."""
        cfg = self.config
        n_offset = sum(p.numel() for norm in self.norms() for p in (norm.mu, norm.log_sigma) if p is not None)
        return (6 * (self.num_params(non_embedding=True) - n_offset)
                + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size + 3 * cfg.n_norms * cfg.n_embd)
