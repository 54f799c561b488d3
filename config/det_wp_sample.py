# The EVE paper's matched regime (Table 4, §4.5, Fig. 2) at CPU size: GPT-2 BPE on the 500 / 100 WritingPrompts
# stories of ../shared/data/writingprompts, 3 blocks, trained for several epochs over the small data so that det's
# validation CE turns up, the checkpoint of best validation CE kept (the paper's select_by="ce").
#   python prepare.py text --input=../shared/data/writingprompts/wp_sample_train.jsonl \
#       --val_input=../shared/data/writingprompts/wp_sample_test.jsonl --fields=prompt,story --name=wp_sample \
#       --bpe_file=../shared/data/gpt2/gpt2.tiktoken
#   python train.py config/det_wp_sample.py --device=cpu --compile=False
# The 500 stories are 409,941 training tokens: 200 steps of 8 x 256 = 2,048 tokens per epoch, so eval_interval = 200
# evaluates once per epoch and max_iters = 1,600 is 8 epochs. The paper's width is unknown; n_embd = 128 is small,
# but the 50,304 x 128 GPT-2 vocabulary head is most of the 43 MFLOPs per token: measured 16-25 s per step on a
# shared, loaded 2-core CPU (one thread), about an hour per epoch there. The full protocol is a GPU run.
# experiments/eve_paper_protocol.py runs this and config/eve_wp_sample.py over 3 seeds.
model = "det"
dataset = "wp_sample"
out_dir = "out-det-wp-sample"
vocab_size = 50304  # GPT-2's 50,257 padded to a multiple of 64
block_size = 256
n_layer = 3  # the paper's 3 blocks (layer weights w_0..w_2, §4.4-4.5)
n_embd = 128
n_head = 4
n_kv_head = 2
batch_size = 8
max_iters = 1600  # 8 epochs
lr_decay_iters = 1600
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 50
beta2 = 0.99
weight_decay = 0.1
eval_interval = 200  # once per epoch
eval_iters = 10  # 10 x 2,048 = 20,480 of the 86,899 test-story tokens
select_by = "ce"  # §4.5: checkpoints selected by validation CE
log_interval = 20
