"""The Free Transformer (Fleuret): a decoder conditioned on a random latent Z injected at its middle layer, trained as
a conditional VAE with a one-block non-causal encoder, the Binary Mapper and token-wise free bits."""

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
    """Causal grouped-query attention (Ainslie et al. 2023): n_head query heads share n_kv_head key/value heads.

    §3.2-3.3: queries and keys/values may come from different inputs (x_kv), and the encoder's block is non-causal.
    """

    def __init__(self, config, causal=True):
        super().__init__()
        self.causal = causal
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.wq = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        # Qwen3: an RMSNorm over each head's queries and over its keys (one gain of hd, shared by the heads)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else nn.Identity()
        self.kv_cache = None  # a KVCache while generate() runs

    def forward(self, x, cos, sin, start_pos, x_kv=None):
        B, T, _ = x.shape
        x_kv = x if x_kv is None else x_kv  # queries from x, keys and values from x_kv, of the same length T
        # One matmul per weight, kept apart as Llama checkpoints keep them
        q = self.q_norm(self.wq(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(self.wk(x_kv).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.wv(x_kv).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # after the norms, as Qwen3 applies them
        if self.kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.n_kv_head != self.n_head)
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
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    With x_kv (Algorithm 2, lines 7 and 14) the attention takes queries from norm(x) and keys/values from
    norm(x_kv), the same pre-norm applied to each input; the residual stream continues from x, the query side.
    """

    def __init__(self, config, causal=True):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config, causal)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, start_pos, x_kv=None):
        h = self.attn_norm(x)
        h_kv = h if x_kv is None else self.attn_norm(x_kv)
        x = x + self.dropout(self.attn(h, cos, sin, start_pos, h_kv))
        x = x + self.dropout(self.mlp(self.mlp_norm(x)))
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
# §3.3-3.4: the latent Z_t is one of 2^H codes; the encoder gives H bit logits L_t per token. Code d has bits
# U(d) = (U_0(d), ..., U_{H-1}(d)), d = sum_h 2^h U_h(d) (Eq. 7, 0-indexed). All probabilities are computed in at
# least float32, from logits: log sigmoid(L) = L - softplus(L) and log(1 - sigmoid(L)) = -softplus(L).


def code_bits(codes, n_bits):
    """Binary encoding U(d) of integer codes (...) -> (..., n_bits) in {0, 1}, least significant bit first."""
    return (codes.unsqueeze(-1) >> torch.arange(n_bits, device=codes.device)) & 1


def sample_codes(bit_logits, generator=None):
    """§3.4 Eq. 6-7: bits B_h ~ Bernoulli(sigmoid(L_h)) independently, code = sum_h 2^h B_h. (..., H) -> (...)"""
    H = bit_logits.size(-1)
    u = torch.rand(bit_logits.shape, generator=generator, device=bit_logits.device)
    bits = (u < torch.sigmoid(bit_logits.float())).long()  # (..., H)
    return (bits << torch.arange(H, device=bit_logits.device)).sum(-1)


def log_q_codes(bit_logits, codes):
    """log Q(Z_t = code | S) = log G_{t,code} = L_t . U(code) - sum_h softplus(L_{t,h}) (§3.4), in nats. (...)"""
    L = bit_logits.to(torch.promote_types(bit_logits.dtype, torch.float32))
    return (L * code_bits(codes, L.size(-1))).sum(-1) - F.softplus(L).sum(-1)


def kl_per_token(bit_logits):
    """Eq. 4, KL(Q(Z_t | S) || uniform) in nats. Q is a product of Bernoullis, so H log 2 + sum_z Q log Q is
    sum_h (log 2 - h(sigmoid(L_h))), binary entropy h(sigmoid(L)) = softplus(L) - sigmoid(L) L. (..., H) -> (...)"""
    L = bit_logits.to(torch.promote_types(bit_logits.dtype, torch.float32))
    return (math.log(2) - F.softplus(L) + torch.sigmoid(L) * L).sum(-1)


def code_probs(bit_logits):
    """§3.4: G_{t,d} = Q(Z_t = d | S) = exp(L_t . U(d) - sum_h softplus(L_{t,h})) for all 2^H codes d.

    bit_logits (..., H) -> G (..., 2^H) and the bit table U (2^H, H)."""
    H = bit_logits.size(-1)
    U = code_bits(torch.arange(2 ** H, device=bit_logits.device), H).to(bit_logits.dtype)  # (2^H, H)
    return (bit_logits @ U.t() - F.softplus(bit_logits).sum(-1, keepdim=True)).exp(), U


def dense_binary_mapper(bit_logits, codes, weight):
    """The Binary Mapper and post-sampler as written in §3.4: builds G and Y of shape (..., 2^H), then R = W Z.

    bit_logits (..., H) float32, codes (...), weight (C, 2^H) -> R (..., C). The reference for the factored path."""
    G, _ = code_probs(bit_logits)  # (..., 2^H)
    Y = torch.zeros_like(G).scatter_(-1, codes.unsqueeze(-1), 1.0)  # (..., 2^H), Eq. 7: one-hot of the code
    Z = Y + (G - G.detach())  # Eq. 8; G - G.detach() is exactly 0, so the forward value is exactly Y
    return F.linear(Z.to(weight.dtype), weight)  # (..., C)


class FactoredBinaryMapper(torch.autograd.Function):
    """dense_binary_mapper's forward value and gradients, never building G, Y or v for all tokens at once.

    Forward: Z = Y + (G - sg G) (Eq. 8) equals Y exactly, so R_t = W Z_t = W[:, c_t], a column gather.
    Backward, with g_t = dLoss/dR_t (C,) and v_{t,d} = g_t . W[:, d]:
      dLoss/dW[:, d] = sum_{t: c_t = d} g_t                     (only Y carries a value: a scatter-add)
      dLoss/dL_{t,h} = sum_d v_{t,d} dG_{t,d}/dL_{t,h} = sum_d v_{t,d} G_{t,d} (U_h(d) - sigmoid(L_{t,h}))
    since d log G_{t,d} / dL_{t,h} = U_h(d) - sigmoid(L_{t,h}) (G as §3.4 writes it, between Eq. 7 and 8). The bits
    are independent (Eq. 6), so G factorises over any split of them. With b = ceil(H/2), a = H - b and
    d = 2^b hi + lo (lo: bits 0..b-1, hi: bits b..H-1), G_{t,d} = Glo_{t,lo} Ghi_{t,hi}, two products of Bernoullis
    over half the bits each (2^8 values at H = 16). Viewing v_t as a (2^a, 2^b) matrix V_t[hi, lo]:
      x_{t,lo} = Glo_{t,lo} sum_hi Ghi_{t,hi} V_t[hi, lo],   y_{t,hi} = Ghi_{t,hi} sum_lo V_t[hi, lo] Glo_{t,lo}
    are two batched matrix-vector products over v, and with S_t = sum_d v_{t,d} G_{t,d} = sum_lo x_{t,lo}:
      dLoss/dL_{t,h} = sum_lo x_{t,lo} U_h(lo) - sigmoid(L_{t,h}) S_t         for a low bit h < b,
                       sum_hi y_{t,hi} U_{h-b}(hi) - sigmoid(L_{t,h}) S_t     for a high bit.
    G is never formed, nor all of v: v is built at most `chunk` values (tokens x codes; at least one token by 2^b
    codes) at a time in one reused buffer. A piece spans whole rows hi: it gives y for those rows and adds its share
    to x. A piece spans as many tokens as fit and as few codes as needed: (tokens, C) x (C, codes) matmuls with many
    rows run fastest. The work beyond v's 2 C 2^H flops per token is 4 2^H for the two products."""

    @staticmethod
    def forward(ctx, bit_logits, codes, weight, chunk):
        # bit_logits (N, H) float32 or wider, codes (N,) int64, weight (C, 2^H), chunk: values per piece of v
        ctx.save_for_backward(bit_logits, codes, weight)
        ctx.chunk = chunk
        return weight.t()[codes]  # (N, C)

    @staticmethod
    def backward(ctx, grad_r):
        bit_logits, codes, weight = ctx.saved_tensors
        g = grad_r.to(weight.dtype)  # (N, C)
        grad_logits = grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = torch.zeros_like(weight)  # (C, 2^H)
            grad_weight.t().index_add_(0, codes, g)
        if ctx.needs_input_grad[0]:
            N, H = bit_logits.shape
            b = (H + 1) // 2
            G_lo, U_lo = code_probs(bit_logits[:, :b])  # (N, 2^b), (2^b, b)
            G_hi, U_hi = code_probs(bit_logits[:, b:])  # (N, 2^a), (2^a, a)
            n_lo, n_hi = G_lo.size(1), G_hi.size(1)
            tokens = min(N, max(1, ctx.chunk // n_lo))  # a piece of v: `tokens` tokens by `rows` * 2^b codes
            rows = min(n_hi, max(1, ctx.chunk // (tokens * n_lo)))
            buffer = g.new_empty(tokens * rows * n_lo)
            x, y = torch.zeros_like(G_lo), torch.empty_like(G_hi)
            for s in range(0, N, tokens):
                e = min(s + tokens, N)
                for h0 in range(0, n_hi, rows):
                    h1 = min(h0 + rows, n_hi)
                    v = buffer[:(e - s) * (h1 - h0) * n_lo].view(e - s, (h1 - h0) * n_lo)  # codes h0 2^b .. h1 2^b
                    torch.mm(g[s:e], weight[:, h0 * n_lo:h1 * n_lo], out=v)
                    V = v.to(bit_logits.dtype).view(e - s, h1 - h0, n_lo)  # (n, h1 - h0, 2^b): V[hi, lo]
                    x[s:e] += torch.bmm(G_hi[s:e, None, h0:h1], V).squeeze(1)  # (n, 2^b): sum over these hi
                    y[s:e, h0:h1] = torch.bmm(V, G_lo[s:e, :, None]).squeeze(2)  # (n, h1 - h0): sum over lo
            x, y = x * G_lo, y * G_hi
            grad_logits = torch.cat([x @ U_lo, y @ U_hi], dim=1) - torch.sigmoid(bit_logits) * x.sum(1, keepdim=True)
        return grad_logits, None, grad_weight, None


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
    latent_bits: int = 8  # H: Z_t is one of 2^H codes; 8 for the tiny default (§4.3's H = 16: config/free_1b5.py)
    kappa_bits: float = 0.5  # free-bits threshold κ per token, in bits (§4.5: κ = log(2)/2, half a bit)
    mapper: str = "factored"  # Binary Mapper: "dense" builds (B, T, 2^H) as §3.4 writes it; "factored" never does
    mapper_chunk: int = 2 ** 22  # factored backward: v is built this many values (tokens x codes) at a time

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
        if self.n_layer % 2 or self.mapper not in ("dense", "factored") or not 1 <= self.latent_bits <= 20:
            raise ValueError(f"n_layer={self.n_layer} must be even (Z enters after block n_layer/2, §3.2), mapper="
                             f"{self.mapper!r} 'dense' or 'factored', latent_bits={self.latent_bits} in 1..20 (§4.3: 16)")
        if self.kappa_bits < 0:  # a negative threshold adds |κ| to every token's loss and changes nothing else
            raise ValueError(f"kappa_bits={self.kappa_bits}: must be >= 0 (0 turns the free bits off)")
        self.kappa_nats = self.kappa_bits * math.log(2)  # Eq. 5 compares κ with KL in nats


class Model(nn.Module):
    @property
    def latent_kind(self):
        """What each stochastic pass draws, for the scripts: Z codes, from the prior or the encoder."""
        return "code"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        # §3.3 encoder: a learned query embedding ζ, one non-causal block over the output of block L/2, and a
        # linear readout to H bit logits. §3.2: the post-sampler maps the one-hot Z_t (2^H) to R_t (C). It has no
        # bias: Z_t is one-hot, so W[:, c] + b is just another column; a bias would only duplicate parameters.
        self.zeta = nn.Parameter(torch.empty(config.n_embd))
        self.encoder = Block(config, causal=False)
        self.encoder_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.encoder_readout = nn.Linear(config.n_embd, config.latent_bits, bias=False)
        self.post_sampler = nn.Linear(2 ** config.latent_bits, config.n_embd, bias=False)
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # an imported checkpoint may bring a head of its own (scripts/convert.py)
            self.lm_head.weight = self.tok_emb.weight  # tied embeddings (Press & Wolf 2017)
        cos, sin = precompute_rope(config.head_dim, config.block_size, config.rope_theta, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        nn.init.normal_(self.zeta, mean=0.0, std=0.02)  # like a token embedding
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

    def forward(self, idx, targets=None, latents=None, start_pos=0, generator=None):
        """idx (B, T) token ids -> (logits, loss, stats).

        Z (Algorithm 2): `latents` (B, >= start_pos + T) codes in [0, 2^H) pin it, indexed by absolute position;
        otherwise with targets (training) or at start_pos 0 (generation's prefill) it is sampled from the encoder,
        and at a decode step it is uniform over the 2^H codes, drawn from `generator`.
        With targets: logits (B, T, V) and loss = mean cross-entropy (targets == -1 are ignored), plus the free-bits
        term when the encoder ran. Without: logits of the last position only, (B, 1, V). start_pos > 0 continues a KV
        cache (generate())."""
        B, T = idx.shape
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds block_size={self.config.block_size}")
        if start_pos > 0 and self.blocks[0].attn.kv_cache is None:
            raise ValueError("start_pos > 0 continues a KV cache: setup_kv_cache(), then a call at position 0")
        if latents is not None and latents.size(1) < start_pos + T:
            raise ValueError(f"latents cover {latents.size(1)} positions, need {start_pos + T}")
        pos = start_pos + torch.arange(T, device=idx.device)  # (T,) absolute positions
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, hd) each
        x = self.tok_emb(idx)  # (B, T, C)
        half = self.config.n_layer // 2
        for block in self.blocks[:half]:
            x = block(x, cos, sin, start_pos)
        bit_logits = None
        if latents is not None:
            codes = latents[:, pos]  # (B, T)
        elif targets is not None or start_pos == 0:  # training, or the prefill: Z consistent with the tokens (§3.2)
            bit_logits = self.encode(x, cos, sin)  # (B, T, H)
            codes = sample_codes(bit_logits, generator)  # (B, T)
        else:  # a new token: Z_t uniform (Fig. 1), drawn once; the KV cache keeps its effect on block L/2+1
            codes = torch.randint(2 ** self.config.latent_bits, (B, T), generator=generator, device=idx.device)
        r = self.post_sample(codes, bit_logits)  # (B, T, C)
        # §3.2: block L/2+1 takes queries from X, keys/values from X + R. Its pre-norm sees the sum, RMSNorm(X + R),
        # not RMSNorm(X) + R: Algorithm 2 hands the block in_kv = x + r, and R starts on the scale of the raw stream
        # X (RMS 0.02 both at init), so Z counts from the first step instead of being swamped by unit-RMS RMSNorm(X).
        x = self.blocks[half](x, cos, sin, start_pos, x_kv=x + r)
        for block in self.blocks[half + 1:]:
            x = block(x, cos, sin, start_pos)
        x = self.norm_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None, {}  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if bit_logits is None:
            return logits, loss, {"ce": loss.detach()}
        kl = kl_per_token(bit_logits)  # (B, T) nats, Eq. 4
        # Which Z_t count: Z_t enters block L/2+1's keys/values at position t (§3.2), so it reaches the predictions
        # at positions >= t. It counts while some target at or after t is scored: positions after a row's last scored
        # target (padding) drop out; a masked prompt before scored targets still pays, else the encoder, which reads
        # the whole sequence, could pass the answer through the prompt's Z for free. Like the cross-entropy, both
        # sums are divided by the number of scored targets: with no target masked that is T and free_bits is exactly
        # Eq. 5's (1/T) sum_t max(0, KL_t - κ), and `kl` the mean KL per Z_t (in bits, comparable to κ). Our choice
        # for masked targets (Eq. 5 has none): with n of T scored, each counted Z_t weighs T/n times its Eq. 5 weight
        # (3x for 10 of 30), so the term stays in proportion to the CE it is added to, and `kl` is per scored token.
        scored = targets != -1  # (B, T)
        reach = scored.flip(1).cummax(1).values.flip(1)  # (B, T): a target at some position >= t is scored
        n_pred = scored.sum()
        free_bits = F.relu(kl - self.config.kappa_nats).masked_fill(~reach, 0.0).sum() / n_pred  # Eq. 5
        kl_sum = kl.masked_fill(~reach, 0.0).sum()
        # -ELBO per predicted token: E_Q[-log P(S | Z)] + KL(Q(Z | S) || P(Z)) over the Z_t that reach it (Eq. 3).
        elbo = loss + kl_sum / n_pred
        stats = {"ce": loss.detach(), "kl": (kl_sum / n_pred).detach() / math.log(2), "free_bits": free_bits.detach(),
                 "elbo": elbo.detach()}
        return logits, loss + free_bits, stats

    def encode(self, x, cos, sin):
        """§3.3 / Algorithm 2 lines 7-8: the encoder block's queries are ζ at every position, its keys/values the
        output x (B, T, C) of block L/2; it is non-causal. RoPE on its queries and keys is the only thing that tells
        the positions apart: without it every Z_t would have the same distribution. -> bit logits (B, T, H)"""
        B, T, C = x.shape
        y = self.encoder(self.zeta.expand(B, T, C), cos, sin, 0, x_kv=x)  # (B, T, C)
        return self.encoder_readout(self.encoder_norm(y))  # (B, T, H)

    def post_sample(self, codes, bit_logits=None):
        """R = post_sampler(Z) (B, T, C) for codes (B, T); through the Binary Mapper when the encoder gave them."""
        w = self.post_sampler.weight  # (C, 2^H)
        if bit_logits is None:
            return F.embedding(codes, w.t())  # one-hot Z from the prior or pinned: W Z_t is the column W[:, c_t]
        L = bit_logits.float()  # §3.4 in float32 at least
        if self.config.mapper == "dense":
            return dense_binary_mapper(L, codes, w)
        B, T, H = L.shape
        R = FactoredBinaryMapper.apply(L.view(-1, H), codes.reshape(-1), w, self.config.mapper_chunk)  # (B*T, C)
        return R.view(B, T, -1)

    def encoder_logits(self, idx):
        """Bit logits (B, T, H) of Q(Z | S) for a full sequence idx (B, T): blocks 1..L/2 then the encoder."""
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks[:self.config.n_layer // 2]:
            x = block(x, cos, sin, 0)
        return self.encode(x, cos, sin)

    def posterior(self, idx, generator=None):
        """Z ~ Q(Z | S = idx): codes (B, T) and log Q(Z_t = code | S) (B, T) in nats. For an importance-weighted
        bound, pair it with forward(idx, targets, latents=codes) (log P(S | Z)) and log_prior(codes)."""
        bit_logits = self.encoder_logits(idx)
        codes = sample_codes(bit_logits, generator)
        return codes, log_q_codes(bit_logits, codes)

    def posterior_latents(self, idx, generator=None):
        return self.posterior(idx, generator)[0]  # (B, T)

    def log_prior(self, codes):
        """log P(Z_t = code) = -H log 2 per token (§3.3: uniform prior), shaped like codes."""
        return torch.full(codes.shape, -self.config.latent_bits * math.log(2), device=codes.device)

    @torch.no_grad()
    def sample_latents(self, batch_size, generator=None, prompt=None):
        """Codes (batch_size, block_size) to pin Z in forward() or generate(); share one row across a group.

        prompt None: every Z_t from the uniform prior (§3.3), the prompt's included. prompt (1 or batch_size, T)
        token ids: Z for positions < T consistent with the prompt, sampled from the encoder on the prompt alone
        (§3.2, Algorithm 2: "during ... KV cache pre-filling, Z has to be consistent with the tokens of S already
        fixed, and the sampling is done with the encoder"), as generate(latents=None) does at its prefill; positions
        >= T (new or scored continuation tokens) uniform. Each row is an independent draw (a batch-1 prompt is
        encoded once, its codes drawn batch_size times); encoder codes come first from `generator`, so they equal
        posterior_latents(prompt, generator) drawn from the same state."""
        K, device = 2 ** self.config.latent_bits, self.zeta.device
        if prompt is None:
            return torch.randint(K, (batch_size, self.config.block_size), generator=generator, device=device)
        T = prompt.size(1)
        if prompt.size(0) not in (1, batch_size) or T > self.config.block_size:
            raise ValueError(f"prompt {tuple(prompt.shape)} must be (1 or batch_size={batch_size}, "
                             f"<= block_size={self.config.block_size})")
        bit_logits = self.encoder_logits(prompt.to(device))  # (1 or batch_size, T, H): the prompt alone
        prompt_codes = sample_codes(bit_logits.expand(batch_size, -1, -1), generator)  # (batch_size, T)
        rest = torch.randint(K, (batch_size, self.config.block_size - T), generator=generator, device=device)
        return torch.cat((prompt_codes, rest), dim=1)  # (batch_size, block_size)

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
        """Append max_new_tokens to idx (B, T): one prefill of the prompt, then one cached step per token.

        Z for the prompt comes from the encoder at the prefill, Z for each new token from the uniform prior (§3.2);
        or all of it from `latents` (B, L): sample_latents(B, generator, prompt=idx) pins the same distribution
        (one row repeated over a group shares it), sample_latents() without a prompt draws the prompt's Z uniform
        too, posterior_latents() of a reference copies another sequence's; positions past L get uniform codes. step:
        self's forward unless a script passes a compiled one; tokens and codes are drawn between steps, from
        `generator`."""
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.config.block_size:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} exceeds the context "
                             f"(block_size={self.config.block_size}); shorten the prompt or ask for fewer tokens")
        if latents is not None and latents.size(1) < total:
            extra = torch.randint(2 ** self.config.latent_bits, (B, total - latents.size(1)), generator=generator,
                                  device=idx.device)
            latents = torch.cat((latents.expand(B, -1), extra), dim=1)  # (B, total)
        step = step or self
        self.setup_kv_cache(B, total)
        z = idx.new_zeros(B, total)  # Z at every position, for the decode steps
        if latents is not None:
            z[:, :total] = latents[:, :total]
        try:
            logits, _, _ = self(idx, latents=latents, start_pos=0, generator=generator)  # (B, 1, V)
            for pos in range(T, total):
                idx_next = sample_next_token(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)
                if pos + 1 < total:
                    if latents is None:  # Z_t of a new token: uniform (Fig. 1), drawn once, from the token generator
                        z[:, pos] = torch.randint(2 ** self.config.latent_bits, (B,), generator=generator,
                                                  device=idx.device)
                    logits, _, _ = step(idx_next, latents=z, start_pos=pos)
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

        The encoder block counts as one more layer. ζ is a lookup and the post-sampler is not a plain matmul, so
        both leave N; the Binary Mapper's own work is added instead (K = 2^H codes per token):
        dense: Z W^T forward and backward 6CK, L U^T and its backward 4HK;
        factored: a gather forward, v = W g backward 2CK, its two contractions 4K, the scatter-add into W C."""
        cfg = self.config
        C, H, K = cfg.n_embd, cfg.latent_bits, 2 ** cfg.latent_bits
        n_matmul = self.num_params(non_embedding=True) - self.zeta.numel() - self.post_sampler.weight.numel()
        mapper = 6 * C * K + 4 * H * K if cfg.mapper == "dense" else 2 * C * K + 4 * K + C
        return 6 * n_matmul + 12 * (cfg.n_layer + 1) * cfg.n_head * cfg.head_dim * cfg.block_size + mapper
