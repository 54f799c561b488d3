# The Free Transformer of experiments/free_text.py at κ = 1/2 bit per token: config/det_text.py (the same backbone,
# data and steps) plus the encoder block and Z after block 2. The _k1_8 and _k2 files set the study's other κ.
# python train.py config/free_text.py
exec(open("config/det_text.py").read())
model_type = "free"
out_dir = "out-free-text-k1_2"
latent_bits = 8  # H = 8: 256 codes per token (§3.4); the paper's H = 16 is for 130k-token vocabularies, ours has 65
kappa_bits = 0.5  # free bits per token, Eq. 5: the paper's 1/2 bit (§4.5)
