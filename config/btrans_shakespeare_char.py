# B-Trans on character-level Shakespeare, the matched pair of config/det_shakespeare_char.py:
# the same backbone, data, batch and steps (read from that file), so the two differ only in what the paper changes.
# python train.py config/btrans_shakespeare_char.py
exec(open("config/det_shakespeare_char.py").read())
model = "btrans"
out_dir = "out-btrans-shakespeare-char"

# B-Trans (§4.1 Eq. 4): every RMSNorm output gets mu + sigma * eps, one eps per training sequence (§3.2, §4.3).
sigma = 0.02  # the paper gives no value; 0.02 is the only public re-implementation's default
noise_mode = 'sequence'
learn_mu = False  # §4.1: mu is a hyperparameter, 0 for RMSNorm
learn_sigma = False  # True: beyond the paper (§7), learn one sigma per norm with a KL to N(0, prior_sigma^2)
