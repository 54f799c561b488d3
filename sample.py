"""Sample from a trained model, optionally with pinned latents.

    python sample.py --out_dir=out --start="K>" --num_samples=8
    python sample.py --out_dir=out --latents=shared --latent_seed=3        # one Z for the whole group (Free Fig. 3)
    python sample.py --out_dir=out-det/ckpt.pt --model_type=btrans --sigma=0.05 --minds=8   # a det model as B-Trans minds
    python sample.py --out_dir=out-smollm2 --chat=True --start="Name three colours."   # an Instruct model, as trained
"""

import contextlib
import os

import torch

import configurator
from nanolatent import ckpt, common, cpu, models, tokendata

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
reference = ""  # text whose encoder posterior gives Z for --latents=posterior
onednn = True  # CPU, float32 or bfloat16: matmuls through weights laid out for them (cpu.inference_linears: oneDNN's,
# or for one sample on one thread a matrix-vector layout): faster, float rounding apart
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
                     choices={"latents": ("independent", "shared", "posterior"),
                              "prompt_latents": ("encoder", "prior"), "dtype": tuple(common.DTYPES)})
common.check_device(device)
if latent_seed < -1:
    common.die(f"--latent_seed must be >= 0, or -1 to use --seed; got {latent_seed}")
if start.startswith("FILE:"):
    if os.path.isdir(start[5:]):
        common.die(f"--start=FILE:{start[5:]} is a folder; give the path of a text file holding the prompt")
    if not os.path.isfile(start[5:]):
        common.die(f"--start=FILE:{start[5:]}: no such file; give the path of a text file holding the prompt")
    try:
        with open(start[5:], encoding="utf-8") as f:  # whatever the locale: prompts, like prepared text, are UTF-8
            start = f.read()
    except UnicodeDecodeError as e:
        common.die(f"--start=FILE:{start[5:]} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, "
                   f"e.g. iconv -t utf-8")
if not start:
    common.die("--start is empty: the model needs at least one token to continue (the default is a newline)")
if chat:
    start = tokendata.chat_prompt(checkpoint["meta"], start)

model, _ = ckpt.load_model(out_dir, device, model_type or None, checkpoint=checkpoint, **overrides)
checkpoint.pop("model")  # the model holds the weights now: unmap the checkpoint's pages (513 MiB for SmolLM2)
model.eval()
for p in model.parameters():  # the weights in --dtype: a decode step reads every weight, so half the bytes in 16 bits
    p.data = p.data.to(common.DTYPES[dtype])
encode, decode = tokendata.tokenizer(checkpoint["meta"])
if minds:
    num_samples, latents = minds, "independent"

torch.manual_seed(seed)
token_generator = torch.Generator(device).manual_seed(seed)
latent_generator = torch.Generator(device).manual_seed(seed if latent_seed < 0 else latent_seed)
prompt = torch.tensor([encode(start)] * num_samples, dtype=torch.long, device=device)  # (num_samples, T)
if prompt.size(1) > model.config.block_size:
    common.die(f"the prompt has {prompt.size(1)} tokens, more than the context (block_size={model.config.block_size})")
consistent_with = prompt[:1] if prompt_latents == "encoder" else None  # Free: Z of the prompt from its encoder
if latents == "independent":
    pinned = model.sample_latents(num_samples, latent_generator, prompt=consistent_with)
elif latents == "shared":  # one prompt-Z draw and one sequence of per-token codes for the whole group
    pinned = model.sample_latents(1, latent_generator, prompt=consistent_with)
    pinned = None if pinned is None else models.repeat_latents(pinned, num_samples)
else:
    if model.latent_kind != "code":
        common.die(f"--latents=posterior needs a model with an encoder (free); this one's latents are "
                   f"{model.latent_kind!r}")
    ref = torch.tensor([encode(reference or start)], dtype=torch.long, device=device)
    if ref.size(1) > model.config.block_size:
        common.die(f"the {'--reference' if reference else 'prompt'} has {ref.size(1)} tokens, more than the context "
                   f"(block_size={model.config.block_size}): the encoder reads it whole; shorten it")
    pinned = models.repeat_latents(model.posterior_latents(ref, latent_generator), num_samples)

# The decode step compiled once for every position: the position is an int that changes at each step (dynamic).
step = torch.compile(model.forward, dynamic=True) if compile else None
products = contextlib.nullcontext() if compile or not onednn else \
    cpu.inference_linears(model, common.DTYPES[dtype], batch_size=num_samples)
try:
    with products:
        out = model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k or None, latents=pinned,
                           generator=token_generator, step=step)
except ValueError as e:
    common.die(str(e))
# A chat answer ends at the end-of-turn token (generation_config.json's eos_token_id): what follows it is cut.
stop = tokendata.hf_json(checkpoint["meta"], "generation_config.json").get("eos_token_id") if chat else None
stop = set(stop if isinstance(stop, list) else [stop])
for row in out.tolist():
    end = next((t + 1 for t in range(prompt.size(1), len(row)) if row[t] in stop), len(row))
    print(decode(row[:end]))
    print("---------------")
