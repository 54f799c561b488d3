# det to nanoGPT's CPU-recipe val loss in the fewest seconds: nanoGPT's "I only have a macbook" shape (4 layers x 128,
# context 64, Tiny Shakespeare characters, the same 90/10 split), trained with Muon on the blocks' matrices.
# python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
# python train.py config/det_speedrun_char.py            (scripts/bench_speedrun.py times it against nanoGPT's recipe)
model_type = "det"
dataset = "shakespeare_char"
out_dir = "out-det-speedrun-char"
block_size = 64
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 4
optimizer = "muon"
muon_lr = 0.02
learning_rate = 3e-3  # AdamW's: the embedding (tied head) and the norms' gains
min_lr = 3e-4
batch_size = 64
max_iters = 300
lr_decay_iters = 300
warmup_iters = 20
beta2 = 0.99
eval_interval = 300  # one evaluation at the start and one at the end, each on eval_iters batches per split
eval_iters = 10
log_interval = 50
