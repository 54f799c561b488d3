"""What every script shares: one-line errors, seeded draws, devices and dtypes, run records, picking and building a
model file, and planning a run's memory. Model files never import this module; they stay self-contained."""

import contextlib
import dataclasses
import importlib
import json
import math
import os
import shutil
import signal
import sys
import time

import numpy as np
import torch

import cpu

MODEL_TYPES = ("det", "eve", "free", "btrans")


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


def earlier_runs(path, settings, key):
    """The runs another invocation of a study wrote to its JSON at `path` with the same settings, by key(run): a seed
    trained at another time joins the table instead of replacing it, and a run analysed before keeps its row without
    being trained again. Written with other settings: none kept."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        earlier = json.load(f)
    if any(earlier.get(name) != value for name, value in settings.items()):
        print(f"{path} was written with other settings: its runs are replaced, not merged")
        return {}
    return {key(r): r for r in earlier["runs"]}


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
        cpu.cpu_threads()


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
            self.exit(128 + signum)  # SystemExit: a checkpoint being written removes its temporary file
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving at the end of this step, then stopping (again to stop "
              f"without saving)", flush=True)

    def __bool__(self):
        return bool(self.signum)

    def exit(self, code):
        """sys.exit(code) once the run is saved, with the default handlers back: a signal during the interpreter's
        exit (atexit callbacks, such as torch's) then ends the process at once, without a traceback."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        sys.exit(code)


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


def typed_values(model_type, model_values):
    """The model values with the types their Config fields declare, before a Config sees them: an int (or numpy
    float) stands for a float, a list (JSON) for a tuple; anything else of the wrong type, or a NaN or infinity, is a
    ValueError naming the field (--ffn_hidden=abc, float('nan') in a config file)."""
    fields = {f.name: f for f in dataclasses.fields(import_model(model_type).Config) if f.init}
    is_number = lambda v: isinstance(v, (int, float)) and type(v) is not bool
    typed = dict(model_values)
    for name, value in model_values.items():
        f = fields.get(name)
        if f is None or value is None and f.default is None:
            continue
        if f.type is float and is_number(value) or f.type is tuple and type(value) is list:
            value = typed[name] = f.type(value)
        numbers = value if f.type is tuple else (value,) if f.type is float else ()
        if type(value) is not f.type or not all(is_number(v) and math.isfinite(v) for v in numbers):
            kind = {tuple: "a tuple of finite numbers", float: "a finite float", int: "an int"}.get(
                f.type, f"a {f.type.__name__}")
            raise ValueError(f"{name}={value!r}: must be {'None or ' if f.default is None else ''}{kind}")
    return typed


def build_model(model_type, model_values):
    module = import_model(model_type)
    try:
        return module.Model(module.Config(**typed_values(model_type, model_values)))
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


def repeat_latents(latents, n):
    """Share one draw of latents (batch 1) across n sequences: repeat dim 0 of the tensor (None: nothing to share)."""
    return None if latents is None else latents.expand(n, *latents.shape[1:]).contiguous()
