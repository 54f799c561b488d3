"""Deterministic Llama-style decoder: the baseline every stochastic model in nanolatent is measured against."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# Building blocks. model_eve.py, model_free.py and model_btrans.py repeat these verbatim, in this order, so the
# files diff cleanly side by side: only what each paper changes shows up in `diff model_det.py model_<x>.py`.


class RMSNormFunction(torch.autograd.Function):
    """F.rms_norm's forward, op for op, with its backward in closed form: torch's CPU rms_norm is composite, so
    autograd goes back through each of its ops (fwd + bwd 11.2 ms against 6.5 ms here at (8, 256, 384), one thread)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()  # float32 at least, as F.rms_norm computes
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        x_hat = xf * rstd  # (..., C)
        ctx.save_for_backward(x_hat, weight, rstd)
        ctx.x_dtype = x.dtype
        return x_hat.type_as(x) * weight

    @staticmethod
    def backward(ctx, grad):
        # y = x_hat * w with x_hat = x * rstd: dx = rstd * (g_hat - x_hat * mean(g_hat * x_hat)) for g_hat = g * w.
        x_hat, weight, rstd = ctx.saved_tensors
        g_hat = (grad * weight).float()
        prod = g_hat * x_hat  # (..., C), reused below for the gain's gradient
        dot = prod.mean(-1, keepdim=True)  # (..., 1)
        grad_w = torch.mul(grad, x_hat, out=prod).sum(tuple(range(grad.dim() - 1)))  # (C,)
        grad_x = g_hat.addcmul_(x_hat, dot, value=-1).mul_(rstd)
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain and no bias (Zhang & Sennrich 2019)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # CUDA has a fused rms_norm kernel, the CPU a composite one: its backward in closed form when there is one
        # to take; without gradients, the same ops without an autograd Function's overhead (2L + 1 a decode step)
        if x.device.type == "cpu" and torch.is_grad_enabled():
            return RMSNormFunction.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


# oneDNN's float32 kernels where they were measured: x86 CPUs with AVX2 or AVX-512 (oneDNN also builds elsewhere)
ONEDNN_CPU = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class LinearFunction(torch.autograd.Function):
    """F.linear for CPU training: the product x W^T and the input's gradient g W by oneDNN (torch.ops.mkldnn, the
    kernel of torch.compile's CPU weight prepacking), the weight's gradient g^T x by torch's GEMM (MKL). At nanoGPT's
    Shakespeare shapes on our AMD CPU, oneDNN takes 7-13% less time than MKL for the first two products, MKL up to
    13% less for the third (bench.py --linears=True). The same values to float32 rounding: another summation order."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # (..., out); "none": no activation

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.size(-1))  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.mkldnn._linear_pointwise(grad, weight.t(), None, "none", [], "")  # (..., in)
        if ctx.needs_input_grad[1]:
            grad_w = grad_2d.t().mm(x.reshape(-1, x.size(-1)))  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)  # (out,)
        return grad_x, grad_w, grad_b


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state dict) whose training products on a CPU go through LinearFunction.
    Without gradients, F.linear: decoding's matrix-vector products were measured through it (BENCHMARKS.md); under
    autocast or torch.compile too (inductor chooses its own kernels)."""

    def forward(self, x):
        if (ONEDNN_CPU and x.device.type == "cpu" and x.dtype == torch.float32 and torch.is_grad_enabled()
                and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
            return LinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def precompute_rope(head_dim, max_len, theta):
    """Rotary position embeddings (Su et al. 2021): channels j and j + hd/2 of a head turn by pos * theta^(-2j/hd).
    Tables of cos and signed sin, one row of hd per position, so apply_rope needs no split of the channels."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (hd/2,)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (max_len, hd/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (max_len, hd) each


def apply_rope(x, cos, sin):
    """x (B, nh, T, hd) rotated by cos, sin (T, hd) of precompute_rope: (x with its halves swapped) * sin + x * cos,
    in float32 as the tables are. The swap is a roll by hd/2: one new tensor, two passes in place, no chunk and cat."""
    return x.roll(x.size(-1) // 2, dims=-1).float().mul_(sin).addcmul_(x, cos).type_as(x)


class KVCache(nn.Module):
    """Preallocated keys/values of one layer, indexed by position (gpt-fast), as long as the sequence: an eager call
    attends over the positions filled so far; a compiled decode step over the whole cache, masked past its query, so
    it has the same shapes at every position (generate() rounds its length up with padded_len)."""

    def __init__(self, batch_size, n_kv_head, max_len, head_dim, device, dtype):
        super().__init__()
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @staticmethod
    def padded_len(n, block_size):
        """A compiled step's cache length for n positions: the next power of two, at least 64, at most block_size.
        A few sizes, so a few compilations, and never a block_size cache (377 MB a sequence at SmolLM2's 8,192)."""
        return min(block_size, max(64, 1 << (n - 1).bit_length()))

    def update(self, start_pos, k, v):
        """Store k, v (B, n_kv, T, hd) at positions start_pos, ..., start_pos + T - 1. -> keys and values (B, n_kv, S,
        hd) and the (T, S) mask of the keys each query sees, or None when it sees them all. start_pos an int (eager):
        S = start_pos + T, the positions filled so far. A (1,) tensor (generate()'s compiled steps): the whole cache."""
        if isinstance(start_pos, int):
            end = start_pos + k.size(2)
            self.k[:, :, start_pos:end] = k
            self.v[:, :, start_pos:end] = v
            pos = torch.arange(start_pos, end, device=k.device)  # (T,)
            mask = None if k.size(2) == 1 else torch.arange(end, device=k.device) <= pos.unsqueeze(1)  # (T, S)
            return self.k[:, :, :end], self.v[:, :, :end], mask
        pos = start_pos + torch.arange(k.size(2), device=k.device)  # (T,)
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        mask = torch.arange(self.k.size(2), device=k.device) <= pos.unsqueeze(1)  # (T, max_len), causal
        return self.k, self.v, mask  # (B, n_kv, max_len, hd) each, (T, max_len)

    def repeat(self, n):
        """Every cached sequence n times over, rows b n, ..., b n + n - 1 continuing sequence b: a prefix computed
        once, then continued n ways (evaluate.py's multiple choice: a context, then each choice against it)."""
        self.k, self.v = self.k.repeat_interleave(n, dim=0), self.v.repeat_interleave(n, dim=0)


class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): n_head query heads share n_kv_head key/value heads."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.wq = Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        self.kv_cache = None  # a KVCache while generate() runs

    def forward(self, x, cos, sin, start_pos):
        B, T, _ = x.shape
        # One matmul per weight: a weight read once per call. Joining wq|wk|wv per call (nanoGPT's c_attn from the
        # weights checkpoints keep apart) copied two thirds of the layer's weights at every decode step; one joined
        # parameter measured no faster on the CPU than separate matmuls (BENCHMARKS.md), and these keep checkpoints.
        q = apply_rope(self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        k = apply_rope(self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2), cos, sin)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd) each
        if self.kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        else:
            k, v, mask = self.kv_cache.update(start_pos, k, v)  # (B, n_kv, S, hd) each, (T, S) or None
            # The rep query heads of a key/value head as rep * T rows of one query: attention reads the cache as it
            # is, where enable_gqa would copy every key/value head rep times at every step.
            rep = self.n_head // self.n_kv_head
            q = q.reshape(B, self.n_kv_head, rep * T, self.head_dim)  # (B, n_kv, rep T, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.repeat(rep, 1))
            y = y.view(B, self.n_head, T, self.head_dim)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, config):
        super().__init__()
        self.w1 = Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w3 = Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w2 = Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # one matmul per weight, as in Attention


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, start_pos):
        x = x + self.attn(self.attn_norm(x), cos, sin, start_pos)
        x = x + self.mlp(self.mlp_norm(x))
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
    ffn_hidden: int = None  # SwiGLU width; None = 8/3 * n_embd rounded up to ffn_multiple_of (Llama)
    ffn_multiple_of: int = 32  # keeps the SwiGLU matmuls on hardware-friendly sizes
    rope_theta: float = 10000.0  # RoPE base frequency (Llama-2 value)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # lm_head shares tok_emb's matrix (Press & Wolf 2017); False: its own, as in TinyLlama
    freeze_embeddings: bool = False  # tok_emb (and a head tied to it) gets no gradient: EVE §1's frozen embeddings
    layer_weights: bool = False  # the head reads a softmax mix of the blocks' outputs (EVE §4.2): EVE's baseline

    def __post_init__(self):
        # Every field is checked here, where a model built from Python meets it too: a ValueError names the field,
        # its value and what is allowed (the scripts print it as one line). First the types: --ffn_hidden=abc or a
        # float('nan') from a config file would otherwise fail deep in the model, or train on NaN.
        for f in self.__dataclass_fields__.values():
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            is_number = lambda v: isinstance(v, (int, float)) and type(v) is not bool
            if f.type is float and is_number(value) or f.type is tuple and type(value) is list:
                value = f.type(value)  # an int (or numpy float) may stand for a float; a JSON config holds lists
                setattr(self, f.name, value)
            numbers = value if f.type is tuple else (value,) if f.type is float else ()
            if type(value) is not f.type or not all(is_number(v) and math.isfinite(v) for v in numbers):
                kind = {tuple: "a tuple of finite numbers", float: "a finite float", int: "an int"}.get(
                    f.type, f"a {f.type.__name__}")
                raise ValueError(f"{f.name}={value!r}: must be {'None or ' if f.default is None else ''}{kind}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_multiple_of",
                     "ffn_hidden"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")
        for name in ("rope_theta", "norm_eps"):  # 0 or less: NaN from the first step (1/theta^0, sqrt(-eps))
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0")
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_embd={self.n_embd} must divide by n_head={self.n_head}, "
                             f"and n_head by n_kv_head={self.n_kv_head}")
        self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ValueError(f"head_dim = n_embd / n_head = {self.head_dim} must be even for RoPE")
        if self.ffn_hidden is None:
            hidden = int(8 * self.n_embd / 3)
            self.ffn_hidden = self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


class Model(nn.Module):
    latent_kind = "none"  # what each stochastic pass draws, for the scripts: nothing here, one pass is all there is

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # an imported checkpoint may bring a head of its own (convert.py)
            self.lm_head.weight = self.tok_emb.weight  # tied embeddings (Press & Wolf 2017)
        self.tok_emb.weight.requires_grad_(not config.freeze_embeddings)  # out of configure_optimizers' groups too
        cos, sin = precompute_rope(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.decode_step = None  # generate()'s one-token step once compile_decode() has compiled it
        # EVE §4.2 head layer weights w_1..w_L (softmax of these logits; uniform at init, the paper gives none).
        self.layer_logits = nn.Parameter(torch.zeros(config.n_layer)) if config.layer_weights else None
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
        Without: logits of the last position only, (B, 1, V). start_pos > 0 only in KV-cache decoding, where
        generate() passes it as a (1,) tensor: a compiled step then serves every position.
        """
        B, T = idx.shape
        if isinstance(start_pos, int):  # generate() checks the length of a tensor start_pos once, for all steps
            if start_pos + T > self.config.block_size:
                raise ValueError(f"sequence of {start_pos + T} tokens exceeds block_size={self.config.block_size}")
            if start_pos > 0 and self.blocks[0].attn.kv_cache is None:
                raise ValueError("start_pos > 0 continues a KV cache: setup_kv_cache(), then a call at position 0")
        pos = start_pos + torch.arange(T, device=idx.device)  # (T,) absolute positions
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, hd) each
        x = self.tok_emb(idx)  # (B, T, C)
        outs = []
        for block in self.blocks:
            x = block(x, cos, sin, start_pos)
            outs.append(x if targets is not None else x[:, [-1], :])
        x = self.norm_f(self.head_input(outs))
        if targets is None:
            return self.lm_head(x), None, {}  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss, {"ce": loss.detach()}

    def head_input(self, outs):
        """The head's input from the blocks' outputs x^(1..L), each (B, T, C). Choice for EVE's head layer weights
        (its §4.2-4.5 report w_1..w_L, which sum to 1): a softmax-weighted mix sum_l w_l x^(l), w =
        softmax(layer_logits), in the manner of ELMo's scalar mix (Peters et al. 2018). Off: x^(L), the last block."""
        if self.layer_logits is None:
            return outs[-1]
        w = F.softmax(self.layer_logits, dim=0).to(outs[-1].dtype)  # (L,)
        return (torch.stack(outs, dim=-1) * w).sum(-1)  # (B, T, C)

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

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, latents=None, generator=None):
        """Append max_new_tokens to idx (B, T): one prefill of the prompt, then one cached step per token, compiled
        after compile_decode(). Tokens are drawn between steps, from `generator`, compiled or not."""
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.config.block_size:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens = {total} exceeds the context "
                             f"(block_size={self.config.block_size}); shorten the prompt or ask for fewer tokens")
        step = self.decode_step or self
        n_cache = total if self.decode_step is None else KVCache.padded_len(total, self.config.block_size)
        self.setup_kv_cache(B, n_cache)
        # a step's position: an int when eager (attention over the positions filled so far), a (1,) tensor when
        # compiled (one graph for every position)
        positions = range(total) if self.decode_step is None else torch.arange(total, device=idx.device).split(1)
        try:
            logits, _, _ = self(idx, start_pos=0)  # (B, 1, V)
            for pos in range(T, total):
                idx_next = sample_next_token(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)
                if pos + 1 < total:
                    logits, _, _ = step(idx_next, start_pos=positions[pos])
        finally:
            self.clear_kv_cache()
        return idx

    def compile_decode(self, mode=None):
        """torch.compile generate()'s one-token step (gpt-fast). The position goes in as a tensor and the KV cache's
        length is the call's prompt + new tokens rounded up (KVCache.padded_len), so every step of a call has the same
        shapes: one compilation per batch size and cache length. On CUDA the mode defaults to "reduce-overhead" (CUDA
        graphs: the step is launch-bound). Prefill and sampling stay eager."""
        if mode is None and self.tok_emb.weight.is_cuda:
            mode = "reduce-overhead"
        self.decode_step = torch.compile(self.forward, mode=mode, fullgraph=True, dynamic=False)
        return self

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay on matrices and embeddings only (>= 2-D), never on norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # The fused kernel updates every tensor in one pass, with no parameter-sized temporaries: on a CPU it is 6x
        # faster than the default foreach path for a 2^16 x 256 matrix (measured), on a GPU the usual choice.
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cpu", "cuda"))

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward), PaLM appendix B as in nanoGPT: 6N for the weights
        (the tied head's matmul included, the embedding lookup not) plus 12 * L * C * T for attention scores."""
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
