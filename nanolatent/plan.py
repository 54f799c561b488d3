"""A training run planned before it starts: parameters, FLOPs, speed and memory per GPU (train.py --dry_run), and
one line when a run cannot fit the machine."""

import os

import torch

from nanolatent import models
from nanolatent.common import PEAK_FLOPS, die, peak_flops


def memory_plan(planned, batch_size, fsdp, gpus, bytes_per_value=2):
    """(bytes of weights, gradients and AdamW state, bytes of activations, blocks) per process for a model built on
    the meta device. fp32 weights (4 bytes), fp32 gradients (4) and AdamW's two moments (8): 16 bytes per parameter,
    on every process under DDP, a 1/gpus shard under FSDP. Activations saved for the backward pass, in bf16 without
    recomputation: Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models, §4.1) count
    B*T*d*(34 + 5*a*T/d) bytes per layer; flash attention keeps no T x T scores, which leaves 34*B*T*d. Plus the
    logits: B*T*V in bf16 (2) and in float for the loss (4). bytes_per_value=4 (float32) doubles it all."""
    cfg, n_blocks = planned.config, len(models.transformer_blocks(planned))
    states = 16 * planned.num_params() / (gpus if fsdp else 1)
    B, T, d, V = batch_size, cfg.block_size, cfg.n_embd, cfg.vocab_size
    activations = (34 * B * T * d * n_blocks + 6 * B * T * V) * bytes_per_value / 2
    return states, activations, n_blocks


def check_memory(model_type, model_values, batch_size, device, dtype, fsdp=False, world_size=1):
    """Before allocating anything: one line when the run's weights, gradients, AdamW state and activations (the dry
    run's arithmetic, a lower bound) exceed the memory of this machine (RAM available now) or of the GPU, instead
    of minutes in the allocator and a crash."""
    planned = models.meta_model(model_type, model_values)
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
    model_values.setdefault("block_size", models.config_fields(model_type)["block_size"])
    planned = models.meta_model(model_type, model_values)
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
