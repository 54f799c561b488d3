"""Train any nanolatent model. One process on a laptop CPU:

    python train.py                                   # the Free Transformer synthetic task defaults below
    python train.py config/det_shakespeare_char.py --max_iters=500

Data parallel on one node, or across nodes (run the same command on every node); --fsdp=True shards the weights,
gradients and AdamW state across the processes instead of replicating them (FSDP2):

    torchrun --standalone --nproc_per_node=8 train.py config/det_fineweb_124m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=8 train.py ...
    torchrun --standalone --nproc_per_node=8 train.py config/free_8b.py          # fsdp = True in the file

Plan a run without running it (parameters, FLOPs, expected tokens/s and memory per GPU); where it does not fit,
--activation_checkpointing=True recomputes each block in the backward pass instead of keeping its activations:

    python train.py config/free_1b5.py --dry_run=True
    python train.py config/free_8b.py --dry_run=True --dry_run_world_size=8 --activation_checkpointing=True
"""

import gc
import importlib.util
import math
import os
import signal
import sys
import time
from contextlib import nullcontext

import configurator  # before torch: it answers a bare --help from this file's source

import torch
import torch.distributed as dist

from nanolatent import ckpt, common, cpu, distributed, eve_bank, models, optim, plan, records, saves, speedups, tokendata

# ----------------------------------------------------------------------------------------------------------------
# defaults: a Free Transformer on the synthetic task of its paper (§4.1), small enough for one CPU thread (the README's
# quick start: 600 steps of 32 sequences, under 5 minutes on one thread; Z already carries where the target sits)
# I/O
out_dir = "out"
eval_interval = 100  # an evaluation, and a save when val loss improves (the first evaluation, at step 0, always)
log_interval = 10
eval_iters = 20  # batches per split per evaluation
eval_only = False  # evaluate out_dir's checkpoint once and exit
always_save_checkpoint = False  # save at every evaluation, not only when val loss improves
checkpoint_interval = 0  # also save every this many steps whatever the val loss (0: off): a kill loses fewer steps
keep_checkpoints = 2  # saves kept in out_dir/checkpoints/: the newest this many, and the best
select_by = "loss"  # val metric whose best is kept: 'loss' (the objective) or 'ce' (CE alone: EVE's select_by="ce")
init_from = "scratch"  # 'resume' continues out_dir's run; 'auto' resumes it if there is one (one command for restarts)
overwrite = False  # init_from='scratch' into an out_dir that holds a checkpoint replaces that run
wandb_log = False  # Weights & Biases logging (pip install wandb)
wandb_project = "nanolatent"
wandb_run_name = "run"
# data
dataset = "synthetic"
batch_size = 32  # sequences per micro-batch per process
gradient_accumulation_steps = 1  # micro-batches per optimizer step, summed over all processes
model_type = "free"  # model_<model_type>.py; any field of its Config (n_layer, sigma, ...) is set like the keys here
init_embeddings = ""  # a .npy (vocab_size, n_embd) copied into a fresh model's tok_emb and tied head (EVE §1)
freeze_embeddings = False  # tok_emb (and a head tied to it) gets no gradient, and so no AdamW update or decay
# AdamW and the learning-rate schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
optimizer = "adamw"  # 'adamw': the model's configure_optimizers; 'muon': Muon on the blocks' matrices (optim.py)
learning_rate = 1e-3
muon_lr = 0.02  # --optimizer=muon: the matrices' peak learning rate (nanochat's matrix_lr), scheduled as learning_rate
muon_dtype = "auto"  # Muon's Newton-Schulz products: 'auto' = bfloat16 where the machine has it fast, else float32
max_iters = 600
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 disables clipping
warmup_iters = 100
lr_decay_iters = 600  # usually max_iters; a --max_iters below it, with lr_decay_iters not set, lowers it to max_iters
min_lr = 1e-4  # usually learning_rate / 10 (Chinchilla)
warmdown_iters = 0  # > 0: warmup-stable-decay (nanochat's warmdown): the peak, then linear to min_lr over the last N
max_nonfinite = 10  # consecutive non-finite losses (steps skipped) before the run stops
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if torch.cuda.is_available() else "float32"
compile = torch.cuda.is_available()  # torch.compile the training forward (slow to start on a CPU)
kernels = "fast"  # 'plain': no speed-up from outside the model file (docs/models.md, Changing a model)
fsdp = False  # under torchrun: shard weights, gradients and AdamW state across processes (FSDP2) instead of DDP
activation_checkpointing = False  # recompute each block in the backward: only its input kept, a third more FLOPs
seed = 1337
dist_timeout = 300  # seconds a collective waits for every process (a save by rank 0 and a compilation must fit)
# planning: --dry_run=True prints sizes, FLOPs, expected speed and memory per GPU for this config, then exits
dry_run = False
dry_run_world_size = 0  # GPUs to plan for; 0 = $WORLD_SIZE, or 1
dry_run_mfu = 0.4  # assumed model FLOPs utilisation (a well-tuned bf16 run on H100s reaches 0.35-0.5)
dry_run_gpu_gib = 80.0  # a GPU's memory; the plan warns above it, with what to change (an H100: 80 GB)
# ----------------------------------------------------------------------------------------------------------------
config, model_config = configurator.apply(globals(), model_fields=lambda values: models.config_fields(values["model_type"]))


def check_settings():
    """The settings' refusals, one line each (exit 2), before anything is read or built: the dry run refuses what the
    run would."""
    configurator.require(config, positive=("eval_interval", "log_interval", "eval_iters", "batch_size",
                                           "gradient_accumulation_steps", "max_nonfinite", "keep_checkpoints",
                                           "dist_timeout", "dry_run_gpu_gib"),
                         non_negative=("max_iters", "learning_rate", "muon_lr", "min_lr", "warmup_iters",
                                       "lr_decay_iters", "weight_decay", "grad_clip", "dry_run_world_size", "seed",
                                       "checkpoint_interval", "warmdown_iters"),
                         choices={"init_from": ("scratch", "resume", "auto"), "dtype": tuple(common.DTYPES),
                                  "select_by": ("loss", "ce"), "optimizer": optim.OPTIMIZERS,
                                  "kernels": speedups.KERNELS, "muon_dtype": optim.NS_DTYPES},
                         within={"beta1": "[0, 1)", "beta2": "[0, 1)", "dry_run_mfu": "(0, 1]"})
    if model_config.get("n_layer", 0) > 1024:  # a typo's 10**6 layers would take minutes to build before failing
        common.die(f"n_layer={model_config['n_layer']}: train.py builds at most 1,024 layers; lower n_layer")
    common.check_device(device)
    if optimizer == "muon" and not learning_rate:  # the matrices' rate is scheduled as a multiple of learning_rate
        common.die("optimizer=muon schedules muon_lr as a multiple of learning_rate, which is 0: set learning_rate > 0")
    if fsdp and dtype == "float16":
        common.die("fsdp=True trains in bfloat16 or float32 (sharded gradients have no GradScaler here): "
                   "set --dtype=bfloat16")
    if fsdp and not dry_run and not distributed.launched():
        common.die("fsdp=True shards the model across processes: run under torchrun "
                   "(torchrun --standalone --nproc_per_node=N train.py ...)")
    if wandb_log and importlib.util.find_spec("wandb") is None:
        common.die("wandb_log=True needs the wandb package: pip install wandb (or run with --wandb_log=False)")


def check_world_size(processes):
    """What the run refuses of its number of processes, the dry run refuses of the number it plans for."""
    if gradient_accumulation_steps % processes:
        common.die(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
                   f"{processes} processes: each one runs an equal share of the micro-batches")


check_settings()
speedups.use(kernels)
if device == "cpu":
    cpu.keep_freed_memory()  # each step's activations reuse the last step's memory, without page faults
sys.stdout.reconfigure(line_buffering=True)  # every line as it is printed, also into a log file (nohup ... > log)
stop = common.Stop()  # Ctrl-C and SIGTERM from here on: the loop saves the current step and exits
decay_note = None  # printed once every check has passed, not above a refusal
if max_iters < lr_decay_iters and "lr_decay_iters" not in configurator.given(globals()):
    # a quick look (--max_iters=300) should decay its learning rate as the full run does, not stop at its peak
    decay_note = (f"lr_decay_iters = max_iters = {max_iters} (was {lr_decay_iters}): the cosine decay ends with the "
                  f"run; set --lr_decay_iters to keep another value")
    lr_decay_iters = config["lr_decay_iters"] = max_iters
# ----------------------------------------------------------------------------------------------------------------

if dry_run:  # plan the run: the model is built on the meta device (shapes, no memory, no data beyond meta.json)
    if "vocab_size" not in model_config:  # the data's only when the config does not say
        model_config["vocab_size"] = tokendata.load_meta(dataset)["vocab_size"]
    planned = dry_run_world_size or distributed.env_world_size()
    check_world_size(planned)
    plan.plan_run(model_type, model_config, batch_size, gradient_accumulation_steps, max_iters, fsdp, device,
                    planned, dry_run_mfu, activation_checkpointing, dry_run_gpu_gib)
    gc.freeze()  # as before the training loop below: the exit walks none of start-up's objects
    raise SystemExit(0)

ddp, rank, world_size, local_rank, device = distributed.init(device, dist_timeout)
check_world_size(world_size)
gradient_accumulation_steps //= world_size
master = rank == 0  # only this process prints, logs and saves
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
device_type, autocast = common.autocast(device, dtype)
ptdtype = common.DTYPES[dtype]

saver = saves.Saves(out_dir, fsdp, ddp, rank, keep_checkpoints)  # out_dir/checkpoints/iter_N/, the best linked
start_dir = saver.start(init_from, overwrite, eval_only)  # the save this run starts from, if any (out_dir locked)
resume = start_dir is not None

# data: a token stream per split, read through memmaps (one file, or the shards of prepare.py fineweb_edu)
meta = tokendata.load_meta(dataset)
train_data, val_data = (tokendata.load_tokens(dataset, split, meta) for split in ("train", "val"))
TRAIN_BATCH, EVAL_BATCH, MODEL_NOISE, EVAL_NOISE = 0, 1, 2, 3  # the streams common.seeded() draws from


def get_batch(split, *key):
    """A micro-batch of `split` drawn from the stream (TRAIN_BATCH, step, micro_step) or (EVAL_BATCH, rank, k)."""
    x, y = (torch.from_numpy(a) for a in tokendata.windows(train_data if split == "train" else val_data, meta,
                                                           model_config["block_size"], batch_size,
                                                           common.seeded(seed, *key, split == "train")))
    if device_type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# model: fresh, or the checkpoint's architecture with the overrides that leave every saved tensor's shape unchanged
checkpoint = ckpt.load_checkpoint(ckpt.run_file(start_dir), device) if resume else None
if checkpoint is not None:  # the run's own architecture, optimizer and frozen embeddings, saved again as they were
    model_config, freeze_embeddings, optimizer = saver.resumed_settings(checkpoint, model_type, model_config, config,
                                                                        configurator.given(globals()), meta, eval_only)
    config.update(freeze_embeddings=freeze_embeddings, optimizer=optimizer)
model_config.setdefault("vocab_size", meta["vocab_size"])
# fixed-length sequences (the synthetic task) default to one whole sequence per window
model_config.setdefault("block_size", meta["doc_len"] - 1 if "doc_len" in meta
                        else models.config_fields(model_type)["block_size"])
tokendata.check_fit(dataset, meta, (train_data, val_data), model_config["vocab_size"], model_config["block_size"])
threads = torch.get_num_threads() if device == "cpu" else None  # common.check_device chose it
# before a batch_size=1000000 meets the allocator
plan.check_memory(model_type, model_config, batch_size, device, dtype, fsdp, world_size, activation_checkpointing)
torch.manual_seed(seed)  # the same initial weights on every process (DDP also broadcasts them from rank 0)
model = models.build_model(model_type, model_config).to(device)
if init_embeddings and checkpoint is None:  # a resumed run has them in its checkpoint
    models.load_embeddings(model, init_embeddings)
model.tok_emb.weight.requires_grad_(not freeze_embeddings)  # before configure_optimizers, which skips it then
model_config = models.config_dict(model.config)
eve_bank.fused_banks(model, log=print if master else None)  # EVE's neurons, backward written out, where they prove it
if device_type == "cpu" and not compile and not fsdp:
    cpu.training_kernels(model, log=print if master else None)  # oneDNN's products, RMSNorm's closed-form backward
train_model = distributed.wrap(model, device_type, world_size, local_rank, fsdp, ddp, compile, ptdtype,
                               activation_checkpointing)  # FSDP2, or torch.compile then DDP
# the first step compiles (a minute or more on a CPU): a progress line says so where one is shown (common.phase)
compiling = "first training step (torch.compile compiles it)"
step_forward = common.first_call(train_model, compiling) if compile else train_model
opt = optim.build(optimizer, model, weight_decay, learning_rate, muon_lr, (beta1, beta2), device_type,
                  None if muon_dtype == "auto" else common.DTYPES[muon_dtype])  # `optimizer`: the setting
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)


def save_checkpoint(selected):
    info = {"model_type": model_type, "model_config": model_config, "config": config, "meta": meta,
            "iter_num": iter_num, "best_val_loss": best_val_loss}
    saver.save(model, opt, info, selected)


iter_num, best_val_loss = 0, float("inf")
if checkpoint is not None:
    iter_num, best_val_loss = saver.load(model, opt, checkpoint, start_dir, eval_only)
    del checkpoint
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * model_config["block_size"]
metrics_path = os.path.join(out_dir, "metrics.jsonl")
if master:
    if decay_note and not eval_only:
        print(decay_note)
    print(records.run_line(model_type, model, tokens_per_iter, world_size, device, threads))
    if isinstance(opt, optim.MuonAdamW):
        print(opt.describe())
    if resume and not eval_only:
        print(f"resuming from {start_dir} at iter {iter_num}")
    if not eval_only:  # a resumed run drops the records past its checkpoint, so a curve never doubles back
        records.keep_records(metrics_path, before_iter=iter_num if resume else 0)
    if wandb_log:
        import wandb  # check_settings found it: imported here, as only this process logs
        wandb.init(project=wandb_project, name=wandb_run_name, config={**config, **model_config})


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    if warmdown_iters:  # warmup-stable-decay: flat at the peak, then linear to min_lr at lr_decay_iters
        return min_lr + min(1.0, (lr_decay_iters - it) / warmdown_iters) * (learning_rate - min_lr)
    ratio = (it - warmup_iters) / max(lr_decay_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


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
            if distributed.stop_requested(stop, ddp, device):  # Ctrl-C: the weights are a whole step's, save them
                train_model.train()
                return None
            X, Y = get_batch(split, EVAL_BATCH, rank, k)  # the same eval batches at every evaluation
            # the model's noise seeded like training's: a resumed run evaluates as the uninterrupted run did
            torch.manual_seed(common.seed_of(seed, EVAL_NOISE, iter_num, rank, split == "train", k))
            with autocast:
                _, loss, stats = model(X, Y)
                values = {"loss": loss, **stats}
                latents = model.sample_latents(X.size(0), torch.Generator(device).manual_seed(k))
                if latents is not None:
                    values["ce_prior"] = model(X, Y, latents=latents)[2]["ce"]
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + float(value) / eval_iters
        out.update({f"{split}_{name}": value for name, value in distributed.all_reduce_mean(sums, ddp, device).items()})
    train_model.train()
    return out


def log_record(record):
    """One JSON line per log step and per evaluation in out_dir/metrics.jsonl: the source for scripts/plot.py."""
    records.append_record(metrics_path, record)
    if wandb_log:
        wandb.log(record, step=record["iter"])


def save_and_stop():
    """Save the iter_num whole steps done (the latest weights, not necessarily the best), say how to go on, and exit
    with 128 + the signal's number, as a shell reports a process a signal ended."""
    signum = stop.signum or signal.SIGTERM  # under torchrun, a process the signal missed stops with the rest
    if not eval_only and iter_num > start_iter and saver.saved_iter != iter_num:
        save_checkpoint(selected=False)
    if master:
        what = ("the evaluation stopped; nothing was written" if eval_only else
                f"{out_dir}/{ckpt.CHECKPOINTS} holds iter {iter_num}; continue with the same command and "
                f"--init_from=auto (or resume)" if iter_num > start_iter or resume else
                "no step was done and nothing was written; run the same command to start again")
        print(f"stopped by {signal.Signals(signum).name}: {what}", file=sys.stderr)
    if ddp:
        dist.destroy_process_group()
    stop.exit(128 + signum)


def skip_step():
    """A step whose loss is not finite leaves no trace (no update, no controller measurement); max_nonfinite of them in
    a row stop the run with what to do."""
    global nonfinite_total, nonfinite_streak
    opt.zero_grad(set_to_none=True)
    if hasattr(model, "update_controllers"):
        model.update_controllers(skipped=True)
    nonfinite_total, nonfinite_streak = nonfinite_total + 1, nonfinite_streak + 1
    if nonfinite_streak >= max_nonfinite:  # hyper-parameters are checked finite and in range at the start
        bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
        at_resume = resume and nonfinite_streak == iter_num - start_iter + 1  # every step since the resume
        common.die(f"{nonfinite_streak} non-finite losses in a row at iter {iter_num}"
                   + (f", every step since the resume from {start_dir}" if at_resume else ": the run diverged")
                   + (f" (weight {bad} holds NaN or inf)" if bad else "")
                   + (": that save may be damaged; move it aside to resume from an older one, or lower learning_rate"
                      if at_resume else f"; lower learning_rate, keep grad_clip on, or resume from the last "
                      f"checkpoint in {out_dir}"))


def log_step(dt, lr, loss, stats):
    """The step's line on the console and its record in metrics.jsonl (and wandb)."""
    peak = common.peak_flops(device)
    mfu = model.flops_per_token() * tokens_per_iter / world_size / dt / peak if peak else None
    record = {"iter": iter_num, "tokens": (iter_num + 1) * tokens_per_iter, "lr": lr, "loss": loss,
              **{k: float(v) for k, v in stats.items()}, "tokens_per_s": tokens_per_iter / dt, "mfu": mfu,
              "nonfinite": nonfinite_total}
    if device_type == "cuda":  # the dry run's "memory per GPU" plan, measured (weights, optimizer, activations)
        record["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    paced = iter_num - start_iter  # steps since the first, evaluations between them included
    eta = ((time.time() - t_paced) / paced if paced else dt) * (max_iters - iter_num - 1)
    print(records.step_line(record, stats, dt, max_iters, time.time() - t_start, eta))
    log_record(record)


gc.freeze()  # start-up's objects live to the end: no collection walks them again, nor the teardown at exit
nonfinite_total, nonfinite_streak = 0, 0
start_iter, t_start = iter_num, time.time()
t_paced = None  # the end of the first step: the pace for the ETA leaves out its compilation and first evaluation
while True:
    lr = get_lr(iter_num)
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # --optimizer=muon: the matrices' groups at muon_lr's scale
    if distributed.stop_requested(stop, ddp, device):
        save_and_stop()

    if iter_num % eval_interval == 0 or iter_num == max_iters or eval_only:
        if master and iter_num == start_iter:
            print(f"evaluating at iter {iter_num}: {eval_iters} batches per split")
        evals = estimate_loss()
        if evals is None:
            save_and_stop()
        if master and eval_only:  # printed in full, logged nowhere: the run's records stay as they are
            print(f"{saver.file} at iter {iter_num}:\n" + "\n".join(f"  {k} {v:.4f}" for k, v in evals.items()))
        elif master:
            print(records.eval_line(evals, iter_num, max_iters))
        # evals are all-reduced, so every process takes the same decision (under FSDP they all write)
        value = evals[f"val_{select_by}"]  # the loss includes KL and control terms for EVE; ce is CE alone
        if not eval_only and (value < best_val_loss or always_save_checkpoint):
            best_val_loss = min(best_val_loss, value)
            save_checkpoint(selected=True)
        if master and not eval_only:  # after the first save: records in out_dir come with a checkpoint (saves.start)
            log_record({"iter": iter_num, "tokens": iter_num * tokens_per_iter, **evals})
    # On schedule whatever the val loss, and the last step: the same command run again finds the run complete.
    scheduled = checkpoint_interval and iter_num % checkpoint_interval == 0
    if not eval_only and (scheduled or iter_num == max_iters) and saver.saved_iter != iter_num:
        save_checkpoint(selected=False)
    if eval_only or iter_num >= max_iters:
        break

    t0 = time.time()
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(gradient_accumulation_steps):
        batch = rank * gradient_accumulation_steps + micro_step  # the micro-batch's index in the step, over processes
        X, Y = get_batch("train", TRAIN_BATCH, iter_num, batch)
        # The model's own noise (B-Trans minds, EVE eps, Free Z) comes from the global generator, seeded like the
        # batch: other noise for each micro-batch, the same on any number of processes and in a resumed run.
        torch.manual_seed(common.seed_of(seed, MODEL_NOISE, iter_num, batch))
        # DDP averages gradients on the last micro-step only (one all-reduce a step). FSDP reduce-scatters after
        # each: its gradients stay sharded in fp32, where skipping would hold whole bf16 gradients until the last.
        if ddp and not fsdp:
            train_model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with autocast:
            _, loss, stats = step_forward(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    finite = torch.isfinite(loss_sum).float()
    if ddp:  # every process takes the same decision
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item() == 0:
        skip_step()
    else:
        nonfinite_streak = 0
        if grad_clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # the global norm of DTensors too
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if hasattr(model, "update_controllers"):  # model-side controllers (EVE homeostat, beta controller)
            # Under FSDP they rescale DTensor shards, each process its own rows, with measurements averaged over
            # processes first: every rank applies the same update.
            mean_over_ranks = (lambda t: dist.all_reduce(t) or t.div_(world_size)) if ddp else None
            with distributed.replicated() if fsdp else nullcontext():
                model.update_controllers(mean_over_ranks)
    if iter_num == start_iter:
        t_paced = time.time()
    if iter_num % log_interval == 0 and master:
        log_step(time.time() - t0, lr, loss_sum.item(), stats)  # finite.item() above waited for the device
    iter_num += 1

if master and not eval_only:
    print(records.done_lines(out_dir, dataset, model_type))
if ddp:
    dist.barrier()  # rank 0 may still be writing a checkpoint: tear down together (gloo can abort otherwise)
    dist.destroy_process_group()
