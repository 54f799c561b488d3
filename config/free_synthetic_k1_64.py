# Fig. 3 of the Free Transformer at another free-bits threshold: config/free_synthetic.py, its own out_dir.
exec(open("config/free_synthetic.py").read())
kappa_bits = 1 / 64
out_dir = "out-free-synthetic-k1_64"
