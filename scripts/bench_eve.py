"""EVE's training step against det's, and where EVE's neuron bank spends its time and memory (CPU).

    python -m scripts.bench_eve --repeats=9 --threads=1,2 --pieces=True   # bench.py's default size

Step: det and eve as bench.py builds them (cpu.training_kernels, eve_bank.fused_banks, freed memory kept, fused AdamW)
and eve_plain (model_eve.py's own bank, not fused), a training step of each in turns in one process: median ms, eve /
det, MiB autograd keeps for backward (each storage once, parameters left out) and peak resident MiB of three steps in a
fresh process (bench.py's measure). Pieces: one block's neuron bank as VariationalMLP.forward computes it (det's SwiGLU
for contrast), forward and backward ms in turns and the MiB of new tensors each keeps for backward. BENCHMARKS.md has
our CPU's tables."""

import resource
import statistics
import subprocess
import sys
import time

import configurator  # before torch: it answers a bare --help from this file's source

import torch
import torch.nn.functional as F

import model_det
import model_eve
from nanolatent import cpu, eve_bank

n_layer, n_embd, n_head, n_kv_head, vocab_size, block_size, batch_size = 8, 256, 4, 2, 256, 256, 8  # bench.py's
repeats = 9  # timed turns of each model, and of each piece
threads = (1, 2)  # torch.set_num_threads of each row
pieces = True  # also the piece table
peak = ""  # internal: train this model three steps in this process and print its peak resident MiB
config, _ = configurator.apply(globals())
cpu.keep_freed_memory()
MODELS = {"det": model_det, "eve": model_eve, "eve_plain": model_eve}  # eve_plain: model_eve.py's bank, not fused
SIZES = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab_size=vocab_size,
             block_size=block_size)
x = torch.randint(0, vocab_size, (batch_size, block_size), generator=torch.Generator().manual_seed(0))


def build(name):
    torch.manual_seed(0)
    model = cpu.training_kernels(MODELS[name].Model(MODELS[name].Config(**SIZES)))
    model = model if name == "eve_plain" else eve_bank.fused_banks(model)
    return model, model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), "cpu")


def kept_mib(fn, old=()):
    """fn() -> (its result, MiB of the storages autograd keeps for its backward, each once, none of `old`'s)."""
    old, kept = {t.untyped_storage().data_ptr() for t in old}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in old:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values()) / 2**20


def ms(fn):
    t0 = time.perf_counter(), fn()
    return 1000 * (time.perf_counter() - t0[0])


def train_step(model, opt):
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


if peak:  # a fresh process: its peak resident set is this model's
    model, opt = build(peak)
    for _ in range(3):
        train_step(model, opt)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # ru_maxrss is in KiB on Linux
    sys.exit(0)


def step_table():
    # first, while this process is small: a child's peak resident set counts its parent's at the fork
    peaks = {name: float(subprocess.run([sys.executable, "-m", "scripts.bench_eve", f"--peak={name}"],
                                        capture_output=True, text=True, check=True).stdout) for name in MODELS}
    models = {name: build(name) for name in MODELS}
    kept = {name: kept_mib(lambda: m(x, x)[1], list(m.parameters()))[1] for name, (m, _) in models.items()}
    print(f"training step, L={n_layer} d={n_embd} T={block_size} B={batch_size}, median of {repeats} in turns")
    columns = [f"{name} ms" for name in MODELS] + ["eve / det", "eve_plain / det"]
    columns += [f"{name} kept MiB" for name in MODELS] + [f"{name} peak MiB" for name in MODELS]
    print("threads | " + " | ".join(columns))
    for n in threads:
        torch.set_num_threads(n)
        times = {name: [] for name in models}
        [train_step(*m) for m in models.values()]  # untimed
        for _ in range(repeats):
            for name, m in models.items():
                times[name].append(ms(lambda: train_step(*m)))
        med = {name: statistics.median(times[name]) for name in MODELS}
        row = [f"{med[name]:.0f}" for name in MODELS]
        row += [f"{med[name] / med['det']:.2f}" for name in ("eve", "eve_plain")]
        row += [f"{kept[name]:.0f}" for name in MODELS] + [f"{peaks[name]:.0f}" for name in MODELS]
        print(f"{n} | " + " | ".join(row))


def piece_table():
    """Block 0's bank (AR prior, posterior memory, latent_dim 1), each piece from leaf copies of earlier outputs."""
    eve, det = build("eve")[0].blocks[0].mlp, build("det")[0].blocks[0].mlp
    cfg, B, T = eve.config, batch_size, block_size
    leaf = lambda t: t.detach().requires_grad_()  # noqa: E731
    u = leaf(F.rms_norm(torch.randn(B, T, n_embd), (n_embd,)))
    eps = torch.randn(B, T, cfg.n_latent)
    m, r = leaf(eve.w_mu(u)), leaf(eve.w_logvar(u))
    drive, y = torch.randn(B, T, cfg.n_latent), leaf(torch.randn(B, T, cfg.n_neurons))
    prior = lambda: (torch.tanh(eve.ar_a), eve.ar_b, eve.prior_m0)  # noqa: E731, fresh in each forward
    alpha = torch.tanh(eve.ar_a).detach()

    def plain_bank(m, r, eps):  # the model file's bank (eve's own is the fused one): y and its token means, stacked
        y, means, _ = model_eve.VariationalMLP.bank(eve, m, r, eps)
        return y, torch.stack(list(means.values()))

    rows = {  # piece: (forward, its inputs)
        "posterior heads: w_mu u, w_logvar u": (lambda: (eve.w_mu(u), eve.w_logvar(u)), [u]),
        "eps draw (one layer's)": (lambda: torch.randn(B, T, cfg.n_latent), []),
        "NeuronBank: sigma_q, z, AR prior, decoder, means": (lambda: eve_bank.NeuronBank.apply(
            m, r, eps, None, *prior(), torch.tanh(eve.mem_gain), eve.dec_gain, eve.dec_bias, cfg.logvar_min,
            cfg.logvar_max)[:2], [m, r]),
        "the plain bank (model_eve.py), for contrast": (lambda: plain_bank(m, r, eps), [m, r]),
        "model_eve.scan (the plain bank's)": (lambda: model_eve.scan(drive, alpha), []),
        "the in-place scan (NeuronBank forward)": (lambda: eve_bank.scan_(drive.clone(), alpha), []),
        "and its reverse, in the backward": (lambda: eve_bank.scan_(drive.clone(), alpha, reverse=True), []),
        "w2 y": (lambda: eve.w2(y), [y]),
        "det's SwiGLU, for contrast": (lambda: det(u), [u]),
    }
    print(f"\none block's neuron bank, B={B} T={T} D={cfg.n_latent}, median ms of {repeats} in turns")
    print("threads | piece | forward ms | backward ms | kept MiB")
    for n in threads:
        torch.set_num_threads(n)
        times = {name: ([], []) for name in rows}
        for i in range(repeats + 1):
            for name, (forward, inputs) in rows.items():
                wrt = [*inputs, *eve.parameters(), *det.parameters()]
                fwd, out = ms(forward), forward()
                outs = out if isinstance(out, tuple) else (out,)
                grads = [torch.ones_like(o) for o in outs]
                bwd = ms(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if inputs else 0
                if i:  # the first turn untimed
                    times[name][0].append(fwd), times[name][1].append(bwd)
        for name, (forward, inputs) in rows.items():
            params = [*eve.parameters(), *det.parameters(), *inputs, eps]
            kept = kept_mib(forward, params)[1]
            print(f"{n} | {name} | {statistics.median(times[name][0]):.2f} | {statistics.median(times[name][1]):.2f} "
                  f"| {kept:.1f}")


step_table()
if pieces:
    piece_table()
