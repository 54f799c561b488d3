"""Train any nanolatent model. One process on a laptop CPU:

    python train.py                                   # the Free Transformer synthetic task defaults below
    python train.py config/det_shakespeare_char.py --max_iters=500

Data parallel on one node, or across nodes (run the same command on every node); --fsdp=True shards the weights,
gradients and AdamW state across the processes instead of replicating them (FSDP2):

    torchrun --standalone --nproc_per_node=8 train.py config/det_fineweb_124m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=8 train.py ...
    torchrun --standalone --nproc_per_node=8 train.py config/free_8b.py          # fsdp = True in the file

Plan a run without running it (parameters, FLOPs, expected tokens/s and memory per GPU):

    python train.py config/free_1b5.py --dry_run=True
"""

import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

import common
from configurator import configure

# ----------------------------------------------------------------------------------------------------------------
# defaults: a Free Transformer on the synthetic task of its paper (§4.1), small enough for a 2-core CPU
# I/O
out_dir = "out"
eval_interval = 250
log_interval = 10
eval_iters = 20  # batches per split per evaluation
eval_only = False  # evaluate once and exit
always_save_checkpoint = False  # save at every evaluation, not only when val loss improves
init_from = "scratch"  # 'scratch', or 'resume' to continue the run in out_dir
wandb_log = False  # Weights & Biases logging (pip install wandb)
wandb_project = "nanolatent"
wandb_run_name = "run"
# data
dataset = "synthetic"
batch_size = 64  # sequences per micro-batch per process
gradient_accumulation_steps = 1  # micro-batches per optimizer step, summed over all processes
# model: model_<model>.py; any field of its Config (n_layer, kappa_bits, sigma, ...) may be set like the keys here
model = "free"
# AdamW and the learning-rate schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
learning_rate = 1e-3
max_iters = 1500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 disables clipping
warmup_iters = 100
lr_decay_iters = 1500  # usually max_iters
min_lr = 1e-4  # usually learning_rate / 10 (Chinchilla)
max_nonfinite = 10  # consecutive non-finite losses (steps skipped) before the run stops
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if torch.cuda.is_available() else "float32"
compile = torch.cuda.is_available()  # torch.compile the training forward (slow to start on a CPU)
fsdp = False  # under torchrun: shard weights, gradients and AdamW state across processes (FSDP2) instead of DDP
seed = 1337
# planning: --dry_run=True prints sizes, FLOPs, expected speed and memory per GPU for this config, then exits
dry_run = False
dry_run_world_size = 0  # GPUs to plan for; 0 = $WORLD_SIZE, or 1
dry_run_mfu = 0.4  # assumed model FLOPs utilisation (a well-tuned bf16 run on H100s reaches 0.35-0.5)
# ----------------------------------------------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
config, model_config = configure({k: globals()[k] for k in config_keys}, sys.argv[1:],
                                 lambda values: common.config_fields(values["model"]))
globals().update(config)
# ----------------------------------------------------------------------------------------------------------------

def transformer_blocks(model):
    """Every Transformer block, whatever holds it (model.blocks, the Free Transformer's encoder): FSDP's units of
    all-gather and reduce-scatter, and the layers of the dry run's activation estimate."""
    return [m for m in model.modules() if type(m).__name__.endswith("Block")]


if dry_run:  # plan the run: the model is built on the meta device (shapes, no memory, no data beyond meta.json)
    if "vocab_size" not in model_config:
        model_config["vocab_size"] = common.load_meta(dataset)["vocab_size"]
    model_config.setdefault("block_size", common.config_fields(model)["block_size"])
    with torch.device("meta"):
        planned = common.build_model(model, model_config)
    cfg, gpus = planned.config, dry_run_world_size or int(os.environ.get("WORLD_SIZE", 1))
    n_params, flops = planned.num_params(), planned.flops_per_token()
    peak = common.peak_flops(device) or common.PEAK_FLOPS["H100"]  # the GPU here if known, else an H100: 989 TFLOP/s bf16 dense
    tokens_per_s = dry_run_mfu * peak / flops  # per GPU
    tokens_per_step = gradient_accumulation_steps * batch_size * cfg.block_size  # all GPUs together
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
    print(f"dry run: {model} model, {n_params:,} parameters, {flops / 1e9:.3g} GFLOPs per token (forward + backward)")
    print(f"speed: {tokens_per_s:,.0f} tokens/s per GPU at {dry_run_mfu:.0%} MFU of {peak / 1e12:.0f} TFLOP/s; "
          f"{gpus} GPU(s), {tokens_per_step:,} tokens per step: {step_s:.3g} s per step, "
          f"{max_iters * step_s / 3600:.3g} h for {max_iters:,} steps, {max_iters * tokens_per_step / 1e9:.3g}B tokens")
    print(f"memory per GPU: {(states + activations) / GiB:.2f} GiB = {states / GiB:.2f} GiB weights, gradients, "
          f"AdamW (16 bytes per parameter, {f'sharded over {gpus} GPUs by FSDP' if fsdp else 'replicated by DDP'}) + "
          f"{activations / GiB:.2f} GiB activations (34*B*T*d per block x {n_blocks} blocks + 6*B*T*V logits, "
          f"B={B}, T={T}, d={d}, V={V})")
    print("  not counted: model-specific activations (EVE's neurons, the Free Transformer's Binary Mapper), the "
          "blocks FSDP gathers, the CUDA context and allocator slack (a few GiB)")
    sys.exit(0)

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    rank, local_rank, world_size = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if gradient_accumulation_steps % world_size:
        common.die(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
                   f"{world_size} processes: each one runs an equal share of the micro-batches")
    gradient_accumulation_steps //= world_size
else:
    rank, world_size = 0, 1
if fsdp and not ddp:
    common.die("fsdp=True shards the model across processes: run under torchrun "
               "(torchrun --standalone --nproc_per_node=N train.py ...)")
if fsdp and dtype == "float16":
    common.die("fsdp=True trains in bfloat16 or float32 (sharded gradients have no GradScaler here): "
               "set --dtype=bfloat16")
master = rank == 0  # only this process prints, logs and saves
device_type = "cuda" if device.startswith("cuda") else "cpu"
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
autocast = nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type=device_type, dtype=ptdtype)
if wandb_log and master:
    try:
        import wandb
    except ImportError:
        common.die("wandb_log=True needs the wandb package: pip install wandb (or run with --wandb_log=False)")

# data: a flat token stream per split, read through a memmap
meta = common.load_meta(dataset)
train_data, val_data = (common.load_tokens(dataset, split, meta) for split in ("train", "val"))


def seeded(*key):
    """Every random draw derives from (seed, *key) (non-negative ints): a resumed run, or one on another number of
    processes, sees exactly the batches and the noise of an uninterrupted single run, with no generator state saved."""
    return np.random.default_rng([seed, *key])


TRAIN_BATCH, EVAL_BATCH, MODEL_NOISE = 0, 1, 2  # the streams seeded() draws from


def get_batch(split, *key):
    """A micro-batch of `split` drawn from the stream (TRAIN_BATCH, step, micro_step) or (EVAL_BATCH, rank, k)."""
    data = train_data if split == "train" else val_data
    T = model_config["block_size"]
    rng = seeded(*key, split == "train")
    if "doc_len" in meta:  # fixed-length sequences (synthetic task): windows start at a sequence's first token
        starts = meta["doc_len"] * rng.integers(len(data) // meta["doc_len"], size=batch_size)
    else:
        starts = rng.integers(len(data) - T, size=batch_size)
    x = torch.from_numpy(np.stack([data[i:i + T] for i in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + T] for i in starts]).astype(np.int64))
    if device_type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# model and optimizer, fresh or from the checkpoint in out_dir
iter_num, best_val_loss = 0, float("inf")
if init_from == "resume":  # under FSDP the small ckpt_meta.pt first; the shards once the model is sharded
    checkpoint = common.load_checkpoint(os.path.join(out_dir, "ckpt_meta.pt") if fsdp else out_dir, device)
    if checkpoint["model_type"] != model:
        common.die(f"{out_dir} holds a {checkpoint['model_type']} run; resume it with --model={checkpoint['model_type']}")
    model_config = checkpoint["model_config"]  # a resumed run keeps its architecture
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
elif init_from != "scratch":
    common.die(f"init_from must be 'scratch' or 'resume', got {init_from!r}")
model_config.setdefault("vocab_size", meta["vocab_size"])
# fixed-length sequences (the synthetic task) default to one whole sequence per window
default_block_size = meta["doc_len"] - 1 if "doc_len" in meta else common.config_fields(model)["block_size"]
model_config.setdefault("block_size", default_block_size)
if "doc_len" in meta and model_config["block_size"] >= meta["doc_len"]:
    common.die(f"{dataset} holds sequences of {meta['doc_len']} tokens: set block_size <= {meta['doc_len'] - 1}")
torch.manual_seed(seed)  # the same initial weights on every process (DDP also broadcasts them from rank 0)
raw_model = common.build_model(model, model_config).to(device)
model_config = common.config_dict(raw_model.config)
if fsdp:
    # FSDP2 (ZeRO-3): every block is one unit, all-gathered just before its forward and backward and freed after;
    # the root unit holds the rest (embedding, tied head, final norm, the Free Transformer's post-sampler). Each
    # process keeps a 1/world_size shard of every parameter as a DTensor, its gradient and its AdamW moments.
    # Under bf16, blocks are gathered in bf16 and gradients reduce-scattered in fp32; autocast stays on as in the
    # DDP path (inputs are not cast, so the RoPE tables and the models' own noise keep their dtypes).
    mesh = init_device_mesh(device_type, (world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False) if ptdtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in transformer_blocks(raw_model):
        if compile:
            block.compile()  # per block, before sharding: FSDP's hooks stay outside the compiled graphs
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(raw_model, mesh=mesh, mp_policy=mp_policy)
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume" and fsdp:  # DCP reads the shards this process owns, whatever world size wrote them
    model_state, optimizer_state = get_state_dict(raw_model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "iter_num": -1}
    dcp.load(state, checkpoint_id=os.path.join(out_dir, "ckpt_dcp"))
    if state["iter_num"] != iter_num:
        common.die(f"{out_dir}/ckpt_dcp holds iter {state['iter_num']} but ckpt_meta.pt iter {iter_num}: the run "
                   f"stopped while saving; resume from an earlier copy of {out_dir} or start from scratch")
    set_state_dict(raw_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    del checkpoint, state, model_state, optimizer_state
elif init_from == "resume":
    raw_model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    del checkpoint
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
train_model = torch.compile(raw_model) if compile and not fsdp else raw_model  # FSDP compiled its blocks above
if ddp and not fsdp:
    train_model = DDP(train_model, device_ids=[local_rank] if device_type == "cuda" else None)
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * model_config["block_size"]
if master:
    os.makedirs(out_dir, exist_ok=True)
    print(f"{model} model: {raw_model.num_params() / 1e6:.2f}M parameters, {raw_model.flops_per_token() / 1e6:.1f} "
          f"MFLOPs per token; {tokens_per_iter:,} tokens per iteration on {world_size} process(es), {device}")


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def all_reduce_mean(values):
    """{name: float} averaged over processes (every process evaluates its own batches)."""
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    if ddp:
        dist.all_reduce(tensor)
        tensor /= world_size
    return dict(zip(values, tensor.tolist()))


@torch.no_grad()
def estimate_loss():
    """Mean loss and stats on eval_iters fixed batches per split. For stochastic models also the CE with latents
    drawn from the prior (sample_latents): the Free Transformer's honest number, since its posterior path reads
    the future tokens through the encoder."""
    train_model.eval()
    out = {}
    for split in ("train", "val"):
        sums = {}
        for k in range(eval_iters):
            X, Y = get_batch(split, EVAL_BATCH, rank, k)  # the same eval batches at every evaluation
            with autocast:
                _, loss, stats = raw_model(X, Y)
                values = {"loss": loss, **stats}
                latents = raw_model.sample_latents(X.size(0), torch.Generator(device).manual_seed(k))
                if latents is not None:
                    values["ce_prior"] = raw_model(X, Y, latents=latents)[2]["ce"]
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + float(value) / eval_iters
        out.update({f"{split}_{name}": value for name, value in all_reduce_mean(sums).items()})
    train_model.train()
    return out


def save_checkpoint():
    """Rank 0 writes out_dir/ckpt.pt. Under FSDP every process writes its own shards of the weights and AdamW state
    (torch.distributed.checkpoint) to out_dir/ckpt_dcp, through a temporary folder renamed once complete, and
    rank 0 the plain out_dir/ckpt_meta.pt (everything of ckpt.pt but the tensors) that a resume reads first."""
    info = {"model_type": model, "model_config": model_config, "config": config, "meta": meta,
            "iter_num": iter_num, "best_val_loss": best_val_loss}
    if fsdp:
        path, tmp = os.path.join(out_dir, "ckpt_dcp"), os.path.join(out_dir, "ckpt_dcp.tmp")
        if master:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
        dist.barrier()
        model_state, optimizer_state = get_state_dict(raw_model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "iter_num": iter_num}, checkpoint_id=tmp)
        if master:  # dcp.save returns once every process has written its files and rank 0 the .metadata
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            common.save_checkpoint(info, os.path.join(out_dir, "ckpt_meta.pt"))
            print(f"saved sharded checkpoint to {out_dir}/ckpt_dcp and {out_dir}/ckpt_meta.pt")
    elif master:
        common.save_checkpoint({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), **info},
                               os.path.join(out_dir, "ckpt.pt"))
        print(f"saved checkpoint to {out_dir}/ckpt.pt")


def log_record(record):
    """One JSON line per log step and per evaluation in out_dir/metrics.jsonl: the source for plot.py."""
    common.append_record(os.path.join(out_dir, "metrics.jsonl"), record)
    if wandb_log:
        wandb.log(record, step=record["iter"])


def truncate_metrics(after_iter):
    """A resumed run drops the records past its checkpoint, so a curve never doubles back."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["iter"] < after_iter]
        with open(path, "w") as f:
            f.writelines(kept)


if master:
    if init_from == "resume":
        truncate_metrics(iter_num)
    else:
        open(os.path.join(out_dir, "metrics.jsonl"), "w").close()
    if wandb_log:
        wandb.init(project=wandb_project, name=wandb_run_name, config={**config, **model_config})

nonfinite_total, nonfinite_streak, last_stats = 0, 0, {}
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        evals = estimate_loss()
        if master:
            print(f"iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
            log_record({"iter": iter_num, "tokens": iter_num * tokens_per_iter, **evals})
        # evals are all-reduced, so every process takes the same decision (under FSDP they all write)
        if (evals["val_loss"] < best_val_loss or always_save_checkpoint) and iter_num > 0:
            best_val_loss = min(best_val_loss, evals["val_loss"])
            save_checkpoint()
    if eval_only or iter_num == max_iters:
        break

    # The model's own noise (B-Trans minds, EVE eps, Free Z) comes from the global generator: seeded per step and
    # per process, so ranks draw different noise and a resumed run draws the same noise as an uninterrupted one.
    torch.manual_seed(int(seeded(MODEL_NOISE, rank, iter_num).integers(2**62)))
    t0 = time.time()
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(gradient_accumulation_steps):
        X, Y = get_batch("train", TRAIN_BATCH, iter_num, rank * gradient_accumulation_steps + micro_step)
        # DDP averages gradients across processes only on the last micro-step (one all-reduce per step). FSDP
        # reduce-scatters after every micro-step instead: gradients then stay sharded and accumulate in fp32,
        # where skipping the sync would hold full unsharded gradients (in bf16) until the last one.
        if ddp and not fsdp:
            train_model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with autocast:
            _, loss, stats = train_model(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    finite = torch.isfinite(loss_sum).float()
    if ddp:  # every process takes the same decision
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item() == 0:
        optimizer.zero_grad(set_to_none=True)
        nonfinite_total, nonfinite_streak = nonfinite_total + 1, nonfinite_streak + 1
        if nonfinite_streak >= max_nonfinite:
            common.die(f"{nonfinite_streak} non-finite losses in a row at iter {iter_num}: the run diverged; lower "
                       f"learning_rate, keep grad_clip on, or resume from the last checkpoint in {out_dir}")
    else:
        nonfinite_streak = 0
        if grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)  # the global norm of DTensors too
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if hasattr(raw_model, "update_controllers"):  # model-side controllers (EVE homeostat, beta controller)
            # Under FSDP the weights they rescale are DTensor shards; implicit_replication lets the models' plain
            # per-neuron tensors act on them as replicated DTensors, so each process scales its own rows.
            with implicit_replication() if fsdp else nullcontext():
                raw_model.update_controllers(stats)

    if iter_num % log_interval == 0 and master:
        dt = time.time() - t0  # this one step (finite.item() above waited for the device)
        peak = common.peak_flops(device)
        mfu = raw_model.flops_per_token() * tokens_per_iter / world_size / dt / peak if peak else None
        record = {"iter": iter_num, "tokens": (iter_num + 1) * tokens_per_iter, "lr": lr,
                  "loss": loss_sum.item(), **{k: float(v) for k, v in stats.items()},
                  "tokens_per_s": tokens_per_iter / dt, "mfu": mfu, "nonfinite": nonfinite_total}
        print(f"iter {iter_num}: loss {record['loss']:.4f}, " + "".join(f"{k} {float(v):.4f}, " for k, v in stats.items())
              + f"{dt * 1000:.1f} ms/iter, {record['tokens_per_s']:,.0f} tok/s"
              + (f", mfu {mfu * 100:.1f}%" if mfu else "") + (f", skipped {nonfinite_total}" if nonfinite_total else ""))
        log_record(record)
    iter_num += 1

if ddp:
    dist.barrier()  # rank 0 may still be writing a checkpoint: tear down together (gloo can abort otherwise)
    dist.destroy_process_group()
