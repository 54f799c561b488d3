# GRPO on the Free Transformer's letters task (§4.1) from the det baseline: python train.py config/det_synthetic.py
# first (and python prepare.py synthetic). The verifier is evaluate.verify_letters: 64 characters of '_' and '!' with
# one run of 8 of the prompt's letter (noise '!' allowed inside it).
# python -m scripts.rlvr config/rlvr_synthetic.py [--rollout=temperature|minds|token] [--reward=ttrl --train_prompts=eval]
init_from = "out-det-synthetic"
out_dir = "out-rlvr-synthetic"
task = "letters"
max_new_tokens = 64  # the 64 characters after "K>" (block_size 66 leaves no room for the final '\n')
eval_prompts = 104  # 26 letters x 4
eval_samples = 8
rollout = "minds"
temperature = 1.0
sigma = 0.3
sigma_scale = "absolute"  # Eq. 4 as written, as this config was measured (model_btrans's default is 'gain')
group_size = 8
prompts_per_step = 4
max_steps = 50
eval_interval = 25
learning_rate = 1e-5
