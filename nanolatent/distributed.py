"""train.py's processes under torchrun: the process group, the model wrapped for them (FSDP2 or DDP), one line when a
peer is lost (not a traceback per process), and what every process decides together (a stop on a signal, the
evaluation's averages)."""

import datetime
import functools
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from nanolatent import models
from nanolatent.common import die


def launched():
    """Whether torchrun started this process (its RANK is set)."""
    return int(os.environ.get("RANK", -1)) != -1


def init(device, dist_timeout):
    """(ddp, rank, world_size, local_rank, device): one process without torchrun's RANK; under it the process group,
    each process on its own GPU, and sys.excepthook = lost_peer."""
    if not launched():
        return False, 0, 1, None, device
    local_rank = int(os.environ["LOCAL_RANK"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        # NCCL: an error or a timeout tears the process down instead of leaving it hanging, and the flight recorder
        # dumps each process's last collectives on a timeout (to /tmp/nccl_trace_rank_N); a user's settings win
        for key, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
                           ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")):
            os.environ.setdefault(key, value)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=dist_timeout),
                            device_id=torch.device(device) if device.startswith("cuda") else None)
    rank = dist.get_rank()
    sys.excepthook = functools.partial(lost_peer, rank=rank, dist_timeout=dist_timeout)
    return True, rank, dist.get_world_size(), local_rank, device


def wrap(model, device_type, world_size, local_rank, fsdp, ddp, compile, dtype, activation_checkpointing):
    """The model as train.py's step calls it. FSDP2 (ZeRO-3) shards it in place: every Transformer block is one unit,
    all-gathered just before its forward and backward and freed after; the root unit holds the rest (embedding, tied
    head, final norm, the Free Transformer's post-sampler), and each process keeps a 1/world_size shard of every
    parameter as a DTensor, its gradient and its optimizer state. Under bf16, blocks are gathered in bf16 and gradients
    reduce-scattered in fp32; autocast stays on as under DDP (inputs are not cast, so the RoPE tables and the models'
    own noise keep their dtypes). Otherwise: torch.compile, then DDP, which replicates it. Activation checkpointing
    wraps each block's forward first, so compilation and FSDP's units see the recomputing block (as torchtitan orders
    it)."""
    if activation_checkpointing:
        models.checkpoint_blocks(model)
    if not fsdp:
        model = torch.compile(model) if compile else model
        return DDP(model, device_ids=[local_rank] if device_type == "cuda" else None) if ddp else model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP runs alone import it (1 s on a CPU)
    mesh = init_device_mesh(device_type, (world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False) if dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in models.transformer_blocks(model):
        if compile:
            block.compile()  # per block, before sharding: FSDP's hooks stay outside the compiled graphs
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def replicated():
    """torch's implicit_replication: under FSDP the models' plain per-unit tensors act on the DTensor shards of the
    weights as replicated DTensors (EVE's controllers rescale each process's own rows)."""
    from torch.distributed.tensor.experimental import implicit_replication  # FSDP runs alone import it (1 s on a CPU)
    return implicit_replication()


def env_world_size():
    """torchrun's $WORLD_SIZE, 1 without it (what a dry run plans for): one line for a value that is no number of
    processes."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        die(f"WORLD_SIZE={text!r} in the environment is no number of processes (torchrun sets it to 1 or more): unset "
            f"it, or give --dry_run_world_size=N")
    return int(text)


def lost_peer(kind, error, traceback, rank, dist_timeout):
    """sys.excepthook of a process of a job: a collective that failed because another process died (gloo and NCCL
    see the connection drop) or hung past dist_timeout is one line, not a traceback per process; any other error
    keeps its traceback."""
    text = re.sub(r"^\[[^]]*\] ", "", (str(error).strip().splitlines() or [""])[0])  # gloo's "[pair.cc:537] "
    if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and re.search(
            r"gloo|NCCL|c10d|ProcessGroup|Connection (reset|closed)|[Tt]imed out|[Tt]imeout", str(error))):
        print(f"error: process {rank} lost the job's other processes ({text[:150]}): one died, or hung longer than "
              f"dist_timeout={dist_timeout} s; the same command with --init_from=auto goes on from the last "
              f"checkpoint", file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: destroying the process group would wait on the dead process
    sys.__excepthook__(kind, error, traceback)


def stop_requested(stop, ddp, device):
    """Whether a process got SIGINT or SIGTERM (common.Stop); under torchrun all of them agree, so they save the
    same step."""
    if not ddp:
        return bool(stop)
    flag = torch.tensor(float(bool(stop)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def all_reduce_mean(values, ddp, device):
    """{name: float} averaged over processes (every process evaluates its own batches)."""
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    if ddp:
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return dict(zip(values, tensor.tolist()))
