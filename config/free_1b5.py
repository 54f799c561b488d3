# The Free Transformer paper's 1.5B model (§4.2): 28 layers, weight tying, d = 1536, 12 query heads, 2 key/value
# heads, plus the encoder block (+1/28 = 3.6% compute, §4.2), H = 16 latent bits (§4.3). The paper trains it on 47B
# tokens with 32 H100s in about 12 hours (§4.2): 47e9 / (32 x 43,200 s) = 34,000 tokens/s per GPU, close to the
# dry run's 40% MFU below. The paper gives no SwiGLU width, context length, batch or optimizer settings (they were
# "highly tuned for the baselines", §4.3); the values below are ours: 4,096-token sequences, 2^20 tokens per step,
# a Llama-style AdamW schedule. Its vocabulary has 2^17 tokens; we use GPT-2's 50,257, padded to 50,304.
# Trained under FSDP (fsdp = True below): under DDP the plan is 95.13 GiB per GPU (22.87 GiB of replicated weights,
# gradients and AdamW state, 5.72 GiB of buckets), beyond an 80 GB H100; --fsdp=False --activation_checkpointing=True
# plans 45.77 GiB instead, at a third more FLOPs (15.1 h).
#
#   python prepare.py fineweb_edu --subset=sample-100BT --max_tokens=47e9 --name=fineweb_edu_47b   # one pass
#   torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py config/free_1b5.py
#
# python train.py config/free_1b5.py --dry_run=True (32 GPUs, 40% MFU of an H100's 989 TFLOP/s):
#   1,535,036,928 parameters, 11.00 GFLOPs per token; 35,973 tokens/s per GPU, 0.911 s per step, 11.3 h for 44,823 steps
#   memory per GPU 65.09 GiB: 0.71 GiB weights, gradients, AdamW (sharded over 32 GPUs by FSDP) + 0.51 GiB gathered
#   bf16 blocks and root + 59.26 GiB activations + 4.61 GiB the logits' gradient
model_type = "free"
dataset = "fineweb_edu_47b"
out_dir = "out-free-1b5"
fsdp = True
vocab_size = 50304
block_size = 4096
n_layer = 28  # Z enters after block 14 (§3.2)
n_embd = 1536
n_head = 12
n_kv_head = 2
# The paper gives no SwiGLU width. 8,960 makes 28 layers of d = 1536 the paper's 1.5B parameters with its 2^17-token
# vocabulary (it is Qwen2-1.5B's width, a model of exactly this shape); the 8/3 d rule would give 0.9B.
ffn_hidden = 8960
latent_bits = 16  # H (§4.3): 2^16 codes per token, comparable to the 2^17-token vocabulary
mapper_chunk = 2 ** 26  # the factored backward builds v in pieces of 2^26 values (256 MiB): on a GPU fewer, larger
# matmuls than the CPU default 2^22 (a choice, not a measurement: no GPU timing of this kernel yet)
kappa_bits = 0.5  # κ in bits per token; Table 2 trains 1/4, 1/2, 1 and 2 bits (4 bits collapses, §4.4)
# 32 GPUs x 4 sequences x 2 micro-steps x 4,096 tokens = 1,048,576 tokens per step; 47B tokens in 44,823 steps
batch_size = 4
gradient_accumulation_steps = 64  # divided by the number of processes: 2 per GPU on 32 GPUs
dry_run_world_size = 32
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 2000
max_iters = 44823
lr_decay_iters = 44823
weight_decay = 0.1
eval_interval = 1000
checkpoint_interval = 1000  # saved whatever the val loss: a preemption costs at most ~15 min (0.91 s a step)
init_from = "auto"  # the same command starts the run and resumes it (torchrun --max_restarts, SLURM --requeue)
eval_iters = 20
log_interval = 10
