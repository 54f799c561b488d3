# GRPO (B-Trans §5.2) on a pretrained chat model: SmolLM2-135M-Instruct imported offline (README, "B-Trans minds on a
# pretrained model"), full fine-tuning (every weight; the paper fine-tunes LoRA adapters).
# python -m scripts.rlvr config/rlvr_smollm2.py [--rollout=temperature] [--task=gsm8k --dataset=DIR_WITH_GSM8K_JSONL]
init_from = "out-smollm2"
out_dir = "out-rlvr-smollm2"
# HellaSwag as lettered multiple choice, the reply's first token the answer: SmolLM2-135M answers almost no GSM8K
# problem (README), so a GSM8K group has no reward to learn from. Held out: the first eval_prompts items; RL prompts:
# the items past them (HellaSwag's labelled items are its validation split).
task = "hellaswag"
# the hub's HellaSwag; offline, the 1,000-item validation sample under $NANOLATENT_LOCAL_DATA, read in its place
# (multiple_choice.LOCAL_COPIES; what the README's numbers were measured on: a random subset of the validation split,
# so its first items are not the hub's)
dataset = "hellaswag"
train_prompts = "val"
eval_prompts = 100
eval_samples = 4
rollout = "minds"
temperature = 1.0
sigma = 0.03  # relative to each norm's gain (the default sigma_scale): +0.08 nats on SmolLM2 (btrans_sigma)
group_size = 8
prompts_per_step = 2  # 16 rollouts a step: what a 2-core CPU updates a 135M model on in ~half a minute
update_batch = 4  # rollouts per forward/backward of the update: GSM8K's 16 at once peaked at 15.8 GiB, 4 at 6.8
max_steps = 30
eval_interval = 30
learning_rate = 1e-5
updates_per_batch = 1
kl_coef = 0.0
