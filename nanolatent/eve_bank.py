"""EVE's neuron bank with its backward written out, for training: a module swap applied from outside model_eve.py (as
gpt-fast's quantize.py swaps nn.Linear and nanochat's fp8.py is switched on by its training script). It computes what
VariationalMLP.bank computes, to float rounding (tests/test_eve_bank.py holds the two equal in float64, values and
every gradient), keeping 4 tensors of (B, T, D) a layer for the backward where autograd keeps 8, and recomputing the
rest. BENCHMARKS.md has what it gains. It is written for the bank as model_eve.py has it: fused_banks swaps it in under
speedups' rule, after a probe of each bank, so an edited bank, prior or scan (or a subclass's) is what trains."""

import functools

import torch
import torch.nn.functional as F

import model_eve
from nanolatent import speedups

# The token means of the bank's statistics, in the order of NeuronBank's (6, D) stack
MEANS = ("logvar_q", "var_q", "mu2", "sq_dist", "ar", "sigma_q")


def posterior(m, r, eps, lo, hi):
    logvar_q = r.clamp(lo, hi)  # clipped log sigma_q^2
    sigma_q = torch.exp(0.5 * logvar_q)
    return logvar_q, sigma_q, torch.addcmul(m, sigma_q, eps)  # §3.2 mu + sigma_q eps: the innovation e


def readout(m, e, mu_p, c, gain, bias):
    """-> mu_q = m + c h, z = e + c h (B, T, D) (§3.2 q(z | x, h), h = mu_p) and the decoder's d_i . z_i + c_i."""
    mu_q, z = (m, e) if c is None else (torch.addcmul(m, mu_p, c), torch.addcmul(e, mu_p, c))
    B, T, N, dz = *m.shape[:2], *gain.shape
    pre = torch.addcmul(bias, z, gain.view(N)) if dz == 1 else (z.view(B, T, N, dz) * gain).sum(-1) + bias
    return mu_q, z, pre


def scan_(x, a, reverse=False, k=8):
    """In place, model_eve.scan's recurrence h[t] = a h[t-1] + x[t] along dim 1 of x (B, T, D), a (D,); reverse: h[t] =
    a h[t+1] + x[t], from the last position back. NeuronBank owns its buffers, so the scan overwrites them: chunks of
    k positions scanned inside (k - 1 ops over all chunks at once), each chunk's carry from its neighbour (T / k small
    ops), one pass adding a^distance times the carry; the positions past the last whole chunk one at a time. model_eve's
    out-of-place form copies the whole tensor about five times (padding, stacking, the flips of a reverse scan)."""
    B, T, D = x.shape
    n = T // k
    body = x[:, :n * k].view(B, n, k, D)
    powers = a ** torch.arange(1, k + 1, device=a.device, dtype=a.dtype).unsqueeze(1)  # (k, D): a^1 ... a^k
    carried = x.new_zeros(B, n, D)  # the full h next to each chunk: before it (forward), after it (reverse)
    if reverse:
        for t in range(T - 2, n * k - 1, -1):  # the tail first: it feeds the last chunk
            x[:, t].addcmul_(x[:, t + 1], a)
        if n and n * k < T:
            carried[:, -1] = x[:, n * k]
        for i in range(k - 2, -1, -1):
            body[:, :, i].addcmul_(body[:, :, i + 1], a)
        for j in range(n - 2, -1, -1):  # h at chunk j + 1's first position: its own value plus a^k h after it
            carried[:, j] = torch.addcmul(body[:, j + 1, 0], carried[:, j + 1], powers[-1])
        body.addcmul_(carried.unsqueeze(2), powers.flip(0))  # position i is k - i before the next chunk
        return x
    for i in range(1, k):
        body[:, :, i].addcmul_(body[:, :, i - 1], a)
    for j in range(1, n):  # h at chunk j - 1's last position: its own value plus a^k h before it
        carried[:, j] = torch.addcmul(body[:, j - 1, -1], carried[:, j - 1], powers[-1])
    body.addcmul_(carried.unsqueeze(2), powers)  # position i is i + 1 after the chunk before
    for t in range(max(n * k, 1), T):  # the tail, after the last chunk
        x[:, t].addcmul_(x[:, t - 1], a)
    return x


class NeuronBank(torch.autograd.Function):
    """VariationalMLP.bank between its products, element-wise (§3.2, §3.3): from m = w_mu u, r = w_logvar u and eps
    (B, T, D) to the decoder's output y (B, T, N) and the token means the objective reads. Its backward keeps m, r,
    eps and mu_p, and recomputes sigma_q, z, mu_q and the decoder's input."""

    @staticmethod
    def forward(ctx, m, r, eps, mu_p, alpha, b, m0, c, gain, bias, lo, hi):
        """mu_p: a decode step's cached memory (B, 1, D); None: scanned (alpha None: no AR prior). -> y (B, T, N), token
        means (6, D) in MEANS's order ((mu_q - mu_p)^2 twice: the KL's, and L_AR's, whose gradient reaches mu_p
        alone), and the memory at the next position, alpha mu_p(T) + b e(T) (B, D)."""
        logvar_q, sigma_q, e = posterior(m, r, eps, lo, hi)
        ctx.bounds, ctx.scanned = (lo, hi), mu_p is None and alpha is not None
        if ctx.scanned and torch.compiler.is_compiling():  # §3.3 mu_p(t) = alpha mu_p(t-1) + b e(t-1), mu_p(0) = m0
            # compiled: model_eve's out-of-place scan, the form inductor fuses (dynamo breaks its graph at an out=)
            mu_p = model_eve.scan(torch.cat([m0.expand(len(e), 1, -1), b * e[:, :-1]], dim=1), alpha)  # (B, T, D)
        elif ctx.scanned:  # eager: the drive m0, b e(t-1) written into mu_p's buffer and scanned there
            mu_p = torch.empty_like(e)  # (B, T, D)
            mu_p[:, 0] = m0
            torch.mul(e[:, :-1], b, out=mu_p[:, 1:])
            scan_(mu_p, alpha)
        mu_q, z, pre = readout(m, e, mu_p, c, gain, bias)
        sq = (mu_q if mu_p is None else mu_q - mu_p).pow(2).mean((0, 1))
        means = torch.stack([logvar_q.mean((0, 1)), sigma_q.pow(2).mean((0, 1)), mu_q.pow(2).mean((0, 1)), sq, sq,
                             sigma_q.mean((0, 1))])  # (6, D)
        following = None if mu_p is None else alpha * mu_p[:, -1] + b * e[:, -1]  # (B, D)
        ctx.save_for_backward(m, r, eps, mu_p, alpha, b, c, gain, bias)
        return F.silu(pre), means, following

    @staticmethod
    def backward(ctx, grad_y, grad_means, grad_following):
        m, r, eps, mu_p, alpha, b, c, gain, bias = ctx.saved_tensors
        (lo, hi), (B, T, D), (N, dz) = ctx.bounds, m.shape, gain.shape
        logvar_q, sigma_q, e = posterior(m, r, eps, lo, hi)
        mu_q, z, pre = readout(m, e, mu_p, c, gain, bias)
        grad_pre = torch.ops.aten.silu_backward(grad_y, pre)  # (B, T, N)
        grad_e = (grad_pre.unsqueeze(-1) * gain).view(B, T, D)  # through z: z = e + c h
        g = grad_means.unsqueeze(1) / (B * T)  # (6, 1, D): a token mean passes 1 / (B T) of its gradient to each
        dist = mu_q if mu_p is None else mu_q - mu_p
        grad_mu_q = torch.addcmul(2 * g[2] * mu_q, dist, 2 * g[3])  # of mean mu_q^2 and mean (mu_q - mu_p)^2
        grad_mu_p, grad_alpha, grad_b, grad_m0, grad_c = None, None, None, None, None
        if mu_p is not None:
            grad_mu_p = dist * (-2 * (g[3] + g[4]))  # the KL's distance and L_AR (its stop-gradient: mu_p's alone)
            if c is not None:  # c h enters z and mu_q
                through = grad_e + grad_mu_q
                grad_c = (through * mu_p).sum((0, 1))
                grad_mu_p.addcmul_(through, c)
            if alpha is not None:  # the next memory, alpha mu_p(T) + b e(T): e itself, not z
                grad_mu_p[:, -1].addcmul_(grad_following, alpha)
                grad_e[:, -1].addcmul_(grad_following, b)
                grad_alpha, grad_b = (grad_following * mu_p[:, -1]).sum(0), (grad_following * e[:, -1]).sum(0)
        if ctx.scanned:  # back through the scan: the same recurrence in reverse (d drive = reverse scan of d mu_p)
            grad_drive = scan_(grad_mu_p, alpha, reverse=True)  # grad_mu_p is this backward's own
            grad_alpha += (grad_drive[:, 1:] * mu_p[:, :-1]).sum((0, 1))
            grad_b += (grad_drive[:, 1:] * e[:, :-1]).sum((0, 1))
            grad_m0 = grad_drive[:, 0].sum(0)
            grad_e[:, :-1].addcmul_(grad_drive[:, 1:], b)  # e(t) drives mu_p(t + 1)
            grad_mu_p = None  # an output of the scan here, not an input
        grad_sigma = torch.addcmul(g[5], sigma_q, 2 * g[1]).addcmul_(grad_e, eps)
        grad_r = torch.addcmul(g[0], sigma_q, grad_sigma, value=0.5).mul_(logvar_q == r)  # the clip: r in [lo, hi]
        grad_gain = (grad_pre.unsqueeze(-1) * z.view(B, T, N, dz)).sum((0, 1))
        grad_eps = grad_e * sigma_q if ctx.needs_input_grad[2] else None  # the noise's, where it takes one
        return (grad_e + grad_mu_q, grad_r, grad_eps, grad_mu_p, grad_alpha, grad_b, grad_m0, grad_c, grad_gain,
                grad_pre.sum((0, 1)), None, None)


def fused_bank(self, m, r, eps, mu_p=None):
    """VariationalMLP.bank's contract (its arguments, y, the named token means, the next memory) through NeuronBank."""
    cfg = self.config
    prior = (torch.tanh(self.ar_a), self.ar_b, self.prior_m0) if cfg.ar_prior else (None, None, None)
    c = torch.tanh(self.mem_gain) if self.mem_gain is not None else None
    y, means, following = NeuronBank.apply(m, r, eps, mu_p, *prior, c, self.dec_gain, self.dec_bias, cfg.logvar_min,
                                           cfg.logvar_max)  # (B, T, N), (6, D), (B, D) or None
    means = dict(zip(MEANS, means.unbind(0)))
    if not cfg.ar_prior:
        del means["ar"]  # no L_AR without the AR prior
    return y, means, following


def probes(bank):
    """A bank's probes, in its parameters' dtype: 11 positions (a chunk of the scan and part of one) and, with the AR
    prior, a decode step given its memory; log sigma_q^2 drawn past both ends of its clip."""
    cfg, p = bank.config, next(bank.parameters())
    D, lo, hi, g = cfg.n_neurons * cfg.latent_dim, cfg.logvar_min, cfg.logvar_max, torch.Generator().manual_seed(2)

    def draw(T, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(2, T, D, generator=g, dtype=torch.float64)).to(p.device, p.dtype)
    calls = [(T, draw(T), draw(T, (hi - lo) / 2, (hi + lo) / 2), draw(T)) for T in (11, 1)]
    return [(m, r, eps, None if T > 1 else draw(1)) for T, m, r, eps in calls[:1 + bool(cfg.ar_prior)]]


def fused_banks(model, log=print):
    """NeuronBank in place of the bank of every module of `model` that has one (EVE's VariationalMLP; a model
    without is left as it is), under speedups' rule: a bank whose own computation differs (an edited bank, prior or
    scan, a subclass's) keeps it, and one line says so. Parameters and state dict are untouched. train.py applies it
    to every run (BENCHMARKS.md, EVE's training step, has what it gains on a CPU)."""
    banks = [(n, m) for n, m in model.named_modules() if callable(getattr(m, "bank", None))]
    speedups.swap("eve_bank.fused_banks", banks, "bank", lambda m, own: functools.partial(fused_bank, m), probes,
                  train=True, log=log)
    return model
