# The Free Transformer paper's 8B model (§4.2): the structure of Llama-3 8B, 32 layers, d = 4096, 32 query heads,
# 8 key/value heads, SwiGLU width 14,336 (Llama-3 unties its embeddings; ours are tied, as in every nanolatent
# model), plus the encoder block (+1/32 = 3.1% compute, §4.2), H = 16 (§4.3), κ = 1/2 bit (§4.5). The paper trains
# it on 200B tokens with 256 H100s in about 24 hours, or 1T tokens in 5 days (§4.2): 200e9 / (256 x 86,400 s) = 9,000
# tokens/s per GPU, 47% MFU by our FLOP count. Context length, batch and optimizer settings are not in the paper; the
# values below are ours: 4,096-token sequences and 2^22 tokens per step (the initial batch of Llama 3's
# pre-training), Llama 2 7B's learning rate. FSDP shards the 123 GB of fp32 weights, gradients and AdamW state
# across the GPUs. Every process builds the full fp32 model (31 GB) before sharding it: 8 per node need 250 GB of
# host memory at start-up.
#
#   python prepare.py fineweb_edu --subset=sample-350BT --max_tokens=200e9 --name=fineweb_edu_200b   # one pass
#   torchrun --nnodes=32 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py config/free_8b.py
#
# python train.py config/free_8b.py --dry_run=True (256 GPUs, 40% MFU of an H100's 989 TFLOP/s):
#   7,672,254,464 parameters, 51.60 GFLOPs per token; 7,666 tokens/s per GPU, 2.14 s per step, 28.3 h for 47,684 steps
#   memory per GPU 70.64 GiB: 0.45 GiB weights, gradients, AdamW (sharded over 256 GPUs by FSDP) + 1.70 GiB gathered
#   bf16 blocks and root + 66.19 GiB activations + 2.30 GiB the logits' gradient; with --activation_checkpointing=True
#   13.73 GiB (a third more FLOPs, 37.7 h). On one node (--dry_run_world_size=8) 84.48 GiB, beyond an 80 GB H100:
#   there, --activation_checkpointing=True (27.58 GiB).
model_type = "free"
dataset = "fineweb_edu_200b"
out_dir = "out-free-8b"
fsdp = True
vocab_size = 50304
block_size = 4096
n_layer = 32
n_embd = 4096
n_head = 32
n_kv_head = 8
ffn_hidden = 14336
rope_theta = 500000.0  # Llama-3
latent_bits = 16
mapper_chunk = 2 ** 26  # the factored backward builds v in pieces of 2^26 values (256 MiB): on a GPU fewer, larger
# matmuls than the CPU default 2^22 (a choice, not a measurement: no GPU timing of this kernel yet)
kappa_bits = 0.5  # §4.5: κ = log(2)/2, half a bit per token; Table 3 also trains 1/4, 1 and 2 bits
# 256 GPUs x 2 sequences x 2 micro-steps x 4,096 tokens = 4,194,304 tokens per step; 200B tokens in 47,684 steps
batch_size = 2
gradient_accumulation_steps = 512  # divided by the number of processes: 2 per GPU on 256 GPUs
dry_run_world_size = 256
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 2000
max_iters = 47684
lr_decay_iters = 47684
weight_decay = 0.1
eval_interval = 1000
checkpoint_interval = 500  # saved whatever the val loss: a preemption costs at most ~18 min (2.1 s a step)
init_from = "auto"  # the same command starts the run and resumes it (torchrun --max_restarts, SLURM --requeue)
eval_iters = 10
log_interval = 10
