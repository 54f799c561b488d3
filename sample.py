"""Sample from a trained model, optionally with pinned latents.

    python sample.py --out_dir=out --start="K>" --num_samples=8
    python sample.py --out_dir=out --latents=shared --latent_seed=3        # one Z for the whole group (Free Fig. 3)
    python sample.py --init_from=out-det/ckpt.pt --model=btrans --sigma=0.05 --minds=8   # a det model as B-Trans minds
"""

import os
import sys

import torch

import common
from configurator import configure

out_dir = "out"
init_from = "resume"  # 'resume' = out_dir/ckpt.pt, or the path of any checkpoint (file or folder)
model = ""  # load the checkpoint into another model type ('btrans' turns a det checkpoint into B-Trans minds)
start = "\n"  # the prompt, or FILE:path to read it from a file
num_samples = 4
max_new_tokens = 64
temperature = 0.8  # 0 = greedy
top_k = 0  # 0 = no top-k filtering
seed = 1337  # token sampling
latents = "independent"  # 'independent' (a draw per sample), 'shared' (one draw for all), 'posterior' (Free: encode --reference)
latent_seed = -1  # seeds the latents alone (-1: use seed), so the same minds / Z can be kept while tokens vary
minds = 0  # B-Trans: K minds for one prompt (sets num_samples=K with independent latents)
reference = ""  # text whose encoder posterior gives Z for --latents=posterior
device = "cuda" if torch.cuda.is_available() else "cpu"
# ----------------------------------------------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]


def model_fields(values):
    """A Config field may be overridden (--sigma=0.05): the fields of the model the checkpoint is loaded into."""
    path = os.path.join(values["out_dir"], "ckpt.pt") if values["init_from"] == "resume" else values["init_from"]
    return common.config_fields(values["model"] or common.load_checkpoint(path)["model_type"])


config, overrides = configure({k: globals()[k] for k in config_keys}, sys.argv[1:], model_fields)
globals().update(config)

ckpt_path = os.path.join(out_dir, "ckpt.pt") if init_from == "resume" else init_from
net, checkpoint = common.load_model(ckpt_path, device, model or None, **overrides)
net.eval()
encode, decode = common.tokenizer(checkpoint["meta"])
if start.startswith("FILE:"):
    with open(start[5:]) as f:
        start = f.read()
if minds:
    num_samples, latents = minds, "independent"

torch.manual_seed(seed)
token_generator = torch.Generator(device).manual_seed(seed)
latent_generator = torch.Generator(device).manual_seed(seed if latent_seed < 0 else latent_seed)
if latents == "independent":
    pinned = net.sample_latents(num_samples, latent_generator)
elif latents == "shared":
    pinned = net.sample_latents(1, latent_generator)
    pinned = None if pinned is None else common.repeat_latents(pinned, num_samples)
elif latents == "posterior":
    if not hasattr(net, "posterior_latents"):
        common.die(f"--latents=posterior needs a model with an encoder (free); this is a {type(net).__module__} model")
    ref = torch.tensor([encode(reference or start)], dtype=torch.long, device=device)
    pinned = common.repeat_latents(net.posterior_latents(ref, latent_generator), num_samples)
else:
    common.die(f"--latents must be independent, shared or posterior, got {latents!r}")

prompt = torch.tensor([encode(start)] * num_samples, dtype=torch.long, device=device)  # (num_samples, T)
try:
    out = net.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k or None, latents=pinned,
                       generator=token_generator)
except ValueError as e:
    common.die(str(e))
for row in out.tolist():
    print(decode(row))
    print("---------------")
