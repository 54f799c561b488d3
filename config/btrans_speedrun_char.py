# B-Trans on the CPU reference track: config/det_speedrun_char.py's recipe (shape, data, Muon, steps, schedule) with
# B-Trans's noise as config/btrans_shakespeare_char.py sets it (trained on the mean, §5; minds when evaluated).
# python train.py config/btrans_speedrun_char.py    (python -m scripts.bench_track times the four models side by side)
exec(open("config/btrans_shakespeare_char.py").read())
exec(open("config/det_speedrun_char.py").read())  # every backbone and training key of the B-Trans file, set again
model_type = "btrans"
out_dir = "out-btrans-speedrun-char"
