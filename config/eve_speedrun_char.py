# EVE on the CPU reference track: config/det_speedrun_char.py's recipe (shape, data, Muon, steps, schedule) with EVE's
# neurons as config/eve_shakespeare_char.py sets them, so the two differ only in what the paper changes.
# python train.py config/eve_speedrun_char.py    (python -m scripts.bench_track times the four models side by side)
exec(open("config/eve_shakespeare_char.py").read())
exec(open("config/det_speedrun_char.py").read())  # every backbone and training key of the EVE file, set again
model_type = "eve"
out_dir = "out-eve-speedrun-char"
homeostat_warmup = warmup_iters  # §3.3's regulation starts with the learning rate's peak, as in the EVE file
