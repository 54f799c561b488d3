"""What the scripts share: picking a model file, checkpoints, prepared data and tokenizers. Model files never import
this module; they stay self-contained."""

import contextlib
import dataclasses
import importlib
import json
import os
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
    """One JSON object per line (out_dir/metrics.jsonl): what plot.py reads."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


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
    """One line for a device this machine does not have, before any work starts."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        die(f"device={device!r} but this machine has no CUDA GPU (or this torch build has no CUDA): use --device=cpu")
    if not str(device).startswith(("cuda", "cpu", "mps")):
        die(f"device must be cpu, cuda, cuda:N or mps, got {device!r}")


_locks = []  # open lock files: the locks live as long as the process


def lock_out_dir(out_dir, who):
    """One writer per out_dir: an exclusive flock on out_dir/.lock, released by the OS when the process ends, however
    it ends (kill -9 included), so it is never left held. A second writer stops at once, naming the first."""
    import fcntl
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
    _locks.append(f)


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


def transformer_blocks(model):
    """Every Transformer block, whatever holds it (model.blocks, the Free Transformer's encoder): FSDP's units of
    all-gather and reduce-scatter, and the layers of the dry run's activation estimate."""
    return [m for m in model.modules() if type(m).__name__.endswith("Block")]


def saved_shapes(model_type, model_values):
    """{name: shape} of every tensor a checkpoint of this config holds, from a model built on the meta device."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_model(model_type, model_values).state_dict().items()}


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


def plan_run(model_type, model_values, batch_size, grad_accum, max_iters, fsdp, device, gpus, mfu):
    """train.py --dry_run: parameters, FLOPs, expected speed and memory per GPU of a config, from a model built on
    the meta device (shapes, no memory)."""
    model_values.setdefault("block_size", config_fields(model_type)["block_size"])
    with torch.device("meta"):
        planned = build_model(model_type, model_values)
    cfg = planned.config
    n_params, flops = planned.num_params(), planned.flops_per_token()
    peak = peak_flops(device) or PEAK_FLOPS["H100"]  # the GPU here if known, else an H100: 989 TFLOP/s bf16 dense
    tokens_per_s = mfu * peak / flops  # per GPU
    tokens_per_step = grad_accum * batch_size * cfg.block_size  # all GPUs together
    step_s = tokens_per_step / (tokens_per_s * gpus)
    # fp32 weights (4 bytes), fp32 gradients (4) and AdamW's two moments (8): 16 bytes per parameter, on every GPU
    # under DDP, a 1/gpus shard under FSDP.
    states = 16 * n_params / (gpus if fsdp else 1)
    # Activations saved for the backward pass, in bf16 without recomputation: Korthikanti et al. 2022 (Reducing
    # Activation Recomputation in Large Transformer Models, §4.1) count B*T*d*(34 + 5*a*T/d) bytes per layer; flash
    # attention keeps no T x T scores, which leaves 34*B*T*d. Plus the logits: B*T*V in bf16 (2) and in float for
    # the loss (4).
    B, T, d, V, n_blocks = batch_size, cfg.block_size, cfg.n_embd, cfg.vocab_size, len(transformer_blocks(planned))
    activations = 34 * B * T * d * n_blocks + 6 * B * T * V
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
    behind, and two writers never share a temporary file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a read-only or vanished folder: the previous checkpoint is untouched
        if os.path.exists(tmp):
            os.remove(tmp)
        die(f"could not write {path}: {e.strerror or e}; free some space or choose another out_dir "
            f"(the previous checkpoint there, if any, is unchanged)")


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
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


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
