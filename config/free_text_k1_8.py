# experiments/free_text.py at another free-bits threshold: config/free_text.py, its own out_dir.
exec(open("config/free_text.py").read())
kappa_bits = 0.125
out_dir = "out-free-text-k1_8"
