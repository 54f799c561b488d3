# The EVE paper's matched regime (Table 4, §4.5, Fig. 2) at CPU size: GPT-2 BPE on a 500 + 100-story sample of
# WritingPrompts (the first 100 of its 500 training stories, all 100 test stories), 3 blocks, 5 epochs
# over the small data (§4.5), the checkpoint of best validation CE kept (the paper's select_by="ce"). This is EVE's
# deterministic twin, model_eve with variational=False: det's SwiGLU feed-forward, and the head reads the blocks
# through the same layer weights as EVE's (§4.1 keeps the head the same in both arms), so the two differ in the
# feed-forward neurons alone (§3.7; tests/test_eve.py checks it).
#   python prepare.py text --input=wp_train.jsonl --val_input=wp_test.jsonl --fields=prompt,story --max_docs=100 \
#       --vocab=used --name=wp_sample_cpu       # the jsonl files: docs/reproductions.md, "EVE's matched protocol"
#   python train.py config/det_wp_sample.py --device=cpu --compile=False
# --vocab=used keeps the 12,762 GPT-2 ids these stories use, renumbered (vocab_size comes from the dataset): the
# output layer, most of the FLOPs at n_embd = 128, is 4x smaller than GPT-2's 50,257, so a step of 8 x 256 tokens
# takes 0.9 s on our idle 2-core CPU (EVE 1.2 s). The 100 stories are 74,266 training tokens: 36 steps per epoch,
# so eval_interval = 36 evaluates once per epoch and max_iters = 180 is 5 epochs. The paper's frozen embeddings:
# experiments/eve_paper_protocol.py passes --init_embeddings and --freeze_embeddings=True.
# The paper's width is unknown. On a GPU, all 500 stories with GPT-2's whole vocabulary (prepare the same files
# without --max_docs and --vocab, --name=wp_sample): experiments/eve_paper_protocol.py's docstring has the command.
# experiments/eve_paper_protocol.py runs this and config/eve_wp_sample.py over 3 seeds.
model_type = "eve"
variational = False  # det's SwiGLU in place of the neuron bank
dataset = "wp_sample_cpu"
out_dir = "out-det-wp-sample"
block_size = 256
n_layer = 3  # the paper's 3 blocks (layer weights w_0..w_2, §4.4-4.5)
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 8
max_iters = 180  # 5 epochs (§4.5)
lr_decay_iters = 180
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 50
beta2 = 0.99
weight_decay = 0.1
eval_interval = 36  # once per epoch
eval_iters = 10  # 10 x 2,048 = 20,480 of the 86,899 test-story tokens
select_by = "ce"  # §4.5: checkpoints selected by validation CE
log_interval = 20
