"""The optimizer train.py steps: a model's own AdamW, or Muon on the hidden matrices with AdamW on the rest.

Muon (Jordan et al. 2024; torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations, so
every direction of a hidden layer moves at the same rate; nanochat and modded-nanogpt train their Transformer
blocks' matrices with it and everything else with AdamW: the embedding (a lookup, one row per token), the head, the
norms' gains, and here each model's own vectors (EVE's prior and decoder parameters, B-Trans's offsets, the Free
Transformer's zeta and the mapper around its encoder). The model files keep AdamW (configure_optimizers), the papers'
optimizer; this module is applied by train.py under --optimizer=muon.
"""

import math

import torch
from torch.optim.adam import adam

from nanolatent import models
from nanolatent.common import die

OPTIMIZERS = ("adamw", "muon")
NS_DTYPES = ("auto", "float32", "bfloat16")  # train.py's muon_dtype
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's


def fast_ns_dtype(device_type):
    """(dtype, why): the precision of the Newton-Schulz products that this machine computes fast. bfloat16 on CUDA and
    on CPUs with bfloat16 instructions (AVX512-BF16, AMX); float32 elsewhere, where bfloat16 products are emulated (a
    128 x 512 Gram product on a Zen 3 EPYC: 1.03 ms in bfloat16, 0.23 ms in float32; BENCHMARKS.md)."""
    if device_type == "cuda":
        return torch.bfloat16, "CUDA"
    if device_type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16, "this CPU has bfloat16 instructions"
    return torch.float32, ("this CPU has no bfloat16 instructions" if device_type == "cpu" else device_type)


def orthogonalize(G, dtype, steps=5, eps=1e-7):
    """US'V^T for G = USV^T, S' roughly within [0.7, 1.2]: torch.optim.Muon's Newton-Schulz iteration in `dtype`
    (torch's is this in bfloat16, bit for bit). G is a matrix or a stack of matrices of one shape (k, m, n), each
    orthogonalised alone: one batched product for all of them. Works on the wide side, where the Gram matrix X X^T is
    the smaller one."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # the spectral norm at most 1, where it converges
    stack = X if X.dim() == 3 else X.unsqueeze(0)
    for _ in range(steps):
        A = stack @ stack.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        stack = torch.baddbmm(stack, B, stack, beta=a)  # a X + B X
    X = stack if X.dim() == 3 else stack[0]
    return X.mT if tall else X


def muon_params(model):
    """The hidden matrices: parameters of the Transformer blocks (models.transformer_blocks: the decoder's and the
    Free Transformer's encoder block) that are matrices with two sides above 1, in the model's order. A (d, 1) column
    such as EVE's decoder gain is a vector in matrix form: Newton-Schulz would turn it into its sign."""
    inside = {id(p) for block in models.transformer_blocks(model) for p in block.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) in inside and p.dim() == 2 and min(p.shape) > 1]


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices (the first group, "muon": True) and AdamW on every other trained parameter, one
    torch optimizer: train.py's schedule, GradScaler, checkpoints and torch.distributed.checkpoint see one state_dict.
    Each group holds lr_scale, its learning rate over AdamW's (train.py's schedule sets lr = lr_scale * its lr).

    Muon is torch.optim.Muon's update (momentum 0.95, Nesterov, decoupled weight decay, Keller Jordan's per-shape
    factor sqrt(max(1, rows / cols))) with its Newton-Schulz in ns_dtype, the one thing torch's fixes (bfloat16).
    Under FSDP2 a matrix is a DTensor whose rows are spread over the processes: each process gathers the whole
    update (full_tensor), orthogonalises it, and keeps its own rows; the momentum stays sharded. AdamW is torch's
    (the functional adam with decoupled weight decay: the same kernels and state as torch.optim.AdamW)."""

    def __init__(self, model, weight_decay, learning_rate, muon_lr, betas, device_type, ns_dtype=None):
        hidden = muon_params(model)
        chosen = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
        # weight_decay acts on every matrix in the same decoupled form (p -= lr * weight_decay * p), Muon's and the
        # embedding's; never on vectors, as configure_optimizers does. Muon's lr is nanochat's matrix_lr (0.02).
        groups = [{"params": hidden, "muon": True, "lr": muon_lr, "lr_scale": muon_lr / learning_rate},
                  {"params": [p for p in rest if p.dim() >= 2], "muon": False, "lr_scale": 1.0},
                  {"params": [p for p in rest if p.dim() < 2], "muon": False, "weight_decay": 0.0, "lr_scale": 1.0}]
        super().__init__(groups, {"lr": learning_rate, "weight_decay": weight_decay, "betas": betas, "eps": 1e-8,
                                  "momentum": 0.95, "nesterov": True})
        self.fused = device_type in ("cpu", "cuda")  # torch's fused AdamW kernel where it has one
        # a property of the machine, not of the run: chosen again at every start, never saved with the state
        self.ns_dtype, self.ns_why = (ns_dtype, "muon_dtype") if ns_dtype else fast_ns_dtype(device_type)

    @torch.no_grad()
    def step(self, closure=None):  # closure: torch.distributed.checkpoint's state initialisation passes None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self.muon_step(group, params)
            elif params:
                self.adamw_step(group, params)

    def muon_step(self, group, params):
        momentum = group["momentum"]
        updates = {}  # the Nesterov updates by shape: the matrices of one shape orthogonalised as one stack
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            if hasattr(update, "device_mesh"):  # FSDP2's DTensor: this process's rows of the orthogonalised whole
                from torch.distributed.tensor import distribute_tensor  # FSDP runs alone import it (1 s on a CPU)
                whole = orthogonalize(update.full_tensor(), self.ns_dtype)
                self.apply_muon(group, p, distribute_tensor(whole, update.device_mesh, update.placements,
                                                            src_data_rank=None))
            else:
                updates.setdefault(p.shape, []).append((p, update))
        for pairs in updates.values():
            for (p, _), update in zip(pairs, orthogonalize(torch.stack([u for _, u in pairs]), self.ns_dtype)):
                self.apply_muon(group, p, update)

    @staticmethod
    def apply_muon(group, p, update):
        """Decoupled weight decay, then the orthogonalised update at Keller Jordan's per-shape scale."""
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update, alpha=-lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))

    def adamw_step(self, group, params):
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.AdamW's: the fused kernel keeps its step count on the parameter's device
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if self.fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
             [s["step"] for s in states], fused=self.fused or None, decoupled_weight_decay=True, amsgrad=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)

    def describe(self):
        """The run's line about its optimizer."""
        return (f"optimizer: Muon on {sum(p.numel() for p in self.param_groups[0]['params']):,} hidden-matrix weights "
                f"(Newton-Schulz in {str(self.ns_dtype).removeprefix('torch.')}: {self.ns_why}), AdamW on the rest")


def one_state(state_dict, optimizer):
    """A save's optimizer state as `optimizer` loads it. A Muon run saved before 2026-11-29 holds two (torch's Muon
    beside AdamW, {"muon": ..., "adamw": ...}), their groups in MuonAdamW's order: one state, AdamW's parameters
    numbered after Muon's, each group the saved learning rate, decay and scale with MuonAdamW's other keys."""
    if "muon" not in state_dict:
        return state_dict
    muon, adamw = state_dict["muon"], state_dict["adamw"]
    n = sum(len(g["params"]) for g in muon["param_groups"])
    saved = [(g, 0) for g in muon["param_groups"]] + [(g, n) for g in adamw["param_groups"]]
    if len(saved) != len(optimizer.param_groups):
        die(f"the save's optimizer state has {len(saved)} groups, this run's Muon {len(optimizer.param_groups)}: "
            f"resume it with the nanolatent that saved it, or train afresh into another out_dir")
    kept = ("lr", "weight_decay", "lr_scale")  # the saved settings; the rest (the update's constants) this Muon's
    groups = [{**{k: v for k, v in now.items() if k != "params"}, **{k: g[k] for k in kept},
               "params": [offset + i for i in g["params"]]} for now, (g, offset) in zip(optimizer.param_groups, saved)]
    return {"state": {**muon["state"], **{n + i: s for i, s in adamw["state"].items()}}, "param_groups": groups}


def build(optimizer, model, weight_decay, learning_rate, muon_lr, betas, device_type, ns_dtype=None):
    """The optimizer named by train.py's --optimizer for `model`'s trained parameters; ns_dtype: Muon's Newton-Schulz
    precision (None: the device's fast one)."""
    if optimizer == "adamw":
        return model.configure_optimizers(weight_decay, learning_rate, betas, device_type)
    return MuonAdamW(model, weight_decay, learning_rate, muon_lr, betas, device_type, ns_dtype)
