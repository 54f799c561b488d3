# B-Trans on character-level Shakespeare, the matched pair of config/det_shakespeare_char.py:
# the same backbone, data, batch and steps (read from that file), so the two differ only in what the paper changes.
# python train.py config/btrans_shakespeare_char.py
exec(open("config/det_shakespeare_char.py").read())
model_type = "btrans"
out_dir = "out-btrans-shakespeare-char"

# B-Trans (§4.1 Eq. 4): every RMSNorm output gets mu + sigma * eps. §5: the update phase is deterministic ("the mean
# shift only"): training is det training with frozen mu = 0, and the minds (one eps per sequence, §3.2, §4.3) are
# drawn when sampling, evaluating (train.py's val loss included) and in RL rollouts.
sigma = 0.02  # the paper gives no value; 0.02 is the only public re-implementation's default
train_noise_mode = 'mean'  # §5; 'sequence' trains under the minds (ours, an ablation)
noise_mode = 'sequence'  # eval(): one mind per sequence
final_norm_noise = True  # the paper does not say whether the final norm is wrapped; ours: it is (False: an ablation)
learn_mu = False  # §4.1: mu is a hyperparameter, 0 for RMSNorm
sigma_scale = 'gain'  # ours: sigma * |gain| * eps per channel; gains start at 1, where it is Eq. 4's absolute
learn_sigma = False  # True (sigma_scale='absolute'): beyond the paper (§7), one sigma per norm, KL to a prior
