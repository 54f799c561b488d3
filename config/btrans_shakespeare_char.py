# B-Trans on character-level Shakespeare: a small model that trains on a 2-core CPU.
# python train.py config/btrans_shakespeare_char.py   (add --device=cpu --compile=False on a laptop)
# Same sizes as the det baseline's would be, so the two read side by side; only the B-Trans lines are new.

model = 'btrans'
out_dir = 'out-btrans-shakespeare-char'
dataset = 'shakespeare_char'

eval_interval = 250  # a small model on a small set: evaluate often, cheaply
eval_iters = 20
log_interval = 10
always_save_checkpoint = False  # keep the best validation loss only

batch_size = 32
block_size = 128
gradient_accumulation_steps = 1

n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128

learning_rate = 1e-3  # small models tolerate a high rate
max_iters = 2000
lr_decay_iters = 2000  # = max_iters (Chinchilla-style decay to min_lr at the end)
min_lr = 1e-4  # = learning_rate / 10
beta2 = 0.99  # few tokens per iteration: a shorter second-moment memory
warmup_iters = 100
weight_decay = 0.1

# B-Trans (§4.1 Eq. 4): every RMSNorm output gets mu + sigma * eps, one eps per training sequence (§3.2, §4.3).
sigma = 0.02  # the paper gives no value; 0.02 is the only public re-implementation's default
noise_mode = 'sequence'
learn_mu = False  # §4.1: mu is a hyperparameter, 0 for RMSNorm
learn_sigma = False  # True: beyond the paper (§7), learn one sigma per norm with a KL to N(0, prior_sigma^2)
