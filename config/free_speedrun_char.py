# The Free Transformer on the CPU reference track: config/det_speedrun_char.py's recipe (shape, data, Muon, steps,
# schedule) with the encoder block and Z after block 2 of config/free_text.py (H = 8, kappa = 1/2 bit per token).
# python train.py config/free_speedrun_char.py    (python -m scripts.bench_track times the four models side by side)
exec(open("config/det_speedrun_char.py").read())
model_type = "free"
out_dir = "out-free-speedrun-char"
latent_bits = 8  # H = 8: 256 codes per token (§3.4), as config/free_text.py
kappa_bits = 0.5  # free bits per token, Eq. 5: the paper's 1/2 bit (§4.5)
