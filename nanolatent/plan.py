"""A training run planned before it starts: parameters, FLOPs, speed and memory per GPU (train.py --dry_run), and
one line when a run cannot fit the machine."""

import math
import os

import torch

from nanolatent import models
from nanolatent.common import PEAK_FLOPS, die, peak_flops


def saved_per_token(planned, checkpointing=False, bytes_per_value=2):
    """Bytes autograd saves for the backward pass per token of one forward under bf16 autocast (eager), from the
    shapes: what torch's saved tensors hold, counted once per storage (tests/test_plan.py measures them on the CPU:
    within 1% for all four models at its shapes). Per Transformer block, with d = n_embd, q and kv the query and
    key/value widths, f the SwiGLU width, nh the query heads:
      16 d  two RMSNorms, each keeping its float32 input and normalised output (4 + 4 bytes a value)
      10 d  the bf16 copies autocast makes of a normed input, one per projection reading it (wq, wk, wv; w1, w3)
      6 q + 4 kv + 4 nh  attention: queries after RoPE, its output and wo's input; keys, values; the log-sum-exp
      8 f   SwiGLU: w1 x, w3 x, silu(w1 x) and their product, in bf16
    (Korthikanti et al. 2022 §4.1 count 34 d for GPT's block: autocast's copies and RMSNorm's float32 are the rest.)
    EVE: its neurons (eve_bank.fused_banks, as train.py trains them) in place of the SwiGLU, 14.5 bytes per latent
    coordinate D (4 of them the float32 eps, drawn for every block before the first); its head's layer mix keeps the
    last block's float32 output (4 d, once: the others are the next blocks' inputs); n_samples > 1 multiplies the
    tokens. Free Transformer: the encoder is one more block, and the injection of Z (the middle block's second norm and
    its copies, R, X + R) adds 20.5 d a token. Outside the blocks: the final norm and the head's input (10 d), the bf16
    logits (2 V, held by the caller), the loss's float32 log-probabilities (4 V). checkpointing: a block keeps only its
    float32 input (4 d; EVE also its eps) and one block at a time is recomputed in full. bytes_per_value=4 (float32, no
    autocast): no copies, every bf16 value above at 4 bytes; EVE's and the Free Transformer's own terms doubled, which
    bounds them."""
    cfg = planned.config
    neurons = getattr(cfg, "variational", False)  # EVE's neuron bank (its Config alone has the field; twin: False)
    d, V, nh, n_blocks = cfg.n_embd, cfg.vocab_size, cfg.n_head, len(models.transformer_blocks(planned))
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    x = bytes_per_value / 2  # the bf16 values' scale
    autocast = bytes_per_value == 2  # its bf16 copies of the normed inputs: 5 in a block, 1 for the head
    attention = 16 * d + (10 * d if autocast else 0) + x * (6 * q + 4 * kv) + 4 * nh
    kept = 0  # per block, kept whatever checkpointing does
    if neurons:
        block, kept = attention + x * 10.5 * cfg.n_latent, 4 * cfg.n_latent
    else:
        block = attention + x * 8 * cfg.ffn_hidden
    # the Free Transformer's encoder draws the codes (latent_kind "code"); EVE's head mixes the blocks (layer_weights)
    extra = x * 20.5 * d if planned.latent_kind == "code" else 4 * d if getattr(cfg, "layer_weights", False) else 0
    blocks = n_blocks * (4 * d + kept) + block if checkpointing else n_blocks * (block + kept)
    head = 8 * d + (2 * d if autocast else 0) + x * 2 * V + 4 * V  # final norm, head input, logits, log-probs
    return blocks + extra + head


def saved_bytes(model, idx, targets, autocast_dtype=torch.bfloat16):
    """Measured: (bytes autograd saves for the backward in one training forward, bytes of autocast's weight copies
    among them), each storage counted once (views share it), the parameters themselves left out, the logits the
    forward returns counted. The copies are the saved storages of a weight's shape in autocast_dtype. The
    calibration of saved_per_token, and its test."""
    params = list(model.parameters())
    own = {p.untyped_storage().data_ptr() for p in params}
    shapes = {s for p in params if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(t.shape), t.dtype))
        return t

    autocast = torch.autocast(idx.device.type, autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        logits, _, _ = model(idx, targets)
    copies = sum(n for n, shape, dtype in seen.values()
                 if dtype == autocast_dtype and shape in shapes and n == dtype.itemsize * math.prod(shape))
    return sum(n for n, _, _ in seen.values()) - copies + logits.nbytes, copies


def memory_plan(planned, batch_size, fsdp, gpus, bytes_per_value=2, checkpointing=False):
    """{term: bytes} per process for a model built on the meta device:
    states      fp32 weights (4 bytes a parameter), fp32 gradients (4) and AdamW's two moments (8), on every process
                under DDP, a 1/gpus shard under FSDP;
    buckets     DDP's fp32 gradient buckets (4 bytes a parameter: gradient_as_bucket_view is off); FSDP: none;
    copies      autocast's bf16 copy of every weight a matmul reads (2 bytes each), held from the forward to the
                backward; under FSDP the gathered bf16 weights instead: the root's (embedding, head) and two
                blocks' (the one computing and the one prefetched);
    activations saved_per_token x tokens per micro-batch;
    loss        the backward's gradient of the logits, float32 then bf16 (6 bytes a logit), alive at the start of
                the backward beside everything saved.
    bytes_per_value=4 (float32, no autocast): no copies, float32 logits and their gradient."""
    cfg = planned.config
    n_params = planned.num_params()
    tokens = batch_size * cfg.block_size * getattr(cfg, "n_samples", 1)
    # the weights matmuls read: the Free Transformer's post-sampler is read as a column lookup, never cast
    matmul = sum(m.weight.numel() for m in planned.modules()
                 if isinstance(m, torch.nn.Linear) and m is not getattr(planned, "post_sampler", None))
    if fsdp:
        blocks = models.transformer_blocks(planned)
        largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        copies = bytes_per_value * (n_params - sum(p.numel() for b in blocks for p in b.parameters()) + 2 * largest)
    else:
        copies = 2 * matmul if bytes_per_value == 2 else 0
    return {"states": 16 * n_params / (gpus if fsdp else 1), "buckets": 0 if fsdp else 4 * n_params,
            "copies": copies, "activations": saved_per_token(planned, checkpointing, bytes_per_value) * tokens,
            "loss": (4 + bytes_per_value) * tokens * cfg.vocab_size}


def check_memory(model_type, model_values, batch_size, device, dtype, fsdp=False, world_size=1, checkpointing=False):
    """Before allocating anything: one line when the run's weights, gradients, AdamW state and saved activations (the
    dry run's plan less DDP's buckets, autocast's copies and the loss's gradient; eager's count, which a compiled
    run undercuts by about a third) exceed the memory of this machine (RAM available now) or of the GPU, instead of
    minutes in the allocator and a crash."""
    planned = models.meta_model(model_type, model_values)
    per_value = 4 if dtype == "float32" else 2
    terms = memory_plan(planned, batch_size, fsdp, world_size, per_value, checkpointing)
    states, activations = terms["states"], terms["activations"]
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
            f"(raise gradient_accumulation_steps to keep the tokens per step), set --activation_checkpointing=True "
            f"or shrink the model; --dry_run=True plans it")


def plan_run(model_type, model_values, batch_size, grad_accum, max_iters, fsdp, device, gpus, mfu, checkpointing=False,
             gpu_gib=80.0):
    """train.py --dry_run: parameters, FLOPs, expected speed and memory per GPU of a config, from a model built on
    the meta device (shapes, no memory); a warning, with what each remedy would plan, when the memory exceeds the
    gpu_gib GiB of the GPU it assumes."""
    model_values.setdefault("block_size", models.config_fields(model_type)["block_size"])
    planned = models.meta_model(model_type, model_values)
    cfg = planned.config
    n_params, flops = planned.num_params(), planned.flops_per_token()
    peak = peak_flops(device) or PEAK_FLOPS["H100"]  # the GPU here if known, else an H100: 989 TFLOP/s bf16 dense
    # activation checkpointing runs every block's forward twice: a token's 6 N FLOPs become 8 N
    tokens_per_s = mfu * peak / flops / (4 / 3 if checkpointing else 1)  # per GPU
    tokens_per_step = grad_accum * batch_size * cfg.block_size  # all GPUs together
    step_s = tokens_per_step / (tokens_per_s * gpus)
    terms = memory_plan(planned, batch_size, fsdp, gpus, checkpointing=checkpointing)
    GiB = 2 ** 30
    print(f"dry run: {model_type} model, {n_params:,} parameters, {flops / 1e9:.3g} GFLOPs per token (forward + backward)")
    print(f"speed: {tokens_per_s:,.0f} tokens/s per GPU at {mfu:.0%} MFU of {peak / 1e12:.0f} TFLOP/s"
          f"{' (each block computed twice: activation checkpointing)' if checkpointing else ''}; "
          f"{gpus} GPU(s), {tokens_per_step:,} tokens per step: {step_s:.3g} s per step, "
          f"{max_iters * step_s / 3600:.3g} h for {max_iters:,} steps, {max_iters * tokens_per_step / 1e9:.3g}B tokens")
    print(f"memory per GPU: {sum(terms.values()) / GiB:.2f} GiB = {terms['states'] / GiB:.2f} GiB weights, gradients, "
          f"AdamW (16 bytes per parameter, {f'sharded over {gpus} GPUs by FSDP' if fsdp else 'replicated by DDP'}) + "
          + (f"{terms['copies'] / GiB:.2f} GiB gathered bf16 blocks and root" if fsdp else
             f"{terms['buckets'] / GiB:.2f} GiB DDP gradient buckets + {terms['copies'] / GiB:.2f} GiB autocast's bf16 "
             f"weight copies") +
          f" + {terms['activations'] / GiB:.2f} GiB activations saved for the backward "
          f"({'block inputs, one block recomputed at a time' if checkpointing else 'eager, per model'}, "
          f"B={batch_size}, T={cfg.block_size}) + {terms['loss'] / GiB:.2f} GiB the logits' gradient")
    print("  measured on the CPU for each model (nanolatent/plan.py saved_per_token); torch.compile saves 0.65 of it "
          "on the CPU for det, B-Trans and the Free Transformer, 1.03 of it for EVE; not counted: the CUDA context and "
          "allocator slack (1-3 GiB)")
    if sum(terms.values()) > gpu_gib * GiB:
        remedies = {}  # what each change alone would plan, a GPU's memory
        if not fsdp and gpus > 1:
            remedies["--fsdp=True (shards weights, gradients and AdamW)"] = (batch_size, True, checkpointing)
        if not checkpointing:
            remedies["--activation_checkpointing=True (a third more FLOPs)"] = (batch_size, fsdp, True)
        if batch_size > 1:
            remedies[f"--batch_size={batch_size // 2} --gradient_accumulation_steps={2 * grad_accum} (the same tokens "
                     f"per step)"] = (batch_size // 2, fsdp, checkpointing)
        planned_gib = {what: sum(memory_plan(planned, b, f, gpus, checkpointing=c).values()) / GiB
                       for what, (b, f, c) in remedies.items()}
        print(f"warning: {sum(terms.values()) / GiB:.2f} GiB a GPU exceeds the {gpu_gib:g} GiB this plan assumes "
              f"(--dry_run_gpu_gib); change "
              + "; or ".join(f"{what}: {gib:.2f} GiB" for what, gib in planned_gib.items())
              + ("" if remedies else "the model's size or the number of GPUs"))
