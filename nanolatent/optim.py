"""The optimizer train.py steps: a model's own AdamW, or Muon on the hidden matrices with AdamW on the rest.

Muon (Jordan et al. 2024; torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations, so
every direction of a hidden layer moves at the same rate; nanochat and modded-nanogpt train their Transformer
blocks' matrices with it and everything else with AdamW: the embedding (a lookup, one row per token), the head, the
norms' gains, and here each model's own vectors (EVE's prior and decoder parameters, B-Trans's offsets, the Free
Transformer's zeta and the mapper around its encoder). The model files keep AdamW (configure_optimizers), the papers'
optimizer; this module is applied by train.py under --optimizer=muon.
"""

import torch

from nanolatent import models

OPTIMIZERS = ("adamw", "muon")


def muon_params(model):
    """The hidden matrices: parameters of the Transformer blocks (models.transformer_blocks: the decoder's and the
    Free Transformer's encoder block) that are matrices with two sides above 1, in the model's order. A (d, 1) column
    such as EVE's decoder gain is a vector in matrix form: Newton-Schulz would turn it into its sign."""
    inside = {id(p) for block in models.transformer_blocks(model) for p in block.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) in inside and p.dim() == 2 and min(p.shape) > 1]


class MuonAdamW:
    """torch.optim.Muon on the hidden matrices and AdamW on every other trained parameter, stepped as one optimizer:
    train.py's schedule, GradScaler and checkpoints see param_groups, step, zero_grad and one state_dict. Each group
    holds lr_scale, its learning rate over AdamW's (train.py's schedule sets lr = lr_scale * its lr)."""

    def __init__(self, model, weight_decay, learning_rate, muon_lr, betas, device_type):
        hidden = muon_params(model)
        chosen = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
        # weight_decay acts on every matrix in the same decoupled form (p -= lr * weight_decay * p), Muon's and the
        # embedding's; never on vectors, as configure_optimizers does. Muon's lr is nanochat's matrix_lr (0.02), its
        # per-shape factor torch's default, Keller Jordan's sqrt(max(1, rows / cols)); momentum 0.95, Nesterov.
        self.muon = torch.optim.Muon([{"params": hidden, "lr_scale": muon_lr / learning_rate}], lr=muon_lr,
                                     weight_decay=weight_decay, momentum=0.95, nesterov=True)
        self.adamw = torch.optim.AdamW(
            [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay, "lr_scale": 1.0},
             {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0}],
            lr=learning_rate, betas=betas, fused=device_type in ("cpu", "cuda"))

    @property
    def param_groups(self):  # a property: load_state_dict replaces each optimizer's list of groups
        return self.muon.param_groups + self.adamw.param_groups

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state):
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build(optimizer, model, weight_decay, learning_rate, muon_lr, betas, device_type):
    """The optimizer named by train.py's --optimizer for `model`'s trained parameters."""
    if optimizer == "adamw":
        return model.configure_optimizers(weight_decay, learning_rate, betas, device_type)
    return MuonAdamW(model, weight_decay, learning_rate, muon_lr, betas, device_type)
