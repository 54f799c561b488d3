"""Training speed, memory and MFU, and decoding speed, of the four models at equal size: nanoGPT's bench.py for four
models, with nanoGPT's own model.py beside them when given.

    python -m scripts.bench                                  # det, btrans, eve, free at 8 layers, d=256, T=256, B=8
    python -m scripts.bench --models=det,free:latent_bits=16,free:latent_bits=16:mapper=dense --repeats=3
    python -m scripts.bench --models=det --peer=nanoGPT/model.py --n_layer=6 --n_embd=384 --n_head=6 --n_kv_head=6 \
        --vocab_size=65                                      # det against nanoGPT at its Shakespeare shape
    python -m scripts.bench --device=cuda --dtype=bfloat16 --compile=True --n_layer=12 --n_embd=768 --n_head=12 \
        --n_kv_head=12 --vocab_size=50304 --block_size=1024 --batch_size=16 --peer=nanoGPT/model.py

A model spec is `type[:field=value...]`, with any field of the model's Config. Each spec runs in its own process
(`--one=SPEC` prints its row as JSON), so its peak memory is its own: CUDA's max_memory_allocated on a GPU, the
process's peak resident set on a CPU (torch itself included, about 0.3 GB). --repeats=N runs the specs N times, round
robin, and keeps each one's best: a shared CPU is noisy. A training step is forward, backward and AdamW (the model's
configure_optimizers) on random tokens; MFU is flops_per_token() x tokens/s over the GPU's peak bf16 throughput
(common.PEAK_FLOPS). EVE trains through eve_bank.fused_banks, as in train.py (a spec `eve:bank=plain`: the model file's
bank). On a CPU our models train as train.py runs them, through cpu.training_kernels (--kernels=plain: the plain
model files), and every process keeps its freed memory (cpu.keep_freed_memory; --keep_freed_memory=False: glibc's
default). Decoding is ms per generated token at each context length: with the KV cache (generate), without it (a full
forward over the context per token) and, with --compile_decode=True, with the cached step compiled as sample.py
--compile=True does, beside the seconds its compilation took.

--peer=<a nanoGPT model.py> (git clone https://github.com/karpathy/nanoGPT: nanoGPT/model.py, MIT, never copied here)
adds nanoGPT's GPT at the same sizes (bias=False; it has no grouped-query attention, so compare at n_kv_head = n_head)
and a column of each model's tokens/s over the peer's. It trains with its own configure_optimizers and nn.Linear's
products; it has no KV cache, so its decode columns stay empty. CPU kernels, weight layouts and det against
transformers on the same weights: scripts/bench_cpu.py.
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

import configurator  # before torch: it answers a bare --help from this file's source

import torch

from nanolatent import common, cpu, eve_bank, models as model_files, speedups

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
repeats = 1  # run every spec this many times, round robin, and keep each one's best
decode_contexts = (64, 1024)  # context lengths at which decode time per token is measured (none: no decoding)
decode_tokens = 16
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() else "float32"
compile = False  # torch.compile the training step
compile_decode = False  # also decode with the cached step compiled (sample.py --compile=True)
profile = False  # also each model's training step op by op (torch.profiler: self time per step of its top 15 ops)
kernels = "fast"  # our models train with train.py's speed-ups (cpu.training_kernels, eve_bank); 'plain': the plain files
keep_freed_memory = True  # CPU: cpu.keep_freed_memory() in every process, as in train.py (False: glibc's default)
peer = ""  # the path of a nanoGPT model.py to time beside the models
one = ""  # internal: benchmark this one spec and print its row as JSON
# ----------------------------------------------------------------------------------------------------------------
config, _ = configurator.apply(globals())
configurator.require(config, choices={"kernels": speedups.KERNELS})
speedups.use(kernels)
device_type, autocast = common.autocast(device, dtype)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = "peer"  # the spec of the peer's row
if peer and not os.path.isfile(peer):
    common.die(f"no peer model at {os.path.normpath(peer)}: pass --peer=<path to a nanoGPT model.py> (git clone "
               f"https://github.com/karpathy/nanoGPT, then --peer=nanoGPT/model.py)")
config["peer"] = peer = os.path.abspath(peer) if peer else ""  # each spec's process runs from the repository's root


def timed(fn):
    """Seconds fn() takes, the GPU's queued work included."""
    if device_type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device_type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def build(spec, context):
    """The model of a spec ('free:latent_bits=16' or PEER) with a context of `context` tokens, on the device."""
    torch.manual_seed(0)
    if spec == PEER:
        return build_peer(context).to(device)
    model_type, *fields = spec.split(":")
    overrides = {k: v for k, _, v in (field.partition("=") for field in fields) if k != "bank"}  # bench_train's
    for key, value in overrides.items():
        with contextlib.suppress(SyntaxError, ValueError):  # a number or a bool; else the text (mapper=dense)
            overrides[key] = ast.literal_eval(value)
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab_size=vocab_size)
    return model_files.build_model(model_type, {**sizes, **overrides, "block_size": context}).to(device)


def build_peer(context):
    """nanoGPT's GPT at our sizes, with the FLOPs per token of its estimate_mfu (6N + 12 L C T, N without the
    position embedding) as flops_per_token."""
    spec = importlib.util.spec_from_file_location("peer_model", peer)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = module.GPT(module.GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=context,
                                            vocab_size=vocab_size, bias=False, dropout=0.0))
    model.num_params, model.flops_per_token = model.get_num_params, (
        lambda: 6 * model.get_num_params() + 12 * n_layer * n_embd * context)
    return model


def bench_train(spec):
    """-> (model, seconds per training step, the profiled top ops or None, seconds the speed-ups' probes took)."""
    model = build(spec, block_size)
    with contextlib.redirect_stdout(io.StringIO()):  # the peer prints its parameter groups
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
    t0 = time.perf_counter()  # what train.py's start-up spends applying the speed-ups, each after its probes
    if device_type == "cpu" and not compile and spec != PEER:
        cpu.training_kernels(model)
    if "bank=plain" not in spec.split(":"):  # EVE's neurons: the fused bank, as in train.py
        eve_bank.fused_banks(model)
    probes_s = time.perf_counter() - t0
    train_model = torch.compile(model) if compile else model
    x = torch.randint(0, vocab_size, (batch_size, block_size), device=device)
    y = torch.randint(0, vocab_size, (batch_size, block_size), device=device)

    def train_step():
        with autocast:
            loss = train_model(x, y)[1]  # ours return (logits, loss, stats), the peer (logits, loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        train_step()
    dt = timed(lambda: [train_step() for _ in range(steps)]) / steps
    ops = None
    if profile:  # the same steps again under the profiler: where the step's time goes, op by op
        with torch.profiler.profile() as prof:
            for _ in range(steps):
                train_step()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ops = [(e.key, e.self_cpu_time_total / 1000 / steps, e.count / steps) for e in events]
    return model, dt, ops, probes_s


@torch.no_grad()
def bench_decode(spec, context):
    """ms per generated token after a `context`-token prompt: generate N tokens minus generate 1 (the prefill), over
    N - 1; a full forward per token without the cache; with compile_decode, the compiled step and its compile time
    (its first call over a later one)."""
    model = build(spec, context + decode_tokens).eval()
    prompt = torch.randint(0, vocab_size, (1, context), device=device)
    step = None
    generate = lambda n: timed(lambda: model.generate(prompt, n, generator=torch.Generator(device).manual_seed(0),
                                                      step=step))

    def per_token_ms():
        generate(1), generate(decode_tokens)  # warm up
        return (generate(decode_tokens) - generate(1)) / (decode_tokens - 1) * 1000

    row = {f"decode_ms_{context}": per_token_ms()}
    no_cache = lambda: [model(prompt, latents=model.sample_latents(1)) for _ in range(3)]  # a full forward a token
    row[f"nocache_ms_{context}"] = timed(no_cache) / 3 * 1000
    if compile_decode:
        step = torch.compile(model.forward, dynamic=True)  # as sample.py --compile=True
        first = generate(2)  # its one decode step compiles
        row[f"compile_s_{context}"] = first - generate(2)
        row[f"cdecode_ms_{context}"] = per_token_ms()
    return row


def bench_one(spec):
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, dt, ops, probes_s = bench_train(spec)
    peak = (torch.cuda.max_memory_allocated() if device_type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # kB on Linux
    tokens_per_s = batch_size * block_size / dt
    peak_flops = common.peak_flops(device)
    row = dict(spec=spec, params=model.num_params(), flops_per_token=model.flops_per_token(), step_ms=dt * 1000,
               tokens_per_s=tokens_per_s, peak_mib=peak / 2**20, ops=ops, probes_s=probes_s,
               mfu=model.flops_per_token() * tokens_per_s / peak_flops if peak_flops else None)
    del model
    for context in decode_contexts if spec != PEER else ():
        row.update(bench_decode(spec, context))
    return row


if one:
    torch.set_float32_matmul_precision("high")
    if keep_freed_memory and device_type == "cpu":
        cpu.keep_freed_memory()  # as train.py does on a CPU, for every model timed, the peer's too
    print(json.dumps(bench_one(one)))
    sys.exit(0)

best = {}
for _ in range(repeats):
    for spec in models.split(",") + ([PEER] if peer else []):
        args = [f"--{k}={v!r}".replace(" ", "") for k, v in config.items() if k not in ("models", "repeats", "one")]
        proc = subprocess.run([sys.executable, "-m", "scripts.bench", *args, f"--one={spec}"], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode:
            common.die(f"benchmark of {spec} failed:\n{proc.stderr[-2000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        if spec in best:  # the best of each measurement (times: min; throughput, MFU and peak memory: max)
            row = {k: (max if k in ("peak_mib", "tokens_per_s", "mfu") else min)(v, best[spec][k])
                   if isinstance(v, float) else v for k, v in row.items()}
        best[spec] = row
rows = list(best.values())

base = next((r for r in rows if r["spec"] == "det"), rows[0])
peer_row = best.get(PEER)
name = lambda r: "nanoGPT (peer)" if r["spec"] == PEER else r["spec"]
print(f"{device} ({torch.cuda.get_device_name() if device_type == 'cuda' else 'CPU'}), {dtype}, compile={compile}, "
      f"{torch.get_num_threads()} threads; L={n_layer} d={n_embd} T={block_size} B={batch_size} V={vocab_size}; "
      f"best of {repeats} run(s) of {steps} steps" + (f"; peer {os.path.relpath(peer)}" if peer else "")
      + ("; cpu.training_kernels" if device_type == "cpu" and speedups.enabled and not compile else "")
      + ("; freed memory kept" if device_type == "cpu" and keep_freed_memory else ""))
header = ["model", "params", "MFLOP/tok", "ms/step", "tok/s", "x det time", "x det FLOPs"]
header += ["tok/s x peer"] if peer_row else []
header += ["MFU", "peak MiB", "probes s"]  # probes: the speed-ups' checks at start-up (speedups.py)
header += [f"dec@{c} ms" for c in decode_contexts] + [f"nocache@{c} ms" for c in decode_contexts]
if compile_decode:
    header += [f"compiled dec@{c} ms" for c in decode_contexts] + [f"compile@{c} s" for c in decode_contexts]
print(" | ".join(header))
for r in rows:
    cell = lambda key, fmt: fmt.format(r[key]) if key in r else "-"  # the peer has no decode measurements
    cells = [name(r), f"{r['params'] / 1e6:.2f}M", f"{r['flops_per_token'] / 1e6:.1f}", f"{r['step_ms']:.1f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['step_ms'] / base['step_ms']:.2f}",
             f"{r['flops_per_token'] / base['flops_per_token']:.2f}"]
    cells += [f"{r['tokens_per_s'] / peer_row['tokens_per_s']:.3f}"] if peer_row else []
    cells += [f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "-", f"{r['peak_mib']:,.0f}", f"{r['probes_s']:.2f}"]
    keys = ["decode_ms", "nocache_ms"] + (["cdecode_ms", "compile_s"] if compile_decode else [])
    cells += [cell(f"{key}_{c}", "{:.1f}" if key == "compile_s" else "{:.2f}") for key in keys for c in decode_contexts]
    print(" | ".join(cells))
if profile:  # the top ops of every model's step side by side: self CPU (host) ms per step, '-' outside its top 15
    per_op = {}
    for r in rows:
        for op, ms, calls in r["ops"]:
            per_op.setdefault(op, {})[r["spec"]] = (ms, calls)
    print(f"\nop (profiled, {steps} steps) | " + " | ".join(f"{name(r)} ms/step | calls/step" for r in rows))
    for op, cells in sorted(per_op.items(), key=lambda item: -max(ms for ms, _ in item[1].values())):
        print(f"{op} | " + " | ".join(f"{cells[r['spec']][0]:,.1f} | {cells[r['spec']][1]:g}" if r["spec"] in cells
                                      else "- | -" for r in rows))
