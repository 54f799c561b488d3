# The deterministic baseline of experiments/free_text.py: character-level Tiny Shakespeare on a backbone small enough
# that a run takes 2-3 minutes on one CPU thread (0.8M training tokens, under one epoch). The Free Transformer runs
# of the study (config/free_text*.py) read this file and change only what the paper adds.
# python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
# python train.py config/det_text.py
model_type = "det"
dataset = "shakespeare_char"
out_dir = "out-det-text"
block_size = 128
n_layer = 4  # the Free Transformer's Z enters after block 2 (§3.2)
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 16
max_iters = 400
lr_decay_iters = 400
learning_rate = 2e-3  # few steps: a higher peak than config/det_shakespeare_char.py's 1e-3, decayed to a tenth
min_lr = 2e-4
beta2 = 0.99  # few tokens per iteration: a shorter second-moment memory (as in config/det_shakespeare_char.py)
warmup_iters = 40
eval_interval = 100
eval_iters = 10  # train.py's own evaluations are a progress view; the study's numbers come from evaluate.py
always_save_checkpoint = True  # every run is measured after the same number of steps, not at its best evaluation
