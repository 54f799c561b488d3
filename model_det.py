"""Deterministic Llama-style decoder: the baseline every stochastic model in nanolatent is measured against."""

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

    def __init__(self, config):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, start_pos):
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin, start_pos))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


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


class Model(nn.Module):
    @property
    def latent_kind(self):
        """What each stochastic pass draws, for the scripts: nothing here, one pass is all there is."""
        return "none"

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

    def forward(self, idx, targets=None, latents=None, start_pos=0):
        """idx (B, T) token ids -> (logits, loss, stats). The det model has no latents; `latents` is ignored.

        With targets: logits (B, T, V) and loss = mean cross-entropy (targets == -1 are ignored).
        Without: logits of the last position only, (B, 1, V). start_pos > 0 continues a KV cache (generate()).
        """
        B, T = idx.shape
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds block_size={self.config.block_size}")
        if start_pos > 0 and self.blocks[0].attn.kv_cache is None:
            raise ValueError("start_pos > 0 continues a KV cache: setup_kv_cache(), then a call at position 0")
        pos = start_pos + torch.arange(T, device=idx.device)  # (T,) absolute positions
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, hd) each
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin, start_pos)
        x = self.norm_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None, {}  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss, {"ce": loss.detach()}

    def sample_latents(self, batch_size, generator=None, prompt=None):
        return None  # nothing stochastic to pin, for any prompt

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
        """Append max_new_tokens to idx (B, T): one prefill of the prompt, then one cached step per token. step: the
        one-token forward, self's unless a script passes a compiled one (gpt-fast's decode_one_token); tokens are
        drawn between steps, from `generator`, either way."""
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.config.block_size:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} exceeds the context "
                             f"(block_size={self.config.block_size}); shorten the prompt or ask for fewer tokens")
        step = step or self
        self.setup_kv_cache(B, total)
        try:
            logits, _, _ = self(idx, start_pos=0)  # (B, 1, V)
            for pos in range(T, total):
                idx_next = sample_next_token(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)
                if pos + 1 < total:
                    logits, _, _ = step(idx_next, start_pos=pos)
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
        (the tied head's matmul included, the embedding lookup not) plus 12 * L * nh * hd * T for attention scores."""
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size
