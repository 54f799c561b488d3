"""The four model files by their type string: import one, its Config's fields, typed values, a model built (also
on the meta device: shapes, no memory), and what scripts ask of any of them (its blocks, latents shared, embeddings
from a file)."""

import dataclasses
import functools
import importlib
import math
import os

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from nanolatent.common import die


MODEL_TYPES = ("det", "eve", "free", "btrans")


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
    float) stands for a float, a list (JSON) for a tuple; anything else of the wrong type, a NaN or infinity, or an
    int below 1 (a norm_eps or rope_theta not above 0) is a ValueError naming the field (--ffn_hidden=abc,
    float('nan') in a config file, --n_layer=0)."""
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
        if f.type is int and value < 1:  # every int of the four Configs is a size or a count
            raise ValueError(f"{name}={value!r}: must be >= 1")
        if f.type is tuple and isinstance(f.default, tuple) and len(value) != len(f.default):  # a (low, high) band
            raise ValueError(f"{name}={value!r}: must be a tuple of {len(f.default)} numbers")
        if name in ("norm_eps", "rope_theta") and value <= 0:  # shared by all four: RMSNorm's epsilon, RoPE's base
            raise ValueError(f"{name}={value!r}: must be > 0")
    return typed


def build_model(model_type, model_values):
    module = import_model(model_type)
    try:
        return module.Model(module.Config(**typed_values(model_type, model_values)))
    except ValueError as e:
        die(f"invalid {model_type} model config: {e}")


def meta_model(model_type, model_values):
    """build_model on the meta device, its values never drawn: shapes, parameter counts and FLOPs, no memory."""
    with torch.device("meta"):
        return build_model(model_type, model_values)


def load_embeddings(model, path):
    """Copy the (vocab_size, n_embd) matrix of the .npy at path into the model's token embedding (and so a head tied
    to it): train.py's --init_embeddings. Anything else is one line saying what to give."""
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        die(f"init_embeddings={path} {what}: give a .npy of shape (vocab_size, n_embd)")
    try:
        array = np.load(path)  # allow_pickle=False: a file that is not an array is refused, never run
    except (ValueError, OSError, EOFError) as e:
        die(f"init_embeddings={path} is not a .npy array ({str(e).splitlines()[0][:120]}): give one of shape "
            f"(vocab_size, n_embd), written by numpy.save")
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "fiu":  # an .npz archive, strings, objects
        die(f"init_embeddings={path} holds "
            f"{'a .npz archive' if not isinstance(array, np.ndarray) else f'an array of {array.dtype}'}, not "
            f"numbers: give a .npy of shape (vocab_size, n_embd), written by numpy.save")
    embedding = torch.from_numpy(array)
    if embedding.shape != model.tok_emb.weight.shape:
        die(f"init_embeddings={path} holds a {tuple(embedding.shape)} matrix, the model's embedding is "
            f"{tuple(model.tok_emb.weight.shape)} (vocab_size, n_embd): match --n_embd and the dataset")
    with torch.no_grad():
        model.tok_emb.weight.copy_(embedding)


def transformer_blocks(model):
    """Every Transformer block, whatever holds it (model.blocks, the Free Transformer's encoder): FSDP's units of
    all-gather and reduce-scatter, and the layers of the dry run's activation estimate."""
    return [m for m in model.modules() if type(m).__name__.endswith("Block")]


def checkpoint_blocks(model):
    """Activation checkpointing (train.py --activation_checkpointing, torchtitan's "full" mode): every Transformer
    block keeps only its inputs for the backward pass and runs its forward again there, one block at a time. The
    model files stay plain: the block's own forward is wrapped on the instance, so names, state_dict keys and
    FSDP's units are those of the plain model. Noise drawn inside a block (dropout) is drawn again identically:
    checkpoint saves and restores the CPU and CUDA generators (preserve_rng_state). The models' latents (EVE's eps,
    the Free Transformer's Z, B-Trans's offsets) are drawn outside the blocks and passed in, so the recomputation
    sees the same values; EVE's stash of per-unit statistics is overwritten by the same values, never added to.
    Compiled, that stash is an attribute set inside the checkpointed region, which dynamo refuses (the whole forward
    would fall back to eager) unless told to make it in the forward only, as torchtitan does: the recomputation
    has no use for it."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in transformer_blocks(model):
        block.forward = functools.partial(recomputed, block.forward)


def recomputed(forward, *args, **kwargs):
    """forward(*args, **kwargs) under non-reentrant activation checkpointing. A function of ours, not torch's checkpoint
    itself, is the block's forward: block.compile() (train.py under FSDP) compiles the first frame outside torch, and
    checkpoint's own frame is never compiled, which would leave the block eager."""
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def repeat_latents(latents, n):
    """Share one draw of latents (batch 1) across n sequences: repeat dim 0 of the tensor (None: nothing to share)."""
    return None if latents is None else latents.expand(n, *latents.shape[1:]).contiguous()
