# GPT-2-124M-class Llama decoder on FineWeb-Edu, for one node of 8 GPUs:
#   python prepare.py fineweb_edu        # sample-10BT: its ~10B tokens in shards of 100M, resumable
#   torchrun --standalone --nproc_per_node=8 train.py config/det_fineweb_124m.py
# 8 x 16 x 4 micro-batches x 1024 tokens = 524,288 tokens per step (GPT-3 small's batch), 10B tokens in 19,073 steps.
#
# python train.py config/det_fineweb_124m.py --dry_run=True (8 GPUs, 40% MFU of an H100's 989 TFLOP/s):
#   114,150,144 parameters, 0.80 GFLOPs per token; 495,648 tokens/s per GPU, 0.132 s per step, 0.701 h for 19,073 steps
#   memory per GPU 19.36 GiB: 1.70 GiB weights, gradients, AdamW (replicated by DDP) + 0.43 GiB DDP buckets + 0.21 GiB
#   autocast's copies + 12.42 GiB activations + 4.61 GiB the logits' gradient (measured, H200, compiled: 12.8 GiB)
model_type = "det"
dataset = "fineweb_edu"
out_dir = "out-det-124m"
vocab_size = 50304  # 50,257 padded to a multiple of 64: faster matmuls; the extra rows are never targets
block_size = 1024
n_layer = 12
n_embd = 768
n_head = 12
n_kv_head = 4
batch_size = 16
gradient_accumulation_steps = 32  # divided by the number of processes: 4 per GPU on 8 GPUs
dry_run_world_size = 8
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 700
max_iters = 19073
lr_decay_iters = 19073
weight_decay = 0.1
eval_interval = 1000
checkpoint_interval = 1000  # saved whatever the val loss: a preemption costs at most ~2 min (8 GPUs, 0.13 s a step)
init_from = "auto"  # the same command starts the run and resumes it (torchrun --max_restarts, SLURM --requeue)
eval_iters = 50
log_interval = 10
