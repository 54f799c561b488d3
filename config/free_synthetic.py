# The Free Transformer on its synthetic task (§4.1, Fig. 3): a letter repeated 8 times at a random place in 64
# characters of "_" noised with "!", prompted by "K>". κ = 1 bit per token; the _k1_64, _k1_8, _k1 and _k8
# files set the other thresholds of Fig. 3, each with its own out_dir. Same sizes as config/det_synthetic.py.
# python train.py config/free_synthetic.py, then python sample.py --out_dir=out-free-synthetic-k1 --start="K>"
# --latents=shared --temperature=1 (one Z for the group, Fig. 3's green boxes).
model_type = "free"
dataset = "synthetic"
out_dir = "out-free-synthetic-k1"
block_size = 66  # "K>" + 64 characters: one whole sequence per window, so the encoder sees all of it
n_layer = 4  # Z enters after block 2 (§3.2)
n_embd = 128
n_head = 4
n_kv_head = 2
latent_bits = 8  # H: 256 codes per token are plenty here (the paper's H = 16 is for 130k-token vocabularies)
kappa_bits = 1.0  # free bits per token, Eq. 5
batch_size = 64
max_iters = 1500
lr_decay_iters = 1500
learning_rate = 1e-3
eval_interval = 250
