"""Sample from a trained model, optionally with pinned latents.

    python sample.py --out_dir=out --start="K>" --num_samples=8
    python sample.py --out_dir=out --latents=shared --latent_seed=3        # one Z for the whole group (Free Fig. 3)
    python sample.py --out_dir=out-det/ckpt.pt --model_type=btrans --sigma=0.05 --minds=8   # a det model as B-Trans minds
    python sample.py --out_dir=out --start="K>" --num_samples=8 --summary=True   # how much a shared draw carries
    python sample.py --out_dir=out-smollm2 --chat=True --start="Name three colours."   # an Instruct model, as trained
"""

import gc

import configurator  # before torch: it answers a bare --help from this file's source

import torch

from nanolatent import ckpt, common, models, sampling, speedups, tokendata

out_dir = "out"  # the run to sample from: its folder, or the path of any ckpt.pt
model_type = ""  # load the checkpoint into another model type ('btrans' turns a det checkpoint into B-Trans minds)
start = "\n"  # the prompt, or FILE:path to read it from a file
chat = False  # wrap --start in the run's chat template as one user message (an imported Instruct model)
num_samples = 4
max_new_tokens = 64
temperature = 0.8  # 0 = greedy
top_k = 0  # 0 = no top-k filtering
seed = 1337  # token sampling
latents = "independent"  # 'independent' (a draw per sample), 'shared' (one draw for all), 'posterior' (Free: encode --reference)
prompt_latents = "encoder"  # Free: the prompt's Z from the 'encoder' on the prompt (§3.2), or the uniform 'prior' as well
latent_seed = -1  # seeds the latents alone (-1: use seed), so the same minds / Z can be kept while tokens vary
minds = 0  # B-Trans: K minds for one prompt (sets num_samples=K with independent latents)
pin_mind = -1  # with independent latents: every sample gets draw i of the num_samples draws (mind i), tokens afresh
summary = False  # sample --groups groups sharing a draw (latent seeds latent_seed, +1, ...), then num_samples with a
# draw each, all with --seed's token draws, and print how much the draw carries (the explorer's Groups numbers)
groups = 2  # shared-draw groups of num_samples each, for --summary
reference = ""  # text whose encoder posterior gives Z for --latents=posterior
show_latents = False  # Free, with pinned latents (shared, posterior): also print each sample's Z, H bits per token,
# and with posterior the KL in bits of each position's Z from the encoder reading --reference
z = ""  # Free, with pinned latents: the first positions' Z as --show_latents prints them, in place of the drawn ones
kernels = "fast"  # CPU, float32 or bfloat16: matmuls through weights laid out for them (cpu.inference_linears: oneDNN's,
# or for one sample on one thread a matrix-vector layout), each after a probe of its module: faster, float rounding
# apart. 'plain': every module's own forward, bit for bit (docs/models.md, Changing a model)
compile = False  # torch.compile the one-token decode step (gpt-fast's decode_one_token); the prefill stays eager
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "float32"  # of the weights: bfloat16 or float16 halve the bytes a decode step reads
# ----------------------------------------------------------------------------------------------------------------
checkpoint = None


def model_fields(values):
    """A Config field may be overridden (--sigma=0.05): the fields of the model the checkpoint is loaded into. The
    checkpoint read here is memory-mapped, so asking it its type costs little and its tensors are read once."""
    global checkpoint
    checkpoint = ckpt.load_checkpoint(values["out_dir"])
    return models.config_fields(values["model_type"] or checkpoint["model_type"])


config, overrides = configurator.apply(globals(), model_fields=model_fields)
configurator.require(config, positive=("num_samples", "max_new_tokens"),
                     non_negative=("temperature", "top_k", "minds", "seed"),
                     choices={"latents": sampling.LATENTS,
                              "prompt_latents": ("encoder", "prior"), "dtype": tuple(common.DTYPES),
                              "kernels": speedups.KERNELS})
common.check_device(device)
speedups.use(kernels)
if pin_mind >= 0 and latents != "independent":
    common.die(f"--pin_mind={pin_mind} picks one of the independent draws: drop --latents={latents}")
if summary and (latents != "independent" or minds or pin_mind >= 0 or groups < 1):
    common.die("--summary draws its own groups (--groups >= 1 of them): drop --latents, --minds and --pin_mind")
if latent_seed < -1:
    common.die(f"--latent_seed must be >= 0, or -1 to use --seed; got {latent_seed}")
if start.startswith("FILE:"):
    start = common.read_text_file("start", start[5:])
if not start:
    common.die("--start is empty: the model needs at least one token to continue (the default is a newline)")
if chat:
    start = tokendata.chat_prompt(checkpoint["meta"], start)

with common.phase(f"loading {out_dir}"):
    model, _ = ckpt.load_model(out_dir, device, model_type or None, checkpoint=checkpoint, **overrides)
checkpoint.pop("model")  # the model holds the weights now: unmap the checkpoint's pages (513 MiB for SmolLM2)
model.eval()
for p in model.parameters():  # the weights in --dtype: a decode step reads every weight, so half the bytes in 16 bits
    p.data = p.data.to(common.DTYPES[dtype])
encode, decode = tokendata.tokenizer(checkpoint["meta"])
gc.freeze()  # as train.py: start-up's objects live to the end, so no collection walks them again, nor the exit
if minds:
    num_samples, latents = minds, "independent"

reference_ids = encode(reference or start) if latents == "posterior" else None
if z and model.latent_kind != "code":
    common.die(f"--z sets the Free Transformer's codes; this model's latents are {model.latent_kind!r}")
codes = sampling.parse_bits(z, model.config.latent_bits) if z else None
# A chat answer ends at the end-of-turn token (generation_config.json's eos_token_id): what follows it is cut.
stop = tokendata.hf_json(checkpoint["meta"], "generation_config.json").get("eos_token_id") if chat else None
stop = set(stop if isinstance(stop, list) else [stop])
blocks = [("shared", (seed if latent_seed < 0 else latent_seed) + g) for g in range(groups)] if summary else []
blocks += [(latents, latent_seed)]  # the samples asked for, last
rows = []
for b, (how, block_seed) in enumerate(blocks):
    block_seed = seed if block_seed < 0 else block_seed
    if summary:  # which rows share a draw: the label sample.py's separators alone would not give
        print(f"# block {b + 1} of {len(blocks)}: " + (f"shared draw {b + 1} (latent seed {block_seed}), one draw for "
              f"its {num_samples} samples" if how == "shared" else f"a draw each for {num_samples} samples (latent "
              f"seed {block_seed})") + ", token seed " + str(seed))
    # a line per new token where progress lines are on (a long generation is otherwise a silent minute)
    ticks = common.progress(range(max_new_tokens - 1), desc=f"block {b + 1} of {len(blocks)}, new tokens")
    on_token = (lambda _: next(ticks, None)) if common.progress_every() is not None else None
    out, pinned = sampling.sample(model, encode(start), num_samples, max_new_tokens, seed=seed, latent_seed=block_seed,
                                  latents=how, prompt_latents=prompt_latents, reference=reference_ids,
                                  temperature=temperature, top_k=top_k, dtype=dtype, compile=compile,
                                  pin=pin_mind, codes=codes, on_token=on_token)
    for _ in ticks if on_token else ():  # the generator's last line: the last token is not fed back
        pass
    rows.append(out.tolist())
    for i, row in enumerate(rows[-1]):
        end = next((t + 1 for t in range(out.size(1) - max_new_tokens, len(row)) if row[t] in stop), len(row))
        print(decode(row[:end]))
        if show_latents and model.latent_kind == "code":  # Z_t of every token, H bits each, in the order of the tokens
            print("Z:", " ".join(sampling.code_bits(pinned[i, :len(row)].tolist(), model.config.latent_bits)))
        print("---------------")
if show_latents and latents == "posterior":
    print("KL bits:", " ".join(f"{kl:.3f}" for kl in sampling.posterior_kl_bits(model, reference_ids)))
if summary:
    print("\n".join(sampling.summary_lines(sampling.group_summary(
        rows[:-1], rows[-1], len(encode(start)), decode, checkpoint.get("config", {}).get("dataset")))))
