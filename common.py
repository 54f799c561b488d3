"""What the scripts share: picking a model file, checkpoints, prepared data and tokenizers. Model files never import
this module; they stay self-contained."""

import collections
import contextlib
import ctypes
import dataclasses
import functools
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

MODEL_TYPES = ("det", "eve", "free", "btrans")
GPT2_BPE_ENV = "NANOLATENT_GPT2_BPE"  # path to a gpt2.tiktoken file, used when tiktoken cannot download GPT-2's BPE
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


# Peak dense bf16 tensor throughput by device name, for MFU; None where unknown (and on CPU).
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def peak_flops(device):
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def progress(iterable, desc="", every=10.0, total=None):
    """A progress bar with rate and ETA on a terminal (tqdm comes with datasets). In a log or CI, where a bar would
    be one endless line, a plain line every `every` seconds instead: done/total, elapsed and ETA."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        yield from tqdm(iterable, desc=desc, total=total, leave=False)
        return
    total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    start = last = time.time()
    for i, item in enumerate(iterable):
        yield item
        now = time.time()
        if now - last >= every:
            last = now
            done = f"{i + 1}/{total} ({(i + 1) / total:.0%})" if total else f"{i + 1}"
            eta = f", ETA {(now - start) / (i + 1) * (total - i - 1):.0f} s" if total else ""
            print(f"{desc}: {done}, {now - start:.0f} s elapsed{eta}", file=sys.stderr, flush=True)


def pyplot(who):
    """matplotlib is optional: pyplot for writing files, or one line saying what needs it."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        die(f"{who} needs matplotlib: pip install matplotlib")
    return plt


def append_record(path, record):
    """One JSON object per line (out_dir/metrics.jsonl): what plot.py reads. A full disk is one line; a partial line
    it may leave is dropped with a warning by the next reader."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        die(f"could not append to {path}: {e.strerror or e}{free_space(path)}; free some space or choose another "
            f"out_dir (the checkpoint there, if any, is unchanged)")


def read_records(path):
    """The records of a metrics.jsonl. A partial last line (a crash mid-append) is dropped with a warning, so a log
    never blocks a run or a plot; a broken line before the last is an error naming it."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines):
                die(f"{path} line {i} is not JSON: fix or delete that line")
            print(f"warning: {path} ends in a partial line (a crash mid-write?); it is ignored", file=sys.stderr)
    return records


def keep_records(path, before_iter):
    """Rewrite metrics.jsonl with only the records of iterations before `before_iter` (0: none), atomically."""
    kept = [r for r in read_records(path) if r.get("iter", 0) < before_iter] if os.path.exists(path) else []
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, path)
    except OSError as e:  # a full disk or a read-only folder: the log stays as it was
        with contextlib.suppress(OSError):
            os.remove(tmp)
        die(f"could not write {path}: {e.strerror or e}{free_space(path)}; free some space or choose another out_dir "
            f"(the run there is unchanged)")


def free_space(path):
    """', N MiB free on that disk' for a message about a failed write ('' when the folder is gone)."""
    try:
        return f", {shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free / 2**20:,.0f} MiB free on that disk"
    except OSError:
        return ""


def die(message):
    """One clear line on stderr and exit code 2: the scripts' answer to bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def seeded(seed, *key):
    """A generator for the draws of (seed, *key), non-negative ints: every batch and every noise draw of a run derives
    from its step (and micro-step, process, ...), so a resumed run, or one on another number of processes, draws
    exactly what an uninterrupted single run draws, with no generator state to save."""
    return np.random.default_rng([seed, *key])


def seed_of(seed, *key):
    """An int seed for torch (manual_seed, torch.Generator) from the stream (seed, *key)."""
    return int(seeded(seed, *key).integers(2**62))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device, dtype):
    """(device_type, the context a forward runs in): torch.autocast to bfloat16/float16, or nothing for float32."""
    if dtype not in DTYPES:
        die(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    if DTYPES[dtype] == torch.float32:
        return device_type, contextlib.nullcontext()
    return device_type, torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


@contextlib.contextmanager
def onednn_linears(model, dtype=torch.float32):
    """CPU inference through oneDNN's matrix kernels: inside, every nn.Linear of `model` multiplies by its weight
    reordered into oneDNN's blocked layout (torch.ops.mkldnn, what torch.compile's CPU weight prepacking uses) instead
    of torch's default float32 GEMM, which on our 2-core CPU is 1.2-1.9x slower at decoding shapes (BENCHMARKS.md).
    Results equal F.linear's to float rounding (another summation order), not bit for bit. A weight is reordered at
    its module's first call, and its plain copy released then unless another module shares it (a tied head): inside,
    the packed copy is the weight, so memory stays that of the model. Inference only: no gradients flow through, and
    a called Linear's weight must not be read or changed inside. On leaving, every module is as before, bit for bit
    (the reorder is a permutation). On a GPU, for weights that are not float32, or without oneDNN, nothing
    changes.

    dtype: what the forwards inside run in (evaluate.py --dtype's autocast). bfloat16 packs a bfloat16 copy of each
    weight and casts the inputs to it, as autocast does for F.linear (measured on our AMD EPYC with AVX512-BF16, one
    thread: 0.20 ms against autocast's 0.82 ms for (8, 768) x (768, 3072), 11.7 against 12.3 ms for (2048, 768) x
    (768, 768)); the float32 weights stay, so that leaving restores them bit for bit, and memory is 1.5x the model's.
    float16 (oneDNN has no float16 inner product on CPUs without AVX512-FP16 or AMX-FP16, ours included), or
    bfloat16 where oneDNN lacks it, changes nothing: autocast's own kernels do the products."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    supported = {torch.float32: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    if not (torch.backends.mkldnn.is_available() and linears and supported.get(dtype, False) and all(
            m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in linears)):
        yield model
        return
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed, released = {}, []

    def forward(m, x):
        if m not in packed:  # (out, in), oneDNN's layout
            packed[m] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().to(dtype), None)
            if uses[id(m.weight)] == 1 and dtype == torch.float32:  # nothing else reads it (a Linear never called,
                m.weight.data = m.weight.data.new_empty(0)  # like Free's post_sampler, or a tied embedding, keeps
                released.append(m)  # its plain weight)
        bias = None if m.bias is None else m.bias.detach().to(dtype)
        return onednn_linear(x.to(dtype), packed[m], bias)

    for m in linears:
        m.forward = functools.partial(forward, m)
    try:
        yield model
    finally:
        for m in linears:
            del m.forward  # the class's forward again
        for m in released:
            m.weight.data = packed[m].to_dense()


def onednn_linear(x, weight, bias):
    """F.linear(x, weight, bias) by oneDNN, for a weight packed by onednn_linears or a plain (out, in) one, also a
    strided view such as a transpose (bench.py --linears=True; "none": no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def check_device(device):
    """One line for a device this machine does not have, before any work starts; on the CPU, the thread count."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        die(f"device={device!r} but this machine has no CUDA GPU (or this torch build has no CUDA): use --device=cpu")
    if not str(device).startswith(("cuda", "cpu", "mps")):
        die(f"device must be cpu, cuda, cuda:N or mps, got {device!r}")
    if str(device).startswith("mps") and not torch.backends.mps.is_available():
        die(f"device={device!r} but this machine has no Apple GPU (or this torch build has no MPS): use --device=cpu")
    if str(device).startswith("cuda:") and torch.cuda.is_available():
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            die(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA GPU(s): use cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}")
    if str(device) == "cpu":
        cpu_threads()


_locks = {}  # out_dir's real path -> its open lock file: the locks live as long as the process


def lock_out_dir(out_dir, who):
    """One writer per out_dir: an exclusive flock on out_dir/.lock, released by the OS when the process ends, however
    it ends (kill -9 included), so it is never left held. A second writer stops at once, naming the first. A process
    that holds the lock already (convert.main called twice in one process) keeps it."""
    import fcntl
    refuse_file_out_dir(out_dir)
    if os.path.realpath(out_dir) in _locks:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, ".lock"), "a+")
    except OSError as e:
        die(f"cannot write to out_dir {out_dir}: {e.strerror or e}; choose a writable --out_dir")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        die(f"{out_dir} is in use by {holder}: wait for it to finish, or choose another --out_dir")
    f.seek(0)
    f.truncate()
    f.write(f"{who} (pid {os.getpid()})")
    f.flush()
    _locks[os.path.realpath(out_dir)] = f
    # Only the lock holder writes temporary files here, so any left now are from a writer killed mid-write
    # (kill -9 during a checkpoint save): nobody will rename them, and a checkpoint's is as large as the model.
    stale = [name for name in os.listdir(out_dir) if re.fullmatch(r".+\.tmp\d+", name)]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    if stale:
        print(f"removed {len(stale)} temporary file(s) left in {out_dir} by a writer that was killed: "
              f"{', '.join(sorted(stale))}")


def refuse_file_out_dir(out_dir):
    """out_dir names a run's folder; the path of its ckpt.pt (which sample.py and evaluate.py take) is one line
    naming the folder, not a message about out_dir/ckpt.pt/ckpt.pt."""
    if os.path.isfile(out_dir):
        die(f"--out_dir={out_dir} is a file{' (a checkpoint)' if out_dir.endswith('.pt') else ''}: out_dir is the "
            f"run's folder, --out_dir={os.path.dirname(out_dir) or '.'}")


def release_out_dir(out_dir):
    """Give back lock_out_dir's lock before the process ends: for a writer called as a function (convert.main in
    a notebook or a test), so the process can go on while another writes there."""
    lock = _locks.pop(os.path.realpath(out_dir), None)
    if lock is not None:
        lock.close()  # closing the file releases the flock


RUN_FILES = ("ckpt.pt", "ckpt_meta.pt")  # what makes a folder a run (ckpt_meta.pt: train.py under FSDP)


def refuse_existing_run(out_dir, overwrite, resumable=False):
    """The guard of every script that writes a run into out_dir (train.py from scratch, rlvr.py, convert.py hf and
    gguf): a folder that holds a checkpoint is replaced only with --overwrite=True; otherwise one line and exit 2,
    before anything there is touched. resumable: the writer can continue the run (train.py --init_from=resume)."""
    held = [os.path.join(out_dir, name) for name in RUN_FILES if os.path.exists(os.path.join(out_dir, name))]
    if held and not overwrite:
        die(f"{out_dir} already holds a run ({held[0]}): "
            f"{'continue it with --init_from=resume, ' if resumable else ''}choose another --out_dir, or replace it "
            f"with --overwrite=True")


def refuse_nonempty_dir(dst, overwrite, what="--dst"):
    """The guard of a writer whose output is a whole folder of someone else's format (convert.py to_hf): a file, or
    a folder that holds anything, is written into only with --overwrite=True."""
    if os.path.exists(dst) and not os.path.isdir(dst):
        die(f"{what}={dst} is a file: give a folder to write into")
    held = sorted(os.listdir(dst)) if os.path.isdir(dst) else []
    if held and not overwrite:
        die(f"{what}={dst} is not empty ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): choose an empty or "
            f"new folder, or write into it anyway with --overwrite=True")


def cpu_threads():
    """Threads for torch's CPU kernels. torch takes one per core, which on a machine shared with other work makes
    each thread wait for a core and the run several times slower (measured on a loaded 2-core CPU: README, Shared
    CPUs). Unless OMP_NUM_THREADS says otherwise: the cores not busy when the script starts, at least one."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    idle = cores - round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else cores
    threads = max(1, min(cores, idle))
    torch.set_num_threads(threads)
    return threads


def keep_freed_memory():
    """Keep the memory of freed tensors in the process, for the next training step to reuse (glibc, Linux). glibc's
    malloc returns large freed blocks to the kernel (unmapping them, trimming the heap's top) by thresholds it adapts
    as it runs; a step that frees its activations and allocates them again then faults on their pages, every step:
    det at nanoGPT's Shakespeare shape took 24,000-30,000 page faults and 40-116 ms of system time a step, nanoGPT's
    model 0-6,900 (BENCHMARKS.md). Fixed thresholds of 1 GiB keep freed blocks for reuse, as the jemalloc or tcmalloc
    PyTorch's CPU tuning guide recommends do; the resident memory then stays at its peak between steps.
    -> True when glibc took both settings; False elsewhere (macOS, Windows, musl), where nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return [mallopt(param, 1 << 30) for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)] == [1, 1]


class Stop:
    """SIGINT (Ctrl-C) and SIGTERM (kill, a scheduler's preemption) during a training loop: the handler only notes
    the signal, and the loop, between two whole steps, saves and exits (stopping inside an optimizer step would
    save half an update). A second signal stops at once, without saving: the last checkpoint stays as it is."""

    def __init__(self):
        self.signum = 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        if self.signum:
            print(f"\nstopped by a second {signal.Signals(signum).name} without saving: the last checkpoint is "
                  f"unchanged", file=sys.stderr)
            sys.exit(128 + signum)  # SystemExit: a checkpoint being written removes its temporary file
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving at the end of this step, then stopping (again to stop "
              f"without saving)", flush=True)

    def __bool__(self):
        return bool(self.signum)


# ----------------------------------------------------------------------------------------------------------------
# models


def import_model(model_type):
    if model_type not in MODEL_TYPES:
        die(f"model must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
    return importlib.import_module(f"model_{model_type}")


def config_fields(model_type):
    """{field: default} of model_<type>.Config: the keys a config file may set for that model."""
    fields = dataclasses.fields(import_model(model_type).Config)
    return {f.name: f.default for f in fields if f.init}


def config_dict(config):
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def build_model(model_type, model_values):
    module = import_model(model_type)
    try:
        return module.Model(module.Config(**model_values))
    except ValueError as e:
        die(f"invalid {model_type} model config: {e}")


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """Inside, the in-place initialisers (nn.init.*, Tensor.normal_, uniform_, zero_, fill_) of a meta tensor return
    it untouched: a meta tensor has no values to write, yet torch still runs each draw's shape logic in Python, about
    1 ms a draw (building a 1,000-layer det or free model on the meta device: 6-9 s with the draws, 1.6 s without, on
    our 2-core AMD EPYC under load, 2026-11-25)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        initialiser = getattr(func, "__module__", "") == "torch.nn.init" or getattr(func, "__name__", "") in (
            "normal_", "uniform_", "zero_", "fill_")
        if initialiser and getattr(tensor, "is_meta", False):
            return tensor
        return func(*args, **kwargs)


def meta_model(model_type, model_values):
    """build_model on the meta device, its values never drawn: shapes, parameter counts and FLOPs, no memory."""
    with torch.device("meta"), _NoInitOnMeta():
        return build_model(model_type, model_values)


def transformer_blocks(model):
    """Every Transformer block, whatever holds it (model.blocks, the Free Transformer's encoder): FSDP's units of
    all-gather and reduce-scatter, and the layers of the dry run's activation estimate."""
    return [m for m in model.modules() if type(m).__name__.endswith("Block")]


def saved_shapes(model_type, model_values):
    """{name: shape} of every tensor a checkpoint of this config holds, from a model built on the meta device."""
    return {k: tuple(v.shape) for k, v in meta_model(model_type, model_values).state_dict().items()}


def resume_config(model_type, saved, overrides, out_dir):
    """A resumed run keeps its architecture: the model overrides given with init_from=resume apply when they leave
    every saved tensor's shape unchanged (kappa_bits, sigma, kl_beta, block_size, mapper, ...), and stop the run
    with one line when they would not (n_layer, n_embd, latent_bits, ...)."""
    changed = {k: v for k, v in overrides.items() if saved.get(k) != v}
    if not changed:
        return dict(saved)
    merged = {**saved, **changed}
    before, after = saved_shapes(model_type, saved), saved_shapes(model_type, merged)
    if before != after:
        key = next(k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k))
        die(f"resuming {out_dir} with {', '.join(f'{k}={v!r}' for k, v in changed.items())} would change the shape "
            f"of the saved {key} ({before.get(key)} -> {after.get(key)}); drop that override, or train from scratch "
            f"into another out_dir")
    print(f"resuming with the model overrides {', '.join(f'{k}={v!r}' for k, v in changed.items())} (was "
          f"{', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): no saved tensor changes shape")
    return merged


def memory_plan(planned, batch_size, fsdp, gpus, bytes_per_value=2):
    """(bytes of weights, gradients and AdamW state, bytes of activations, blocks) per process for a model built on
    the meta device. fp32 weights (4 bytes), fp32 gradients (4) and AdamW's two moments (8): 16 bytes per parameter,
    on every process under DDP, a 1/gpus shard under FSDP. Activations saved for the backward pass, in bf16 without
    recomputation: Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models, §4.1) count
    B*T*d*(34 + 5*a*T/d) bytes per layer; flash attention keeps no T x T scores, which leaves 34*B*T*d. Plus the
    logits: B*T*V in bf16 (2) and in float for the loss (4). bytes_per_value=4 (float32) doubles it all."""
    cfg, n_blocks = planned.config, len(transformer_blocks(planned))
    states = 16 * planned.num_params() / (gpus if fsdp else 1)
    B, T, d, V = batch_size, cfg.block_size, cfg.n_embd, cfg.vocab_size
    activations = (34 * B * T * d * n_blocks + 6 * B * T * V) * bytes_per_value / 2
    return states, activations, n_blocks


def check_memory(model_type, model_values, batch_size, device, dtype, fsdp=False, world_size=1):
    """Before allocating anything: one line when the run's weights, gradients, AdamW state and activations (the dry
    run's arithmetic, a lower bound) exceed the memory of this machine (RAM available now) or of the GPU, instead
    of minutes in the allocator and a crash."""
    planned = meta_model(model_type, model_values)
    per_value = 4 if dtype == "float32" else 2
    states, activations, _ = memory_plan(planned, batch_size, fsdp, world_size, per_value)
    if str(device).startswith("cuda"):
        available, where = torch.cuda.mem_get_info(device)[1], f"the GPU ({device})"
    else:
        try:
            with open("/proc/meminfo") as f:
                available = 1024 * next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            return  # not Linux: no figure to compare with
        available /= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes of this node share its RAM
        where = "this machine's available RAM"
    GiB = 2 ** 30
    if states + activations > available:
        die(f"this run needs at least {(states + activations) / GiB:,.1f} GiB ({states / GiB:,.2f} GiB weights, "
            f"gradients and AdamW + {activations / GiB:,.1f} GiB activations at batch_size={batch_size}, "
            f"block_size={planned.config.block_size}) but {where} is {available / GiB:,.1f} GiB: lower batch_size "
            f"(raise gradient_accumulation_steps to keep the tokens per step) or the model; --dry_run=True plans it")


def plan_run(model_type, model_values, batch_size, grad_accum, max_iters, fsdp, device, gpus, mfu):
    """train.py --dry_run: parameters, FLOPs, expected speed and memory per GPU of a config, from a model built on
    the meta device (shapes, no memory)."""
    model_values.setdefault("block_size", config_fields(model_type)["block_size"])
    planned = meta_model(model_type, model_values)
    cfg = planned.config
    n_params, flops = planned.num_params(), planned.flops_per_token()
    peak = peak_flops(device) or PEAK_FLOPS["H100"]  # the GPU here if known, else an H100: 989 TFLOP/s bf16 dense
    tokens_per_s = mfu * peak / flops  # per GPU
    tokens_per_step = grad_accum * batch_size * cfg.block_size  # all GPUs together
    step_s = tokens_per_step / (tokens_per_s * gpus)
    states, activations, n_blocks = memory_plan(planned, batch_size, fsdp, gpus)
    B, T, d, V = batch_size, cfg.block_size, cfg.n_embd, cfg.vocab_size
    GiB = 2 ** 30
    print(f"dry run: {model_type} model, {n_params:,} parameters, {flops / 1e9:.3g} GFLOPs per token (forward + backward)")
    print(f"speed: {tokens_per_s:,.0f} tokens/s per GPU at {mfu:.0%} MFU of {peak / 1e12:.0f} TFLOP/s; "
          f"{gpus} GPU(s), {tokens_per_step:,} tokens per step: {step_s:.3g} s per step, "
          f"{max_iters * step_s / 3600:.3g} h for {max_iters:,} steps, {max_iters * tokens_per_step / 1e9:.3g}B tokens")
    print(f"memory per GPU: {(states + activations) / GiB:.2f} GiB = {states / GiB:.2f} GiB weights, gradients, "
          f"AdamW (16 bytes per parameter, {f'sharded over {gpus} GPUs by FSDP' if fsdp else 'replicated by DDP'}) + "
          f"{activations / GiB:.2f} GiB activations (34*B*T*d per block x {n_blocks} blocks + 6*B*T*V logits, "
          f"B={B}, T={T}, d={d}, V={V})")
    print("  not counted: model-specific activations (EVE's neurons, the Free Transformer's Binary Mapper), the "
          "blocks FSDP gathers, the CUDA context and allocator slack (a few GiB)")


# ----------------------------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(checkpoint, path):
    """Write to a temporary file of this process, then rename: a crash mid-write never leaves a truncated checkpoint
    behind, and two writers never share a temporary file. A write that fails removes its temporary file and stops
    with one line; the previous checkpoint is untouched."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk (torch's writer raises RuntimeError), a read-only folder
        with contextlib.suppress(OSError):
            os.remove(tmp)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1][:200]
        die(f"could not write {path}: {reason}{free_space(path)}; free some space or choose another out_dir "
            f"(the previous checkpoint there, if any, is unchanged)")
    except BaseException:  # interrupted (a second Ctrl-C): no half-written file is left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def checkpoint_path(path):
    return os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path


def load_checkpoint(path, device="cpu"):
    """A checkpoint's dict. Tensors are memory-mapped, not read: asking a checkpoint its model type and config costs
    next to nothing, and a model built from it reads each tensor once."""
    path = checkpoint_path(str(path))
    if not os.path.exists(path):
        die(f"no checkpoint at {path}: train one first (python train.py ...) or point to an existing ckpt.pt")
    if os.path.getsize(path) == 0:
        die(f"checkpoint {path} is empty (a crash before its first write?): retrain, or use another out_dir")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        die(f"checkpoint {path} is unreadable ({type(e).__name__}{': ' + reason if reason else ''}); "
            f"it may be truncated or not a nanolatent checkpoint: retrain, or resume from another out_dir")
    if not isinstance(checkpoint, dict) or not {"model_type", "model_config", "meta"} <= set(checkpoint):
        die(f"{path} is a torch file but not a nanolatent checkpoint (no model_type, model_config and meta): "
            f"point to a ckpt.pt that train.py, rlvr.py or convert.py wrote")
    return checkpoint


def load_model(path, device="cpu", model_type=None, checkpoint=None, **overrides):
    """Model from a checkpoint (read from path unless given), optionally into another model type (a det checkpoint
    into btrans, say). Config fields the target lacks are dropped; parameters new in the target (B-Trans offsets)
    keep their init."""
    checkpoint = checkpoint or load_checkpoint(path, device)
    source_type = checkpoint["model_type"]
    model_type = model_type or source_type
    fields = config_fields(model_type)
    model_values = {k: v for k, v in checkpoint["model_config"].items() if k in fields}
    model_values.update(overrides)
    model = build_model(model_type, model_values)
    try:
        missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
    except RuntimeError as e:  # a tensor of another shape: the overrides or the data changed the architecture
        die(f"checkpoint {checkpoint_path(str(path))} does not fit the {model_type} model asked for: "
            f"{str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e}")
    if unexpected or (missing and model_type == source_type):
        die(f"checkpoint {checkpoint_path(str(path))} ({source_type}) does not fit a {model_type} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if missing:
        # One line with a count: a 30-layer model has 61 B-Trans offsets, which listed in full fill a screen.
        print(f"loaded a {source_type} checkpoint into {model_type}; {len(missing)} new parameters keep their init "
              f"({missing[0]}{f' ... {missing[-1]}' if len(missing) > 1 else ''})")
    return model.to(device), checkpoint


def train_if_missing(out_dir, *train_args):
    """Reproduction scripts train their models on first use: run train.py unless out_dir holds a checkpoint."""
    if not os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        root = os.path.dirname(os.path.abspath(__file__))
        subprocess.run([sys.executable, os.path.join(root, "train.py"), *train_args, f"--out_dir={out_dir}"],
                       check=True)


def repeat_latents(latents, n):
    """Share one draw of latents (batch 1) across n sequences: repeat dim 0 of every tensor inside."""
    return torch.utils._pytree.tree_map(lambda t: t.expand(n, *t.shape[1:]).contiguous(), latents)


# ----------------------------------------------------------------------------------------------------------------
# data and tokenizers

# Named hub datasets: parquet-backed repositories (no loading scripts), their text fields and splits.
HUB_DATASETS = {
    "writingprompts": dict(path="euclaise/writingprompts", fields=("prompt", "story"), train="train", val="validation"),
    "tinystories": dict(path="roneneldan/TinyStories", fields=("text",), train="train", val="validation"),
    "fineweb_edu": dict(path="HuggingFaceFW/fineweb-edu", name="sample-10BT", fields=("text",), train="train",
                        val=None),
}



def data_dir(dataset):
    """data/<dataset> beside this file, or under $NANOLATENT_DATA when set (the tests use a temporary folder)."""
    root = os.environ.get("NANOLATENT_DATA") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    return os.path.join(root, dataset)


def load_meta(dataset):
    path = os.path.join(data_dir(dataset), "meta.json")
    if not os.path.exists(path):
        named = dataset in ("synthetic", "arith", *HUB_DATASETS)  # the names prepare.py makes on its own
        how = (f"`python prepare.py {dataset}`" if named else
               f"`python prepare.py text --input=FILE --name={dataset}` on a local .txt or .jsonl")
        die(f"dataset {dataset!r} is not prepared ({path} is missing): run {how}")
    with open(path) as f:
        return json.load(f)


def load_tokens(dataset, split, meta):
    path = os.path.join(data_dir(dataset), f"{split}.bin")
    if not os.path.exists(path):
        die(f"{path} is missing: run `python prepare.py {dataset}` again")
    if os.path.getsize(path) == 0:  # np.memmap cannot map an empty file
        die(f"{path} is empty (prepared with --val_fraction=0?): prepare {dataset!r} again with a split that holds "
            f"tokens")
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_LEVEL = {**{b: chr(b) for b in _PRINTABLE},
              **{b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}}


def byte_level(token):
    """GPT-2's byte-level spelling of a token's bytes (its encoder.py bytes_to_unicode, the keys of encoder.json and
    the strings of a byte-level BPE's vocab and merges, SmolLM2's GGUF vocabulary included): printable bytes stand
    for themselves, the others for chr(256), chr(257), ... in order."""
    return "".join(map(BYTE_LEVEL.__getitem__, token))


def gpt2_from_file(bpe_file):
    import tiktoken
    import tiktoken.load
    ranks = tiktoken.load.load_tiktoken_bpe(bpe_file)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def gpt2_encoding(bpe_file=None):
    """GPT-2's BPE: from bpe_file when given, else tiktoken's download, else the file named by $NANOLATENT_GPT2_BPE.
    Returns (encoding, the local file used or None)."""
    import tiktoken
    if bpe_file:
        return gpt2_from_file(bpe_file), bpe_file
    try:
        return tiktoken.get_encoding("gpt2"), None
    except Exception as e:
        fallback = os.environ.get(GPT2_BPE_ENV)
        if not fallback:
            die(f"tiktoken could not download GPT-2's BPE ({type(e).__name__}). Offline, point to a local "
                f"gpt2.tiktoken file: --bpe_file=PATH or export {GPT2_BPE_ENV}=PATH "
                f"(the file is openai/whisper's whisper/assets/gpt2.tiktoken)")
        print(f"tiktoken could not download GPT-2's BPE ({type(e).__name__}); using the local file {fallback}")
        return gpt2_from_file(fallback), fallback


def hf_tokenizer(path):
    """A Hugging Face tokenizer.json (a pretrained model's own BPE, recorded by convert.py or prepare.py), read with
    the tokenizers package: an optional dependency, imported only here."""
    if not os.path.exists(path):
        die(f"tokenizer file {path} not found (checkpoints and datasets record it by absolute path): put it back, "
            f"or run convert.py or prepare.py --tokenizer=... again")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        die("a Hugging Face tokenizer needs the tokenizers package: pip install tokenizers")
    return Tokenizer.from_file(path)


def chat_template(meta):
    """The chat template of a run with a Hugging Face tokenizer, or None: chat_template.jinja beside its tokenizer.json
    (transformers 5, convert.py gguf), else tokenizer_config.json's chat_template (older saves)."""
    if meta.get("tokenizer") != "hf":
        return None
    folder = os.path.dirname(meta["tokenizer_file"])
    if os.path.exists(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja")) as f:
            return f.read()
    template = hf_json(meta, "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def hf_json(meta, name):
    """A JSON file kept beside the run's tokenizer.json (tokenizer_config.json, generation_config.json), or {}."""
    path = os.path.join(os.path.dirname(meta["tokenizer_file"]), name) if meta.get("tokenizer") == "hf" else ""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def chat_prompt(meta, text):
    """text as one user message in the run's chat template, ending where the assistant's answer starts: what an
    Instruct model was trained on. Rendered as transformers' apply_chat_template renders it (jinja2 in a sandbox,
    trim_blocks and lstrip_blocks, the special tokens as variables)."""
    template = chat_template(meta)
    if template is None:
        die("--chat=True but the run has no chat template (no chat_template.jinja, nor a chat_template in "
            "tokenizer_config.json, beside its tokenizer.json): prompt it with plain --start, or import an Instruct "
            "model with convert.py hf or gguf")
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    config = hf_json(meta, "tokenizer_config.json")
    specials = {name: (token["content"] if isinstance(token, dict) else token) for name, token in config.items()
                if name.endswith("_token") and token is not None}
    try:
        return env.from_string(template).render(messages=[{"role": "user", "content": text}],
                                                add_generation_prompt=True, **specials)
    except jinja2.exceptions.TemplateError as e:
        die(f"the run's chat template failed on --start: {e}")


def tokenizer(meta):
    """(encode, decode) for a prepared dataset's meta.json."""
    if meta["tokenizer"] == "hf":  # no special tokens added, as lm-evaluation-harness encodes for causal LMs
        tok = hf_tokenizer(meta["tokenizer_file"])
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
    if meta["tokenizer"] == "char":
        stoi = {ch: i for i, ch in enumerate(meta["chars"])}

        def encode(text):
            missing = sorted(set(text) - set(stoi))
            if missing:
                die(f"characters {missing!r} are not in this dataset's vocabulary; use only: {''.join(meta['chars'])!r}")
            return [stoi[ch] for ch in text]
        return encode, lambda ids: "".join(meta["chars"][i] for i in ids)
    bpe_file = meta.get("bpe_file")  # recorded by prepare.py when it used a local file
    encoding, _ = gpt2_encoding(bpe_file if bpe_file and os.path.exists(bpe_file) else None)
    encode = lambda text: encoding.encode(text, allowed_special={"<|endoftext|>"})
    if "token_ids" not in meta:
        return encode, encoding.decode
    token_ids = meta["token_ids"]  # prepare.py --vocab=used: id i is GPT-2's token_ids[i]
    index = {t: i for i, t in enumerate(token_ids)}

    def encode_used(text):
        ids = encode(text)
        missing = [t for t in ids if t not in index]
        if missing:
            die(f"{len(missing)} of the {len(ids)} tokens of {text[:40]!r} ({encoding.decode(missing[:5])!r}...) "
                f"are not in this dataset's vocabulary (prepare.py --vocab=used keeps the {len(token_ids):,} ids its "
                f"text uses); use words from the dataset, or prepare it with --vocab=full")
        return [index[t] for t in ids]
    return encode_used, lambda ids: encoding.decode([token_ids[i] for i in ids])
