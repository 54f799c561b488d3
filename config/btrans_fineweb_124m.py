# B-Trans ("Many Minds from One Model") at GPT-2-124M class on FineWeb-Edu: config/det_fineweb_124m.py (8 GPUs,
# 524,288 tokens per step, 10B tokens), plus the B-Trans norm offsets; only the lines below differ from it.
#   torchrun --standalone --nproc_per_node=8 train.py config/btrans_fineweb_124m.py
#
# python train.py config/btrans_fineweb_124m.py --dry_run=True (8 GPUs, 40% MFU of an H100's 989 TFLOP/s):
#   114,169,344 parameters, 0.80 GFLOPs per token; 495,612 tokens/s per GPU, 0.132 s per step, 0.701 h for 19,073 steps
#   memory per GPU 19.36 GiB: 1.70 GiB weights, gradients, AdamW (replicated by DDP) + 0.43 GiB DDP buckets + 0.21 GiB
#   autocast's copies + 12.42 GiB activations + 4.61 GiB the logits' gradient
exec(open("config/det_fineweb_124m.py").read())
model_type = "btrans"
out_dir = "out-btrans-124m"
dry_run_world_size = 8
# §4.1 Eq. 4: every RMSNorm output gets mu + sigma * eps. §5: the update phase is deterministic ("the mean shift
# only"), so training here is det training with frozen mu = 0; the minds (one eps per sequence, §3.2, §4.3) are drawn
# when sampling, evaluating (train.py's val loss included) and in RL rollouts.
sigma = 0.02  # the paper gives no value; 0.02 is the only public re-implementation's default
sigma_scale = "gain"  # ours: sigma * |gain| * eps per channel, a fraction of the normalised signal (Eq. 4: 'absolute')
train_noise_mode = "mean"  # §5; 'sequence' trains under the minds (ours, an ablation)
noise_mode = "sequence"  # eval(): one mind per sequence
final_norm_noise = True  # the paper does not say whether the final norm is wrapped; ours: it is (False: an ablation)
learn_mu = False  # §4.1: mu is a hyperparameter, 0 for RMSNorm
