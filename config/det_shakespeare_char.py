# Character-level Tiny Shakespeare, sized for a 2-core CPU (a few minutes).
# python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
model_type = "det"
dataset = "shakespeare_char"
out_dir = "out-det-shakespeare-char"
block_size = 128
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 32
max_iters = 2000
lr_decay_iters = 2000
learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99  # few tokens per iteration: a shorter second-moment memory (as in the btrans/eve configs)
warmup_iters = 100
eval_interval = 250
