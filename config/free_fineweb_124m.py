# The Free Transformer at GPT-2-124M class on FineWeb-Edu: config/det_fineweb_124m.py (8 GPUs, 524,288 tokens per
# step, 10B tokens) plus the encoder block and Z after block 6; only the lines below differ from it. The
# post-sampler (2^16 x 768) adds 50M parameters, a lookup that costs no matmul FLOPs.
#   torchrun --standalone --nproc_per_node=8 train.py config/free_fineweb_124m.py
#
# python train.py config/free_fineweb_124m.py --dry_run=True (8 GPUs, 40% MFU of an H100's 989 TFLOP/s):
#   170,788,608 parameters, 0.95 GFLOPs per token; 418,029 tokens/s per GPU, 0.157 s per step, 0.831 h for 19,073 steps
#   memory per GPU 21.31 GiB: 2.54 GiB weights, gradients, AdamW (replicated by DDP) + 0.64 GiB DDP buckets + 0.22 GiB
#   autocast's copies + 13.30 GiB activations + 4.61 GiB the logits' gradient
exec(open("config/det_fineweb_124m.py").read())
model_type = "free"
out_dir = "out-free-124m"
dry_run_world_size = 8
latent_bits = 16  # H (§4.3)
kappa_bits = 0.5  # κ = log(2)/2, half a bit per token (§4.5); the paper's Table 2 also trains 1/4, 1 and 2 bits
