# The supervised phase before rlvr.py: a tiny det model on prepare.py's arithmetic lines ("37*12=444").
# python prepare.py arith && python train.py config/det_arith.py
# Reached (1500 iters, val loss 1.48; ~10 min at ~0.4 s/iter on a shared 2-core CPU, one thread; 1.51 and 12 min on
# an idle one with the data of prepare.py's hash-seed-independent order, greedy 0.422 on the first 128), on all 2000 val
# problems with rlvr.py's prompt "\n37*12=": greedy 0.447, pass@1 0.390 and pass@8 0.466 sampling at T=1. Middling
# by construction: addition greedy 0.87 (pass@1 0.76), multiplication 0.002 (the model has learned its format and
# number of digits, not the product). Without the leading '\n' the same model gets 0.30 greedy.
model = "det"
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
