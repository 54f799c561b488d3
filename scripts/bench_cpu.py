"""CPU speed beside the models: oneDNN's kernels against torch's GEMM in training, weight layouts for decoding, and
SmolLM2 decoding, prefill and multiple choice against transformers on the same weights (what nanolatent/cpu.py does
and BENCHMARKS.md shows it gains). The models' own speed and memory table is scripts/bench.py.

    python -m scripts.bench_cpu --n_layer=6 --n_embd=384 --n_head=6 --n_kv_head=6 --vocab_size=65 --linears=True
    python -m scripts.bench_cpu --layouts=True --decode_batches=1,2,4,16      # SmolLM2-135M's shapes, the default
    python -m scripts.bench_cpu --src=out-smollm2 --repeats=3                # det against transformers, then memory
    python -m scripts.bench_cpu --src=out-smollm2 --thread_counts="()"       # sample.py's peak memory alone

--linears=True times, at det's shapes for the given sizes (rows of batch_size * block_size tokens), the three matrix
products of each Linear in a training step: x W^T, the input's gradient g W and the weight's gradient g^T x, by
torch's GEMM (F.linear's: MKL on x86) and by oneDNN (torch.ops.mkldnn), in turns, best of `steps` calls after
`warmup`. cpu.LinearFunction takes the faster kernel for each product.

--layouts=True times one decode step's matrix products (every Linear of det at the given sizes, the head included),
at each batch of decode_batches, in each layout cpu.inference_linears lays weights out in and by F.linear on the
plain weights: ms per step, best of `steps` after `warmup`. cpu.inference_linears' choice follows it.

--src=<a det run, e.g. one scripts/convert.py imported> times det against transformers' LlamaForCausalLM built from
the same tensors, in one process, taking turns, at each of thread_counts: greedy decode ms per token at each of
decode_batches (16: sixteen minds), prefill tokens/s and multiple-choice items/s (multiple_choice's score_choices
against one forward over every choice, as lm-evaluation-harness scores), and whether both decode the same greedy
tokens. det runs plain and as sample.py runs it (cpu.inference_linears, laid out for the batch and the thread count;
its prefill and multiple choice as evaluate.py's); --bfloat16=True (the default) adds both models with bfloat16
weights, det as sample.py --dtype=bfloat16 runs it; --compile_decode=True adds det's compiled decode step. Then
sample.py's peak resident memory, in a fresh process, with memory_minds B-Trans minds of the run decoding
memory_new_tokens tokens each (--thread_counts="()": that table alone; --memory_minds=0: without it).
"""

import contextlib
import copy
import os
import subprocess
import sys
import tempfile
import time

import configurator  # before torch: it answers a bare --help from this file's source

import torch
import torch.nn.functional as F

from nanolatent import ckpt, common, cpu, hf_format, models, multiple_choice, tokendata

linears = False  # the three products of det's Linears in a training step, torch's GEMM against oneDNN
layouts = False  # one decode step's products in each layout of cpu.inference_linears, at decode_batches
src = ""  # a det run (folder or ckpt.pt): det against transformers on its weights, and sample.py's memory
n_layer = 30  # det's sizes for --linears and --layouts: SmolLM2-135M's by default
n_embd = 576
n_head = 9
n_kv_head = 3
vocab_size = 49152
block_size = 256  # --linears: rows of batch_size * block_size tokens
batch_size = 8
steps = 10  # --linears, --layouts: timed calls, after `warmup` untimed ones
warmup = 3
keep_freed_memory = True  # --linears: cpu.keep_freed_memory() first, as train.py on a CPU
decode_batches = (1, 16)  # sequences decoded at once (--src: 16 minds)
repeats = 1  # --src: turns of every contender; each figure is its best
thread_counts = (1, 2)  # --src: torch.set_num_threads for each table row (none: the memory table only)
decode_prompt = 64  # --src: prompt tokens before decoding
decode_tokens = 16  # --src: greedy tokens decoded
prefill_tokens = 256  # --src: tokens of the prefill measurement
compile_decode = False  # --src: also det's decode step compiled (sample.py --compile=True)
bfloat16 = True  # --src: also both models with bfloat16 weights (sample.py --dtype=bfloat16)
# --src: multiple-choice items, a jsonl or the hub's 'hellaswag' (offline: the 1,000-item validation sample under
# $NANOLATENT_LOCAL_DATA, on which BENCHMARKS.md's items/s were measured)
mc_file = tokendata.local_data("hellaswag/hellaswag_val_sample1000.jsonl", "hellaswag")
mc_items = 10
memory_minds = 16  # --src: sample.py's peak memory with this many B-Trans minds (0: not measured)
memory_new_tokens = 256  # ... each decoding this many tokens from a decode_prompt-token prompt
# ----------------------------------------------------------------------------------------------------------------
config, _ = configurator.apply(globals())
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sum(map(bool, (linears, layouts, src))) != 1:
    common.die("name one study: --linears=True, --layouts=True or --src=<a det run> (python -m scripts.convert hf "
               "--src=... --out_dir=... imports one)")
if (linears or layouts) and not torch.backends.mkldnn.is_available():
    common.die("--linears and --layouts compare oneDNN's kernels: run them with a torch built with oneDNN (mkldnn)")


def bench_linears():
    """--linears=True: torch's GEMM against oneDNN (cpu.onednn_linear on plain weights) for the three products of
    each Linear shape of det."""
    cfg = dict(n_layer=1, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab_size=vocab_size)
    model = models.build_model("det", {**cfg, "block_size": block_size})
    shapes = {}  # (out, in) -> the Linears of that shape
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), []).append(name.split(".")[-1])
    rows = batch_size * block_size
    print(f"CPU, float32, {torch.get_num_threads()} threads; rows M = B * T = {rows}; best of {steps} calls after "
          f"{warmup}" + ("; freed memory kept (cpu.keep_freed_memory)" if keep_freed_memory else ""))
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


def against_transformers(run):
    """det (from the run's checkpoint) and LlamaForCausalLM (from the same tensors, renamed as scripts/convert.py to_hf
    does) timed in turns, at every thread count: decode ms per token at each batch, prefill tokens/s and HellaSwag
    items/s. Each figure is the best of `repeats` turns; the two models alternate within a turn."""
    import transformers
    checkpoint = ckpt.load_checkpoint(run)
    cfg, state = hf_format.det_state(checkpoint, ckpt.checkpoint_path(run))
    load = lambda: ckpt.load_model(run, "cpu", "det", checkpoint=checkpoint)[0].eval()
    det = load()
    # sample.py's path: det under cpu.inference_linears, laid out for --num_samples=1 and for more (evaluate.py's)
    fast = {1: load(), None: load()}
    half = load() if bfloat16 else None  # sample.py --dtype=bfloat16: the weights in bfloat16, packed as they are
    for p in half.parameters() if bfloat16 else ():
        p.data = p.data.to(torch.bfloat16)
    hf_cfg = transformers.LlamaConfig(**hf_format.hf_config(cfg, "float32", None, None))
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict({theirs: state[ours].float() for ours, theirs in
                                              hf_format.weight_names(cfg)}, strict=False)
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
        print("sample.py flags | seconds | weights MiB | peak resident MiB")
        sample = [sys.executable, os.path.join(ROOT, "sample.py"),
                  f"--out_dir={run}", "--model_type=btrans", f"--minds={memory_minds}", f"--start=FILE:{f.name}",
                  f"--max_new_tokens={memory_new_tokens}", "--temperature=1.0", "--top_k=50", "--device=cpu"]
        # A small parent runs it: a child's peak resident set counts what it inherited before exec, and this process
        # holds two models.
        parent = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        for flags in ("--kernels=fast", "--kernels=plain"):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", parent, *sample, flags], check=True, capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            peak_mib = int(out.stdout.split()[-1]) / 1024  # kB on Linux
            print(f"{flags} | {time.perf_counter() - t0:.0f} | {weights_mib:,.0f} | {peak_mib:,.0f}")


if linears:
    if keep_freed_memory:
        cpu.keep_freed_memory()
    bench_linears()
elif layouts:
    bench_layouts()
else:
    if thread_counts:
        against_transformers(src)
    if memory_minds:
        sample_memory(src)
