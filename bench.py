"""Benchmark training and decoding for the four models at equal size, one table (nanoGPT's bench.py role).

    python bench.py                                            # det, btrans, eve, free at 8 layers, d=256, T=256, B=8
    python bench.py --models=det,free:latent_bits=16,free:latent_bits=16:mapper=dense
    python bench.py --device=cuda --dtype=bfloat16 --compile=True --n_layer=12 --n_embd=768 --block_size=1024 ...
    python bench.py --models=det --peer=nanogpt --n_layer=6 --n_embd=384 --n_head=6 --n_kv_head=6 --vocab_size=65
    python bench.py --models=det,eve --compile_decode=True --decode_contexts=64,   # decode eager and compiled

A model spec is `type[:field=value...]`. Each spec runs in its own process, so its peak memory is its own: CUDA's
max_memory_allocated on a GPU, the process's peak resident set on a CPU (which includes the ~0.3 GB of torch itself).
Decode times are per generated token at a given context length, with the KV cache (generate) and, for contrast,
without (a full forward over the context for every new token); with compile_decode, also with the cached step
compiled (model.compile_decode()), and the seconds its compilation took.

--peer=nanogpt adds nanoGPT's GPT (bias=False, same layers, heads, width, context and vocabulary) to the round robin
and a column of each model's tokens/s over the peer's. Its model.py is read from ../shared/peers/nanogpt/model.py
(MIT), never copied into this repository; --peer=<path> reads another copy. The peer trains with its own
configure_optimizers; it has no KV cache, so its decode columns stay empty.
"""

import ast
import contextlib
import importlib.util
import io
import json
import os
import resource
import subprocess
import sys
import time

import torch

import common
import configurator

models = "det,btrans,eve,free"
n_layer = 8
n_embd = 256
n_head = 4
n_kv_head = 2
vocab_size = 256
block_size = 256  # training sequence length
batch_size = 8
steps = 10  # timed training steps, after `warmup` untimed ones
warmup = 3
repeats = 1  # run every spec this many times, round robin, and keep each one's fastest: a shared CPU is noisy
decode_contexts = (64, 1024)  # positions at which decode time per token is measured
decode_tokens = 16
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() else "float32"
compile = False
compile_decode = False  # also time decoding with the cached step compiled (model.compile_decode())
peer = ""  # "nanogpt" (../shared/peers/nanogpt/model.py) or the path of a nanoGPT-style model.py to time alongside
one = ""  # internal: benchmark this single spec and print its JSON row
# ----------------------------------------------------------------------------------------------------------------
config, _ = configurator.apply(globals())
device_type, autocast = common.autocast(device, dtype)
PEER = "peer"  # the spec of the peer's row
if peer == "nanogpt":
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "peers", "nanogpt", "model.py")
if peer and not os.path.isfile(peer):
    common.die(f"no peer model at {os.path.normpath(peer)}: nanoGPT's model.py is read from "
               f"../shared/peers/nanogpt/model.py, or pass --peer=<path to a nanoGPT model.py>")


def parse_spec(spec):
    model_type, *fields = spec.split(":")
    overrides = {}
    for field in fields:
        key, _, value = field.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (SyntaxError, ValueError):
            overrides[key] = value
    return model_type, overrides


def sync():
    if device_type == "cuda":
        torch.cuda.synchronize()


def build(model_type, overrides, context):
    torch.manual_seed(0)
    if model_type == PEER:
        return build_peer(context).to(device)
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab_size=vocab_size)
    return common.build_model(model_type, {**sizes, **overrides, "block_size": context}).to(device)


def build_peer(context):
    """nanoGPT's GPT at our sizes (it has no GQA: compare with n_kv_head = n_head), and the FLOPs per token of its
    estimate_mfu (6N + 12 L C T, N without the position embedding) as flops_per_token."""
    spec = importlib.util.spec_from_file_location("peer_model", peer)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = module.GPT(module.GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=context,
                                            vocab_size=vocab_size, bias=False, dropout=0.0))
    model.num_params = model.get_num_params
    model.flops_per_token = lambda: 6 * model.get_num_params() + 12 * n_layer * n_embd * context
    return model


def bench_train(model_type, overrides):
    model = build(model_type, overrides, block_size)
    with contextlib.redirect_stdout(io.StringIO()):  # the peer's prints its parameter groups
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
    train_model = torch.compile(model) if compile else model
    x = torch.randint(0, vocab_size, (batch_size, block_size), device=device)
    y = torch.randint(0, vocab_size, (batch_size, block_size), device=device)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        with autocast:
            loss = train_model(x, y)[1]  # (logits, loss, stats); the peer's (logits, loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    dt = (time.perf_counter() - t0) / steps
    return model, dt


@torch.no_grad()
def bench_decode(model_type, overrides, context):
    """ms per generated token at `context`: generate N tokens minus generate 1 (the prefill), over N - 1. -> a dict of
    the cached step's time, a full forward's (no cache), and with compile_decode the compiled step's and its compile
    seconds (the first call's time over a later call's: the first step compiles)."""
    model = build(model_type, overrides, context + decode_tokens).eval()
    prompt = torch.randint(0, vocab_size, (1, context), device=device)

    def generate(n):
        sync()
        t0 = time.perf_counter()
        model.generate(prompt, n, generator=torch.Generator(device).manual_seed(0))
        sync()
        return time.perf_counter() - t0

    def per_token():
        times = {}
        for n in (1, decode_tokens):
            generate(n)  # warm up
            times[n] = generate(n)
        return (times[decode_tokens] - times[1]) / (decode_tokens - 1) * 1000

    row = {f"decode_ms_{context}": per_token()}
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        model(prompt, latents=model.sample_latents(1))  # one full forward per new token without a cache
    sync()
    row[f"nocache_ms_{context}"] = (time.perf_counter() - t0) / 3 * 1000
    if compile_decode:
        model.compile_decode()
        first = generate(2)  # one decode step: it compiles
        row[f"compile_s_{context}"] = first - generate(2)
        row[f"cdecode_ms_{context}"] = per_token()
    return row


def bench_one(spec):
    model_type, overrides = parse_spec(spec)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, dt = bench_train(model_type, overrides)
    tokens_per_s = batch_size * block_size / dt
    peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024
    row = dict(spec=spec, params=model.num_params(), flops_per_token=model.flops_per_token(), step_ms=dt * 1000,
               tokens_per_s=tokens_per_s, peak_mib=peak / 2**20)
    peak_flops = common.peak_flops(device)
    row["mfu"] = model.flops_per_token() * tokens_per_s / peak_flops if peak_flops else None
    del model
    for context in decode_contexts if model_type != PEER else ():
        row.update(bench_decode(model_type, overrides, context))
    return row


if one:
    torch.set_float32_matmul_precision("high")
    print(json.dumps(bench_one(one)))
    sys.exit(0)

best = {}
for _ in range(repeats):
    for spec in models.split(",") + ([PEER] if peer else []):
        args = [f"--{k}={v!r}".replace(" ", "") for k, v in config.items() if k not in ("models", "one", "repeats")]
        proc = subprocess.run([sys.executable, __file__, *args, f"--one={spec}"], capture_output=True, text=True)
        if proc.returncode:
            common.die(f"benchmark of {spec} failed:\n{proc.stderr[-2000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        if spec in best:  # the fastest of each measurement (times: min, throughput: max), the largest peak memory
            row = {k: (max if k in ("peak_mib", "tokens_per_s", "mfu") else min)(v, best[spec][k])
                   if isinstance(v, float) and k in best[spec] else v for k, v in row.items()}
        best[spec] = row
rows = list(best.values())

base = next((r for r in rows if r["spec"] == "det"), rows[0])
peer_row = best.get(PEER)
contexts = decode_contexts
print(f"{device} ({torch.cuda.get_device_name() if device_type == 'cuda' else 'CPU'}), {dtype}, compile={compile}, "
      f"{torch.get_num_threads()} threads; L={n_layer} d={n_embd} T={block_size} B={batch_size} V={vocab_size}; "
      f"best of {repeats} run(s) of {steps} steps" + (f"; peer {os.path.normpath(peer)}" if peer else ""))
header = ["model", "params", "MFLOP/tok", "ms/step", "tok/s", "x det", "flop x det"]
header += ["tok/s x peer"] if peer_row else []
header += ["MFU", "peak MiB"] + [f"dec@{c} ms" for c in contexts] + [f"nocache@{c} ms" for c in contexts]
if compile_decode:
    header += [f"compiled dec@{c} ms" for c in contexts] + [f"compile@{c} s" for c in contexts]
print(" | ".join(header))
for r in rows:
    cell = lambda key, fmt: fmt.format(r[key]) if key in r else "-"  # the peer has no decode measurements
    cells = [r["spec"] if r["spec"] != PEER else "nanoGPT (peer)", f"{r['params'] / 1e6:.2f}M",
             f"{r['flops_per_token'] / 1e6:.1f}", f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['step_ms'] / base['step_ms']:.2f}", f"{r['flops_per_token'] / base['flops_per_token']:.2f}"]
    cells += [f"{r['tokens_per_s'] / peer_row['tokens_per_s']:.3f}"] if peer_row else []
    cells += [f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "-", f"{r['peak_mib']:,.0f}"]
    cells += [cell(f"decode_ms_{c}", "{:.2f}") for c in contexts]
    cells += [cell(f"nocache_ms_{c}", "{:.2f}") for c in contexts]
    if compile_decode:
        cells += [cell(f"cdecode_ms_{c}", "{:.2f}") for c in contexts]
        cells += [cell(f"compile_s_{c}", "{:.1f}") for c in contexts]
    print(" | ".join(cells))
