# The supervised phase before scripts/rlvr.py: a tiny det model on prepare.py's arithmetic lines ("37*12=444").
# python prepare.py arith && python train.py config/det_arith.py
# Reached 1500 iters at val loss 1.48-1.61 in our runs (2026-11-23 to 2026-11-24, a 2-core AMD EPYC, one thread,
# 10-12 min): when the loss jumps (the model learns to add) moves with float rounding, so one run can answer greedy
# 0.447 of the 2000 val problems (prompt "\n37*12=", pass@1 0.390, pass@8 0.466 at T=1) and another 0.04 of 200
# (docs/reproductions.md, GRPO). A model that adds is middling
# by construction: addition greedy 0.87 (pass@1 0.76), multiplication 0.002 (the model has learned its format and
# number of digits, not the product). Without the leading '\n' the same model gets 0.30 greedy.
model_type = "det"
dataset = "arith"
out_dir = "out-det-arith"
block_size = 64  # ~5 problems of 8-15 characters per window
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 64
max_iters = 1500
lr_decay_iters = 1500
learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99  # few tokens per iteration: a shorter second-moment memory (as in the other CPU configs)
warmup_iters = 100
eval_interval = 250
eval_iters = 10
