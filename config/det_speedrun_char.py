# det to nanoGPT's CPU-recipe val loss in the fewest seconds: nanoGPT's "I only have a macbook" data and context (Tiny
# Shakespeare characters, the same 90/10 split, context 64, width 128) on 2 layers with QK-norm, trained with Muon on
# the blocks' matrices. Tuned on seeds 4242-4246 (BENCHMARKS.md); the bench reports seeds 1337-1341.
# python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
# python train.py config/det_speedrun_char.py      (python -m scripts.bench_speedrun times it against nanoGPT's recipe)
model_type = "det"
dataset = "shakespeare_char"
out_dir = "out-det-speedrun-char"
block_size = 64
n_layer = 2  # 4 layers take twice as long a step; 2 x 170 steps end within 0.003 nats of 4 x 150
n_embd = 128
n_head = 4
n_kv_head = 4  # multi-head attention, as nanoGPT's
qk_norm = True  # RMSNorm on queries and keys (Qwen3's; modded-nanogpt's QK-norm): -0.04 nats at 4 layers x 150 steps
optimizer = "muon"
muon_lr = 0.05  # above nanochat's 0.02 (its models are wider), as modded-nanogpt's small runs
learning_rate = 8e-3  # AdamW's: the embedding (and the head tied to it) and the norms' gains
min_lr = 8e-4
beta2 = 0.99  # few tokens per step: a shorter second-moment memory (nanoGPT's recipe)
batch_size = 32  # 2,048 tokens a step, 348k in all: nanoGPT's recipe reads 1.54M
max_iters = 170
lr_decay_iters = 170
warmup_iters = 10
eval_interval = 170  # an evaluation at the start and one at the end
eval_iters = 2  # a glance (2 x 2,048 tokens a split): the bench scores the whole val split after the run
log_interval = 10
