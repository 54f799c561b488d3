"""What the scripts share: picking a model file, checkpoints, prepared data and tokenizers. Model files never import
this module; they stay self-contained."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys

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


def progress(iterable, **kwargs):
    """A progress bar with rate and ETA on a terminal, silent in logs and CI (tqdm comes with datasets)."""
    from tqdm import tqdm
    return tqdm(iterable, disable=not sys.stdout.isatty(), **kwargs)


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


def die(message):
    """One clear line on stderr and exit code 2: the scripts' answer to bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


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


def unwrap(model):
    """The plain nn.Module under DDP and torch.compile wrappers: its state_dict keys carry no prefixes."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


# ----------------------------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(checkpoint, path):
    """Write to a temporary file, then rename: a crash mid-write never leaves a truncated checkpoint behind."""
    tmp = f"{path}.tmp"
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


def checkpoint_path(path):
    return os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path


def load_checkpoint(path, device="cpu"):
    path = checkpoint_path(path)
    if not os.path.exists(path):
        die(f"no checkpoint at {path}: train one first (python train.py ...) or point to an existing ckpt.pt")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        die(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"it may be truncated or not a nanolatent checkpoint: retrain, or resume from another out_dir")


def load_model(path, device="cpu", model_type=None, **overrides):
    """Model from a checkpoint, optionally into another model type (a det checkpoint into btrans, say).
    Config fields the target lacks are dropped; parameters new in the target (B-Trans offsets) keep their init."""
    checkpoint = load_checkpoint(path, device)
    source_type = checkpoint["model_type"]
    model_type = model_type or source_type
    fields = config_fields(model_type)
    model_values = {k: v for k, v in checkpoint["model_config"].items() if k in fields}
    model_values.update(overrides)
    model = build_model(model_type, model_values)
    missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
    if unexpected or (missing and model_type == source_type):
        die(f"checkpoint {checkpoint_path(path)} ({source_type}) does not fit a {model_type} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if missing:
        print(f"loaded a {source_type} checkpoint into {model_type}; new parameters keep their init: "
              f"{', '.join(missing)}")
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


def data_dir(dataset):
    """data/<dataset> beside this file, or under $NANOLATENT_DATA when set (the tests use a temporary folder)."""
    root = os.environ.get("NANOLATENT_DATA") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    return os.path.join(root, dataset)


def load_meta(dataset):
    path = os.path.join(data_dir(dataset), "meta.json")
    if not os.path.exists(path):
        die(f"dataset {dataset!r} is not prepared ({path} is missing): run `python prepare.py {dataset}` "
            f"(or `python prepare.py text --input=FILE --name={dataset}` for a local file)")
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
    return (lambda text: encoding.encode(text, allowed_special={"<|endoftext|>"})), encoding.decode
