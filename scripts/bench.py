"""Benchmark training and decoding for the four models at equal size, one table (nanoGPT's scripts/bench.py role).

    python -m scripts.bench                                            # det, btrans, eve, free at 8 layers, d=256, T=256, B=8
    python -m scripts.bench --models=det,free:latent_bits=16,free:latent_bits=16:mapper=dense
    python -m scripts.bench --device=cuda --dtype=bfloat16 --compile=True --n_layer=12 --n_embd=768 --block_size=1024 ...
    python -m scripts.bench --models=det --peer=nanoGPT/model.py --n_layer=6 --n_embd=384 --n_head=6 --n_kv_head=6 --vocab_size=65
    python -m scripts.bench --models=det,eve --compile_decode=True --decode_contexts=64,   # decode eager and compiled
    python -m scripts.bench --peer=transformers --src=out-smollm2 --repeats=2   # det against transformers, same weights
    python -m scripts.bench --models=det --peer=nanoGPT/model.py ... --profile=True   # and each training step op by op
    python -m scripts.bench --peer=transformers --src=out-smollm2 --mc_baseline=HEAD~5   # multiple choice against an older revision
    python -m scripts.bench --n_layer=6 --n_embd=384 --n_head=6 --n_kv_head=6 --vocab_size=65 --linears=True  # GEMM kernels
    python -m scripts.bench --n_layer=30 --n_embd=576 --n_head=9 --n_kv_head=3 --vocab_size=49152 --layouts=True  # SmolLM2

A model spec is `type[:field=value...]`. Each spec runs in its own process, so its peak memory is its own: CUDA's
max_memory_allocated on a GPU, the process's peak resident set on a CPU (which includes the ~0.3 GB of torch itself).
Decode times are per generated token at a given context length, with the KV cache (generate) and, for contrast,
without (a full forward over the context for every new token); with compile_decode, also with the cached step
compiled (torch.compile of the model's forward, as sample.py --compile=True), and the seconds its compilation took.

--peer=<path of a nanoGPT model.py> (git clone https://github.com/karpathy/nanoGPT: nanoGPT/model.py, MIT; never
copied into this repository) adds nanoGPT's GPT (bias=False, same layers, heads, width, context and vocabulary) to the
round robin and a column of each model's tokens/s over the peer's. The peer trains with its own
configure_optimizers and computes as its file does: nn.Linear, torch's default GEMM, where our models train through
cpu.training_kernels on a CPU, as train.py does (oneDNN's products on x86; --cpu_kernels=False: the plain model
files). It has no KV cache, so its decode columns stay empty. On a CPU every model's process keeps its freed memory
as train.py's does (cpu.keep_freed_memory; --keep_freed_memory=False: glibc's default).

--peer=transformers --src=<a det run, e.g. one scripts/convert.py imported> times det against transformers'
LlamaForCausalLM built from the same tensors, in one process, taking turns, at one and two threads: greedy decode
ms per token at batch 1 and 16 (sixteen minds), prefill tokens/s, and multiple-choice items/s (multiple_choice's
score_choices against one forward over every choice, as lm-evaluation-harness scores), and whether both decode the
same greedy tokens. det runs plain and as sample.py runs it (cpu.inference_linears, laid out for the batch and the
thread count; its prefill and multiple choice as evaluate.py's); --bfloat16=True (the default) adds both models with
bfloat16 weights, det as sample.py --dtype=bfloat16 runs it. --compile_decode=True adds det's compiled decode
step. Then sample.py's peak resident memory, in a fresh process, with --memory_minds B-Trans minds of the run
decoding --memory_new_tokens tokens each (--thread_counts="()": that table alone). --mc_baseline=<git revision>
instead times multiple choice against the score_choices of that revision (its multiple_choice.py, or its evaluate.py
where it has none) on the same items and draws: today's through F.linear and through oneDNN (evaluate.py's CPU
default), items/s and the largest score difference from the revision's.

--linears=True times, at det's shapes for the given sizes (rows of batch_size * block_size tokens), the three matrix
products of each Linear in a training step: x W^T, the input's gradient g W and the weight's gradient g^T x, by
torch's GEMM (F.linear's: MKL on x86) and by oneDNN (torch.ops.mkldnn), in turns, best of `steps` calls after
`warmup`. cpu.LinearFunction takes the faster kernel for each product on our CPU (BENCHMARKS.md).

--layouts=True times one decode step's matrix products (every Linear of det at the given sizes, the head included),
at each batch of decode_batches, in each layout cpu.inference_linears lays weights out in and by F.linear on the
plain weights: ms per step, best of `steps` after `warmup`; cpu.inference_linears' choice follows it (BENCHMARKS.md).
"""

import ast
import contextlib
import copy
import importlib.util
import io
import json
import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import configurator
from nanolatent import ckpt, common, cpu, llama, models, multiple_choice, tokendata

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
profile = False  # also each model's training step op by op (torch.profiler: self time per step of the top ops)
profile_ops = 15  # ... how many ops per model
cpu_kernels = True  # CPU training: cpu.training_kernels on our models, as train.py applies them (False: plain files)
keep_freed_memory = True  # CPU: cpu.keep_freed_memory() in each model's process, as train.py (False: glibc's own)
compile_decode = False  # also time decoding with the cached step compiled (as sample.py --compile=True)
bfloat16 = True  # --peer=transformers: also both models with bfloat16 weights (sample.py --dtype=bfloat16)
peer = ""  # the path of a nanoGPT-style model.py to time alongside (or "transformers", below)
one = ""  # internal: benchmark this single spec and print its JSON row
src = ""  # --peer=transformers: the det run (folder or ckpt.pt) whose weights both models get
thread_counts = (1, 2)  # --peer=transformers: torch.set_num_threads for each table row (none: the memory table only)
decode_batches = (1, 16)  # --peer=transformers: sequences decoded at once (16 minds)
decode_prompt = 64  # --peer=transformers: prompt tokens before decoding
prefill_tokens = 256  # --peer=transformers: tokens of the prefill measurement
# --peer=transformers: multiple-choice items, a jsonl or the hub's 'hellaswag' (offline: the 1,000-item validation sample
# under $NANOLATENT_LOCAL_DATA, on which BENCHMARKS.md's items/s were measured)
mc_file = tokendata.local_data("hellaswag/hellaswag_val_sample1000.jsonl", "hellaswag")
mc_items = 10
memory_minds = 16  # --peer=transformers: sample.py's peak memory with this many B-Trans minds (0: not measured)
memory_new_tokens = 256  # ... each decoding this many tokens from a decode_prompt-token prompt
mc_baseline = ""  # --peer=transformers: a git revision whose multiple_choice.score_choices today's is timed against
mc_passes = "det:1,btrans:8"  # ... the models (type:passes; btrans: minds at sigma 0.02, mixture 'sequence')
linears = False  # instead: the three products of det's Linears in a training step, torch's GEMM against oneDNN
layouts = False  # instead: one decode step's products in each layout of cpu.inference_linears, at decode_batches
# ----------------------------------------------------------------------------------------------------------------
config, _ = configurator.apply(globals())
device_type, autocast = common.autocast(device, dtype)
keeps_freed_memory = keep_freed_memory and device_type == "cpu"  # the setting acts on a CPU's malloc only
PEER = "peer"  # the spec of the peer's row
if peer == "transformers" and not src:
    common.die("--peer=transformers needs --src=<a det run>: import one with python -m scripts.convert hf --src=... "
               "--out_dir=...")
if peer and peer != "transformers" and not os.path.isfile(peer):
    common.die(f"no peer model at {os.path.normpath(peer)}: pass --peer=<path to a nanoGPT model.py> (git clone "
               f"https://github.com/karpathy/nanoGPT, then --peer=nanoGPT/model.py)")


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
    return models.build_model(model_type, {**sizes, **overrides, "block_size": context}).to(device)


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
    if device_type == "cpu" and cpu_kernels and not compile and model_type != PEER:
        cpu.training_kernels(model)
    train_model = torch.compile(model) if compile else model
    x = torch.randint(0, vocab_size, (batch_size, block_size), device=device)
    y = torch.randint(0, vocab_size, (batch_size, block_size), device=device)

    def train_step():
        with autocast:
            loss = train_model(x, y)[1]  # (logits, loss, stats); the peer's (logits, loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        train_step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    ops = None
    if profile:  # the same steps again under the profiler: where each model's step goes, op by op
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                train_step()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:profile_ops]
        ops = [(e.key, e.self_cpu_time_total / 1000 / steps, e.count / steps) for e in events]
    return model, dt, ops


@torch.no_grad()
def bench_decode(model_type, overrides, context):
    """ms per generated token at `context`: generate N tokens minus generate 1 (the prefill), over N - 1. -> a dict of
    the cached step's time, a full forward's (no cache), and with compile_decode the compiled step's and its compile
    seconds (the first call's time over a later call's: the first step compiles)."""
    model = build(model_type, overrides, context + decode_tokens).eval()
    prompt = torch.randint(0, vocab_size, (1, context), device=device)

    step = None

    def generate(n):
        sync()
        t0 = time.perf_counter()
        model.generate(prompt, n, generator=torch.Generator(device).manual_seed(0), step=step)
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
        step = torch.compile(model.forward, dynamic=True)  # as sample.py --compile=True
        first = generate(2)  # one decode step: it compiles
        row[f"compile_s_{context}"] = first - generate(2)
        row[f"cdecode_ms_{context}"] = per_token()
    return row


def bench_one(spec):
    model_type, overrides = parse_spec(spec)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, dt, ops = bench_train(model_type, overrides)
    tokens_per_s = batch_size * block_size / dt
    peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024
    row = dict(spec=spec, params=model.num_params(), flops_per_token=model.flops_per_token(), step_ms=dt * 1000,
               tokens_per_s=tokens_per_s, peak_mib=peak / 2**20, ops=ops)
    peak_flops = common.peak_flops(device)
    row["mfu"] = model.flops_per_token() * tokens_per_s / peak_flops if peak_flops else None
    del model
    for context in decode_contexts if model_type != PEER else ():
        row.update(bench_decode(model_type, overrides, context))
    return row


# ----------------------------------------------------------------------------------------------------------------
# --peer=transformers: det against transformers' LlamaForCausalLM on the same weights, in one process


def transformers_peer(run):
    """det (from the run's checkpoint) and LlamaForCausalLM (from the same tensors, renamed as scripts/convert.py to_hf
    does) timed in turns, at every thread count: decode ms per token at each batch, prefill tokens/s and HellaSwag
    items/s. Each figure is the best of `repeats` turns; the two models alternate within a turn."""
    import transformers
    checkpoint = ckpt.load_checkpoint(run)
    cfg, state = llama.det_state(checkpoint, ckpt.checkpoint_path(run))
    load = lambda: ckpt.load_model(run, "cpu", "det", checkpoint=checkpoint)[0].eval()
    det = load()
    # sample.py's path: det under cpu.inference_linears, laid out for --num_samples=1 and for more (evaluate.py's)
    fast = {1: load(), None: load()}
    half = load() if bfloat16 else None  # sample.py --dtype=bfloat16: the weights in bfloat16, packed as they are
    for p in half.parameters() if bfloat16 else ():
        p.data = p.data.to(torch.bfloat16)
    hf_cfg = transformers.LlamaConfig(**llama.hf_config(cfg, "float32", None, None))
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict({theirs: state[ours].float() for ours, theirs in
                                              llama.weight_names(cfg)}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert not cfg.tie_embeddings or hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    hf_half = copy.deepcopy(hf).to(torch.bfloat16) if bfloat16 else None
    encode, _ = tokendata.tokenizer(checkpoint["meta"])
    examples = multiple_choice.load_mc_examples(mc_file, mc_items)
    items = [[multiple_choice.choice_tokens(encode, ex["context"], c) for c in ex["choices"]] for ex in examples]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (max(decode_batches), decode_prompt), generator=g)
    long_prompt = torch.randint(0, cfg.vocab_size, (1, prefill_tokens), generator=g)

    def stamped(fn, stamps):  # fn, recording when each call starts
        def wrapper(*args, **kwargs):
            stamps.append(time.perf_counter())
            return fn(*args, **kwargs)
        return wrapper

    def det_generate(idx, n, step=None, net=det):
        """-> ms per decode step: from the start of the first step after the prefill to the start of the last."""
        stamps = []
        net.forward = stamped(type(net).forward.__get__(net), stamps)  # the eager step and the prefill
        try:
            net.generate(idx, n, temperature=0, step=step and stamped(step, stamps))
        finally:
            del net.forward
        return (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1000

    class Stamps(transformers.StoppingCriteria):  # called once per new token, after its step
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores, **kwargs):
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.size(0), dtype=torch.bool)

    def hf_generate(idx, n, net=hf):
        stamps = Stamps()
        net.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                     pad_token_id=0, stopping_criteria=transformers.StoppingCriteriaList([stamps]))
        return (stamps.stamps[-1] - stamps.stamps[0]) / (len(stamps.stamps) - 1) * 1000

    def det_prefill(net=det):
        net(long_prompt)

    def hf_prefill(net=hf):
        net(long_prompt, use_cache=False, logits_to_keep=1)

    def det_mc(net=det):
        for pairs in items:
            multiple_choice.score_choices(net, pairs, 1, g)

    def hf_mc():  # all choices of an item in one forward over context + choice, as lm-evaluation-harness does
        for pairs in items:
            seqs = [ctx + cont for ctx, cont in pairs]
            L = max(map(len, seqs)) - 1
            x = torch.tensor([s[:-1] + [0] * (L + 1 - len(s)) for s in seqs])
            log_p = F.log_softmax(hf(x, use_cache=False).logits.float(), dim=-1)
            [log_p[i, len(s) - 1 - len(cont):len(s) - 1].gather(-1, torch.tensor(cont)[:, None]).sum().item()
             for i, (s, (_, cont)) in enumerate(zip(seqs, pairs))]

    def timed(fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        return time.perf_counter() - t0, out

    # (name, generate, prefill, multiple choice, the transformers contender its speed is taken against)
    contenders = [("det", det_generate, det_prefill, det_mc, "transformers"),
                  ("transformers", hf_generate, hf_prefill, hf_mc, None),
                  ("det sample.py", lambda idx, n: det_generate(idx, n, net=fast[1 if len(idx) == 1 else None]),
                   lambda: det_prefill(fast[None]), lambda: det_mc(fast[None]), "transformers")]
    if compile_decode:  # det's decode step compiled: the same model, decode rows only
        compiled_step = torch.compile(det.forward, dynamic=True)  # as sample.py --compile=True
        contenders.append(("det compiled", lambda idx, n: det_generate(idx, n, compiled_step), None, None,
                           "transformers"))
    if bfloat16:
        contenders += [("det sample.py bfloat16", lambda idx, n: det_generate(idx, n, net=half),
                        lambda: det_prefill(half), None, "transformers bfloat16"),
                       ("transformers bfloat16", lambda idx, n: hf_generate(idx, n, hf_half),
                        lambda: hf_prefill(hf_half), None, None)]
    same, best = {}, {}
    with torch.no_grad():
        for threads in thread_counts:
            torch.set_num_threads(threads)
            with contextlib.ExitStack() as laid_out:  # sample.py's layouts, which depend on the thread count
                for batch_size, net in fast.items():
                    laid_out.enter_context(cpu.inference_linears(net, batch_size=batch_size))
                if bfloat16:
                    laid_out.enter_context(cpu.inference_linears(half, torch.bfloat16))
                for B in decode_batches:  # greedy tokens side by side, and a warm-up (packing, compilation)
                    for _, gen, *_ in contenders:
                        gen(prompt[:B], 3)
                    ours = det.generate(prompt[:B], decode_tokens, temperature=0)
                    same[threads, B, "sample.py"] = torch.equal(ours, fast[1 if B == 1 else None].generate(
                        prompt[:B], decode_tokens, temperature=0))
                    theirs = hf.generate(prompt[:B], attention_mask=torch.ones_like(prompt[:B]),
                                         max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False,
                                         pad_token_id=0)
                    same[threads, B, "transformers"] = torch.equal(ours, theirs)
                for _, _, prefill, _, _ in contenders:  # lays out what no decode batch above did (evaluate.py's)
                    if prefill:
                        prefill()
                for _ in range(repeats):
                    for name, gen, prefill, mc, _ in contenders:
                        row = {}
                        for B in decode_batches:  # the steps after the prefill, timed between steps
                            row[f"decode ms/token, batch {B}"] = gen(prompt[:B], decode_tokens)
                        if prefill:
                            row[f"prefill tokens/s ({prefill_tokens} tokens)"] = prefill_tokens / timed(prefill)[0]
                        if mc:
                            row[f"HellaSwag items/s ({len(items)} items)"] = len(items) / timed(mc)[0]
                        for key, value in row.items():
                            better = min if key.startswith("decode") else max
                            best[threads, key, name] = better(value, best.get((threads, key, name), value))
    print(f"CPU; {run}: {det.num_params() / 1e6:.1f}M parameters, {cfg.n_layer} layers, d={cfg.n_embd}, "
          f"{cfg.n_head}/{cfg.n_kv_head} heads, vocab {cfg.vocab_size}; transformers {transformers.__version__} "
          f"(sdpa); prompt {decode_prompt} tokens, {decode_tokens} new; best of {repeats}; float32 unless named")
    print("det's greedy tokens equal: " + ", ".join(f"{other}'s at {threads} thread(s), batch {B}: {equal}"
                                                    for (threads, B, other), equal in same.items()))
    names = [name for name, *_ in contenders]
    peers = {name: peer for name, *_, peer in contenders if peer}
    print("threads | measurement | " + " | ".join(names) + " | "
          + " | ".join(f"{name} speed x {peer}" for name, peer in peers.items()))
    for threads, key, name in best:
        if name == "det":
            value = lambda n: best.get((threads, key, n))
            faster = lambda v, p: p / v if key.startswith("decode") else v / p  # > 1: v is faster than its peer p
            speeds = ["-" if value(n) is None else f"{faster(value(n), value(p)):.2f}" for n, p in peers.items()]
            print(f"{threads} | {key} | " + " | ".join("-" if value(n) is None else f"{value(n):,.2f}" for n in names)
                  + " | " + " | ".join(speeds))


def sample_memory(run):
    """sample.py's peak resident memory (a fresh process, one thread) when `memory_minds` B-Trans minds of the run
    decode `memory_new_tokens` tokens each from a `decode_prompt`-token prompt: the user's path, load included."""
    import tempfile
    checkpoint = ckpt.load_checkpoint(run)
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    text = " ".join(ex["context"] for ex in multiple_choice.load_mc_examples(mc_file, 50))
    prompt = decode(encode(text)[:decode_prompt])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in checkpoint["model"].values()}
    weights_mib = sum(storages.values()) / 2**20  # a tied head shares the embedding's storage: counted once
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        print(f"\nsample.py --model_type=btrans --minds={memory_minds}: {len(encode(prompt))}-token prompt, "
              f"{memory_new_tokens} new tokens, one thread")
        print("sample.py flags | seconds | weights MiB | peak resident MiB | weights + 1 GiB | peak within")
        sample = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample.py"),
                  f"--out_dir={run}", "--model_type=btrans", f"--minds={memory_minds}", f"--start=FILE:{f.name}",
                  f"--max_new_tokens={memory_new_tokens}", "--temperature=1.0", "--top_k=50", "--device=cpu"]
        # A small parent runs it: a child's peak resident set counts what it inherited before exec, and this process
        # holds two models.
        parent = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        for flags in ("--onednn=True", "--onednn=False"):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", parent, *sample, flags], check=True, capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            peak_mib = int(out.stdout.split()[-1]) / 1024  # kB on Linux
            print(f"{flags} | {time.perf_counter() - t0:.0f} | {weights_mib:,.0f} | {peak_mib:,.0f} | "
                  f"{weights_mib + 1024:,.0f} | {peak_mib <= weights_mib + 1024}")


def mc_history(run):
    """Multiple-choice items/s of multiple_choice.score_choices at git revision `mc_baseline` against today's (through
    F.linear, and through oneDNN as evaluate.py runs on a CPU), the same items and draws, in turns, best of
    `repeats`, at every thread count; and each one's largest |score - the revision's score|."""
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("multiple_choice.py", "evaluate.py"):  # where the revision's score_choices is
        source = subprocess.run(["git", "show", f"{mc_baseline}:{name}"], cwd=here, capture_output=True, text=True)
        if not source.returncode:
            break
    else:
        common.die(f"--mc_baseline={mc_baseline}: git show found no evaluate.py there ({source.stderr.strip()})")
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(source.stdout)
        f.flush()
        spec = importlib.util.spec_from_file_location(f"evaluate_{mc_baseline}", f.name)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    checkpoint = ckpt.load_checkpoint(run)
    encode, _ = tokendata.tokenizer(checkpoint["meta"])
    print(f"\nmultiple choice, {run}: score_choices at {mc_baseline} against today's; best of {repeats}")
    print("model | passes | items | threads | contender | items/s | x the revision | max |score - revision's|")
    for model_spec in mc_passes.split(","):
        model_type, passes = model_spec.split(":")
        net, fast = (ckpt.load_model(run, "cpu", model_type, checkpoint=checkpoint,
                                     **({"sigma": 0.02} if model_type == "btrans" else {}))[0].eval()
                     for _ in range(2))  # fast: inside cpu.inference_linears throughout, as evaluate.py runs
        mixture = multiple_choice.mixture_for(net, "auto")
        n_items = mc_items if model_type == "det" else max(1, mc_items // 3)
        items = [[multiple_choice.choice_tokens(encode, ex["context"], c) for c in ex["choices"]]
                 for ex in multiple_choice.load_mc_examples(mc_file, n_items)]
        contenders = [(mc_baseline, old, net), ("today, F.linear", multiple_choice, net),
                      ("today, oneDNN (evaluate.py's default)", multiple_choice, fast)]
        with torch.no_grad(), cpu.inference_linears(fast):
            multiple_choice.score_choices(fast, items[0], 1, None)  # each weight packed at its first call: not timed
            for threads in thread_counts:
                torch.set_num_threads(threads)
                best, scores = {}, {}
                for _ in range(repeats):
                    for name, module, model in contenders:
                        t0 = time.perf_counter()
                        draws = [multiple_choice.example_generator(model, 1, i) for i in range(len(items))]
                        scores[name] = [module.score_choices(model, pairs, int(passes), g, mixture=mixture)[0]
                                        for pairs, g in zip(items, draws)]
                        dt = time.perf_counter() - t0
                        best[name] = min(dt, best.get(name, dt))
                reference = torch.tensor(scores[mc_baseline])
                for name, _, _ in contenders:
                    error = (torch.tensor(scores[name]) - reference).abs().max().item()
                    print(f"{model_type} | {passes} | {len(items)} | {threads} | {name} | "
                          f"{len(items) / best[name]:.3f} | {best[mc_baseline] / best[name]:.2f} | {error:.1e}")


def bench_linears():
    """--linears=True: torch's GEMM against oneDNN (cpu.onednn_linear on plain weights) for the three products of
    each Linear shape of det, as the module's docstring says."""
    cfg = dict(n_layer=1, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab_size=vocab_size)
    model = models.build_model("det", {**cfg, "block_size": block_size})
    shapes = {}  # (out, in) -> the Linears of that shape
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), []).append(name.split(".")[-1])
    rows = batch_size * block_size
    print(f"CPU, float32, {torch.get_num_threads()} threads; rows M = B * T = {rows}; best of {steps} calls after "
          f"{warmup}" + ("; freed memory kept (cpu.keep_freed_memory)" if keeps_freed_memory else ""))
    print("Linear | out x in | product | torch GEMM ms | oneDNN ms | torch GF/s | oneDNN GF/s | oneDNN time / torch's")
    for (n_out, n_in), names in shapes.items():
        x, w, g = torch.randn(rows, n_in), torch.randn(n_out, n_in), torch.randn(rows, n_out)
        products = {"x W^T": (lambda: x @ w.t(), lambda: cpu.onednn_linear(x, w, None)),  # forward
                    "g W": (lambda: g @ w, lambda: cpu.onednn_linear(g, w.t(), None)),  # input's gradient
                    "g^T x": (lambda: g.t() @ x, lambda: cpu.onednn_linear(g.t(), x.t(), None))}  # weight's
        for product, kernels in products.items():
            times = [[], []]
            for _ in range(warmup + steps):
                for kernel, kernel_times in zip(kernels, times):
                    t0 = time.perf_counter()
                    kernel()
                    kernel_times.append(time.perf_counter() - t0)
            ms = [min(t[warmup:]) * 1000 for t in times]
            gflop = 2 * rows * n_in * n_out / 1e9
            print(f"{', '.join(names)} | {n_out} x {n_in} | {product} | {ms[0]:.2f} | {ms[1]:.2f} | "
                  f"{gflop / ms[0] * 1e3:.1f} | {gflop / ms[1] * 1e3:.1f} | {ms[1] / ms[0]:.3f}")


def bench_layouts():
    """--layouts=True: one decode step's matrix products (every Linear of det at the given sizes, the tied head
    included, in a step's order, so that each weight comes from memory) by F.linear on the plain weights
    (transformers' kernel), in each layout cpu.inference_linears can lay a weight out in, and through the modules'
    forward: nn.Linear's own and cpu.inference_linears' (its choice for the batch and thread count), at every batch
    of decode_batches."""
    cfg = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab_size=vocab_size)
    model, plain = (models.build_model("det", {**cfg, "block_size": block_size}).eval() for _ in range(2))
    plain.load_state_dict(model.state_dict())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [m.weight.detach() for m in linears]
    blocked = lambda dtype: [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None) for w in weights]
    column_major = lambda w: w.t().contiguous().t()  # (out, in), stored transposed
    layouts = {"F.linear (out, in)": (weights, torch.float32, F.linear),
               "oneDNN blocked": (blocked(torch.float32), torch.float32, cpu.onednn_linear),
               "column-major where out > in": ([column_major(w) if w.size(0) > w.size(1) else w for w in weights],
                                               torch.float32, F.linear),
               "column-major all": ([column_major(w) for w in weights], torch.float32, F.linear)}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        layouts["bfloat16 oneDNN blocked"] = (blocked(torch.bfloat16), torch.bfloat16, cpu.onednn_linear)
    # The modules' forward, a Python call more than the kernels above: nn.Linear as it is, and inside the context
    layouts["nn.Linear"] = ([m for m in plain.modules() if isinstance(m, torch.nn.Linear)], torch.float32,
                            lambda x, m, _: m.forward(x))
    layouts["cpu.inference_linears"] = (linears, torch.float32, lambda x, m, _: m.forward(x))
    step_mib = sum(w.numel() for w in weights) * 4 / 2**20
    print(f"CPU, {torch.get_num_threads()} threads; {len(weights)} products a decode step (L={n_layer} d={n_embd} "
          f"V={vocab_size}, {step_mib:,.0f} MiB of float32 weights); ms per step, best of {steps} after {warmup}")
    print("batch | " + " | ".join(layouts) + " | fastest float32 layout")
    for B in decode_batches:
        ms = {}
        with torch.no_grad(), cpu.inference_linears(model, batch_size=B):  # laid out at the first (warm-up) round
            for _ in range(warmup + steps):
                for name, (laid_out, dtype, product) in layouts.items():
                    xs = [torch.randn(B, w.size(1), dtype=dtype) for w in weights]  # each product's input
                    t0 = time.perf_counter()
                    for x, w in zip(xs, laid_out):
                        product(x, w, None)
                    ms.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        best = {name: min(t[warmup:]) for name, t in ms.items()}
        float32 = [name for name, (_, dtype, _) in layouts.items() if dtype == torch.float32
                   and name not in ("nn.Linear", "cpu.inference_linears")]
        print(f"{B} | " + " | ".join(f"{v:.2f}" for v in best.values()) + f" | {min(float32, key=best.get)}")


if layouts:
    if device_type != "cpu" or not torch.backends.mkldnn.is_available():
        common.die("--layouts=True compares CPU layouts: run it on a CPU with a torch built with oneDNN (mkldnn)")
    bench_layouts()
    sys.exit(0)
if linears:
    if device_type != "cpu" or not torch.backends.mkldnn.is_available():
        common.die("--linears=True compares CPU kernels: run it on a CPU with a torch built with oneDNN (mkldnn)")
    if keeps_freed_memory:
        cpu.keep_freed_memory()
    bench_linears()
    sys.exit(0)
if peer == "transformers" and mc_baseline:
    mc_history(src)
    sys.exit(0)
if peer == "transformers":
    if thread_counts:
        transformers_peer(src)
    if memory_minds:
        sample_memory(src)
    sys.exit(0)
if one:
    torch.set_float32_matmul_precision("high")
    if keeps_freed_memory:
        cpu.keep_freed_memory()  # as train.py does on a CPU, for every model timed, the peer's too
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
      f"best of {repeats} run(s) of {steps} steps" + (f"; peer {os.path.normpath(peer)}" if peer else "")
      + ("; freed memory kept (cpu.keep_freed_memory)" if keeps_freed_memory else "")
      + ("; cpu.training_kernels" if device_type == "cpu" and cpu_kernels and not compile else ""))
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
if profile:  # the top ops of every model's step side by side: self CPU (or host) ms per step, '-' outside its top
    names = [r["spec"] if r["spec"] != PEER else "nanoGPT (peer)" for r in rows]
    per_op = {}
    for r in rows:
        for op, ms, calls in r["ops"]:
            per_op.setdefault(op, {})[r["spec"]] = (ms, calls)
    print(f"\nop (profiled, {steps} steps) | " + " | ".join(f"{n} ms/step | {n} calls/step" for n in names))
    for op, cells in sorted(per_op.items(), key=lambda item: -max(ms for ms, _ in item[1].values())):
        print(f"{op} | " + " | ".join(f"{cells[r['spec']][0]:,.1f} | {cells[r['spec']][1]:g}" if r["spec"] in cells
                                      else "- | -" for r in rows))
