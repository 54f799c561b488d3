# The deterministic baseline on the Free Transformer's synthetic task (§4.1): the "vanilla model" the paper's
# lowest-kappa run should look like. ~0.3 s/iter on a 2-core CPU: python train.py config/det_synthetic.py
model_type = "det"
dataset = "synthetic"
out_dir = "out-det-synthetic"
block_size = 66  # "K>" + 64 characters: one whole sequence per window
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 64
max_iters = 1500
lr_decay_iters = 1500
learning_rate = 1e-3
eval_interval = 250
