# EVE (variational neurons) at GPT-2-124M class on FineWeb-Edu: config/det_fineweb_124m.py (8 GPUs, 524,288 tokens
# per step, 10B tokens) with its SwiGLU feed-forward turned into ffn_hidden = 2,048 variational neurons per block;
# only the lines below differ from it. The EVE paper trains 3-block models (§4); this size is ours.
#   torchrun --standalone --nproc_per_node=8 train.py config/eve_fineweb_124m.py
#
# python train.py config/eve_fineweb_124m.py --dry_run=True (8 GPUs, 40% MFU of an H100's 989 TFLOP/s):
#   114,346,764 parameters, 0.80 GFLOPs per token; 493,460 tokens/s per GPU, 0.133 s per step, 0.704 h for 19,073 steps
#   memory per GPU 21.85 GiB: 1.70 GiB weights, gradients, AdamW (replicated by DDP) + 0.43 GiB DDP buckets + 0.21 GiB
#   autocast's copies + 14.90 GiB activations + 4.61 GiB the logits' gradient
exec(open("config/det_fineweb_124m.py").read())
model_type = "eve"
out_dir = "out-eve-124m"
dry_run_world_size = 8
# §3.6 L = CE + beta KL + L_control + alpha_AR L_AR, §3.3 control: model_eve.Config's defaults (the paper gives none)
kl_beta = 0.2
alpha_ar = 0.1
mu2_target = 0.10
mu2_band = (0.08, 0.145)
homeostat = True
homeostat_warmup = 700  # = warmup_iters
layer_weights = True  # §4.2: the head reads a softmax mix of the 12 blocks' outputs
