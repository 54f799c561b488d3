# Tiny Shakespeare with GPT-2's BPE (50,257 tokens: the tied head dominates the FLOPs at this width).
# python prepare.py text --input=input.txt --name=shakespeare      (offline: add --bpe_file=gpt2.tiktoken)
model_type = "det"
dataset = "shakespeare"
out_dir = "out-det-shakespeare"
block_size = 64
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 16
max_iters = 600
lr_decay_iters = 600
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 50
eval_interval = 100
