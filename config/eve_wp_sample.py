# EVE (variational neurons) in the paper's matched regime, the pair of config/det_wp_sample.py: the same backbone,
# head (with its layer weights), data, batch, epochs and selection by validation CE (read from that file), so the two
# differ only in what the paper changes: the feed-forward neurons and the objective's terms for them (§3.6, §3.7).
#   python train.py config/eve_wp_sample.py --device=cpu --compile=False
exec(open("config/det_wp_sample.py").read())
variational = True
out_dir = "out-eve-wp-sample"
# EVE: model_eve.Config's defaults, stated so that the run reads on its own (§3.3, §3.6; the paper gives no values);
# n_neurons = ffn_hidden = 352 per block at n_embd = 128
latent_dim = 1
sigma_init = 0.8
ar_prior = True
kl_beta = 0.2
alpha_ar = 0.1
mu2_target = 0.10
mu2_band = (0.08, 0.145)
homeostat = True
homeostat_warmup = 50  # = warmup_iters
