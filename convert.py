"""Convert checkpoints between nanolatent's det model and the Hugging Face Llama format, both ways.

    python convert.py hf --src=HuggingFaceTB/SmolLM2-135M --out_dir=out-smollm2    # from the hub (online)
    python convert.py hf --src=path/to/saved_model --out_dir=out-x --block_size=2048  # a local folder (offline)
    python convert.py to_hf --out_dir=out-det --dst=hf-det          # for transformers and lm_eval --model hf

`hf` reads a Llama checkpoint (config.json and *.safetensors, sharded or not) into <out_dir>/ckpt.pt for model_det,
and copies its tokenizer.json beside it, recorded in the checkpoint's meta: sample.py, evaluate.py and --model=btrans
(B-Trans minds) then use it as they use a run of ours. A checkpoint with something model_det does not compute (biases,
RoPE scaling, QK-norm, another activation or architecture) is refused with one line naming the field or tensor.
`to_hf` writes a det checkpoint, or a B-Trans one whose noise is off, as config.json + model.safetensors, plus the
tokenizer files when the run has a Hugging Face tokenizer.

Both ways are a renaming, no arithmetic: model_det rotates the two halves of each head, as transformers' rotate_half
does, so q and k need no permutation, and tensors keep their dtype. safetensors, tokenizers and huggingface_hub are
imported only where used; transformers is not needed at all (the tests use it as the reference implementation).
"""

import dataclasses
import json
import os
import shutil

import torch

import common
import configurator

direction = ""  # the first argument: hf (a Hugging Face Llama checkpoint -> out_dir) or to_hf (out_dir -> dst)
src = ""  # hf: a folder with config.json, *.safetensors and tokenizer.json, or a hub id
out_dir = ""  # hf: the run folder to write; to_hf: the run (its folder or ckpt.pt) to read
dst = ""  # to_hf: the folder to write
block_size = 0  # hf: the context length (RoPE tables, KV cache); 0 = the checkpoint's max_position_embeddings

# One block's tensors: (ours under blocks.{i}., Hugging Face's under model.layers.{i}.).
LAYER_NAMES = [
    ("attn.wq.weight", "self_attn.q_proj.weight"),
    ("attn.wk.weight", "self_attn.k_proj.weight"),
    ("attn.wv.weight", "self_attn.v_proj.weight"),
    ("attn.wo.weight", "self_attn.o_proj.weight"),
    ("mlp.w1.weight", "mlp.gate_proj.weight"),  # SwiGLU: w2(silu(w1 x) * w3 x) = down(silu(gate x) * up x)
    ("mlp.w3.weight", "mlp.up_proj.weight"),
    ("mlp.w2.weight", "mlp.down_proj.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
]
# What a hub download fetches: the weights in safetensors, the config and the tokenizer, nothing else (no .bin
# duplicates, no original/ consolidated files).
HUB_FILES = ["config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def weight_names(n_layer, tied):
    """(ours, Hugging Face's) for every tensor of a det model; a tied head is the embedding, stored once."""
    names = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm_f.weight", "model.norm.weight")]
    if not tied:
        names.append(("lm_head.weight", "lm_head.weight"))
    for i in range(n_layer):
        names += [(f"blocks.{i}.{ours}", f"model.layers.{i}.{theirs}") for ours, theirs in LAYER_NAMES]
    return names


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face -> ours


def fetch(src):
    """A local folder as it is; anything else is a hub repository id, downloaded (or found in the hub's cache)."""
    if os.path.isdir(src):
        return src
    if os.path.exists(src):
        common.die(f"--src={src} is a file: pass the folder that holds config.json and the *.safetensors")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        common.die(f"{src!r} is not a local folder, and downloading it needs huggingface_hub: "
                   f"pip install huggingface_hub")
    try:
        return snapshot_download(src, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, a typo, a gated repository without a login: one line, whichever it is
        reason = (str(e).splitlines() or [""])[0][:160]
        common.die(f"{src!r} is not a local folder and could not be downloaded from the Hugging Face hub "
                   f"({type(e).__name__}: {reason}); offline, pass a folder with config.json, *.safetensors and "
                   f"tokenizer.json; gated models need `hf auth login`")


def config_from_hf(hf, block_size=0):
    """model_det Config values from a Hugging Face config.json, field by field. Whatever model_det would compute
    differently from transformers' LlamaForCausalLM is refused with one line naming the field."""

    def refuse(field, why):
        common.die(f"config.json has {field}={json.dumps(hf.get(field))}: {why}; convert.py reads plain Llama "
                   f"checkpoints (SmolLM2, TinyLlama and the like)")

    if hf.get("model_type") != "llama":
        refuse("model_type", "not the Llama architecture")
    if (hf.get("architectures") or ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        refuse("architectures", "model_det is LlamaForCausalLM")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "model_det's SwiGLU uses silu")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            refuse(field, "model_det's linear layers have no bias")
    # transformers 5 nests rope_theta and the RoPE type under rope_parameters; older configs have rope_theta at the
    # top level and a rope_scaling that is null for plain RoPE. Read both.
    for field in ("rope_scaling", "rope_parameters"):
        rope = hf.get(field) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            refuse(field, "RoPE scaling (long-context variants such as Llama 3.1's) is not in model_det")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(field, "model_det rotates every channel of a head")
    rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    missing = [f for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if f not in hf]
    if missing:
        common.die(f"config.json has no {missing[0]}: not a complete Hugging Face model config")
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    if n_embd % n_head or (hf.get("head_dim") or n_embd // n_head) != n_embd // n_head:
        refuse("head_dim", f"model_det's heads are hidden_size / num_attention_heads = {n_embd} / {n_head} wide")
    return dict(
        vocab_size=hf["vocab_size"],
        n_embd=n_embd,
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,  # absent or null: multi-head attention
        ffn_hidden=hf["intermediate_size"],
        block_size=block_size or hf.get("max_position_embeddings", 2048),  # sizes the RoPE tables (KV caches too)
        rope_theta=float(rope_theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # transformers' LlamaConfig defaults
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def read_safetensors(src):
    """{name: tensor} from model.safetensors or from every shard of model.safetensors.index.json."""
    from safetensors.torch import load_file
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(src, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        common.die(f"{src} has no model.safetensors nor model.safetensors.index.json: convert.py reads safetensors "
                   f"checkpoints only (load a pytorch_model.bin with transformers and save_pretrained it)")
    tensors = {}
    for name in files:
        path = os.path.join(src, name)
        if not os.path.exists(path):
            common.die(f"{path} is missing (model.safetensors.index.json lists it): download the checkpoint again")
        try:
            tensors.update(load_file(path))
        except Exception as e:  # safetensors checks the header against the file's length: a truncated shard fails
            common.die(f"{path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:160]}); it may be "
                       f"truncated: download the checkpoint again")
    return tensors


def state_from_hf(tensors, model):
    """Our state_dict from Hugging Face's tensors, checked name by name and shape by shape against model (built on
    the meta device: shapes without memory). Every tensor must find its place: a QK-norm gain, a bias or anything
    else model_det has no room for is refused by name."""
    cfg = model.config
    expected = model.state_dict()
    state = {}
    for ours, theirs in weight_names(cfg.n_layer, cfg.tie_embeddings):
        if theirs not in tensors:
            common.die(f"the checkpoint has no tensor {theirs} (config.json: {cfg.n_layer} layers, "
                       f"tie_word_embeddings={str(cfg.tie_embeddings).lower()})")
        tensor = tensors.pop(theirs)
        if tensor.shape != expected[ours].shape:
            common.die(f"tensor {theirs} has shape {tuple(tensor.shape)}, config.json implies "
                       f"{tuple(expected[ours].shape)}")
        state[ours] = tensor
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # a stored copy of the tied head: transformers ties it to the embedding
        state["lm_head.weight"] = state["tok_emb.weight"]  # one tensor under both names, as a tied state_dict has
    leftover = [name for name in tensors if not name.endswith("rotary_emb.inv_freq")]  # old saves kept the RoPE table
    if leftover:
        common.die(f"tensor {leftover[0]} (and {len(leftover) - 1} more) has no place in model_det: a bias, a "
                   f"QK-norm or another architecture")
    return state


def import_hf(hub_or_dir, out_dir, block_size=0):
    src = fetch(hub_or_dir)
    config_path = os.path.join(src, "config.json")
    if not os.path.exists(config_path):
        common.die(f"{src} has no config.json: pass a Hugging Face model folder (save_pretrained's output)")
    with open(config_path) as f:
        hf = json.load(f)
    values = config_from_hf(hf, block_size)
    if not os.path.exists(os.path.join(src, "tokenizer.json")):
        common.die(f"{src} has no tokenizer.json, which sample.py and evaluate.py need (a sentencepiece "
                   f"tokenizer.model is not read: save the tokenizer with transformers' AutoTokenizer first)")
    with torch.device("meta"):
        model = common.build_model("det", values)
    state = state_from_hf(read_safetensors(src), model)

    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:  # tokenizer.json for us; the other two for to_hf, if they exist
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    meta = {"tokenizer": "hf", "tokenizer_file": os.path.abspath(os.path.join(out_dir, "tokenizer.json")),
            "vocab_size": values["vocab_size"]}
    # train.py's checkpoint format, without an optimizer: sample.py, evaluate.py and rlvr.py's --init_from read it.
    # "config" says where the weights came from; to_hf takes the special token ids back from hf_config.
    checkpoint = {"model_type": "det", "model_config": common.config_dict(model.config), "model": state,
                  "config": {"init_from": "hf", "src": hub_or_dir, "hf_config": hf}, "meta": meta,
                  "iter_num": 0, "best_val_loss": float("inf")}
    path = os.path.join(out_dir, "ckpt.pt")
    common.save_checkpoint(checkpoint, path)
    dtype = DTYPES.get(state["tok_emb.weight"].dtype, str(state["tok_emb.weight"].dtype))
    print(f"wrote {path}: {model.num_params() / 1e6:.1f}M parameters in {dtype}, {values['n_layer']} layers, "
          f"{values['n_head']}/{values['n_kv_head']} heads, {'tied' if values['tie_embeddings'] else 'untied'} "
          f"head, block_size {values['block_size']}, rope_theta {values['rope_theta']:g}; tokenizer "
          f"{meta['tokenizer_file']}")


# ----------------------------------------------------------------------------------------------------------------
# ours -> Hugging Face


def hf_config(cfg, dtype, bos_token_id, eos_token_id):
    """config.json of LlamaForCausalLM for a det Config. rope_theta is written twice: at the top level, where
    transformers 4 reads it, and under rope_parameters, where transformers 5 does."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


def det_state(checkpoint, path):
    """The det model inside a checkpoint: (det Config, state_dict). A B-Trans checkpoint is one when its noise is
    off (sigma 0 everywhere, or noise_mode 'mean') and its mu offsets are 0: there is no offset in a Llama."""
    model_type, values, state = checkpoint["model_type"], checkpoint["model_config"], checkpoint["model"]
    if model_type == "btrans":
        sigmas = values.get("sigma_per_layer") or [values["sigma"]]
        if values.get("noise_mode") != "mean" and (values.get("learn_sigma") or max(sigmas) > 0):
            common.die(f"{path} is a B-Trans population (sigma={values['sigma']}, noise_mode="
                       f"{values.get('noise_mode')}): a Hugging Face Llama is one model; export its det checkpoint, "
                       f"or one with sigma=0")
        offsets = [name for name, t in state.items() if name.endswith(".mu") and t.any()]
        if offsets:
            common.die(f"{path} has learned B-Trans offsets ({offsets[0]} is not 0), which a Llama cannot hold")
        state = {k: v for k, v in state.items() if not k.endswith((".mu", ".log_sigma"))}
    elif model_type != "det":
        common.die(f"{path} holds a {model_type} model: only det (or B-Trans with its noise off) is a Llama")
    if values.get("layer_weights"):
        common.die(f"{path} was trained with layer_weights=True (EVE's head mixes the blocks' outputs), which a Llama "
                   f"cannot hold: export a det run without it")
    module = common.import_model("det")
    fields = {f.name for f in dataclasses.fields(module.Config)}
    return module.Config(**{k: v for k, v in values.items() if k in fields}), state


def tokenizer_files(meta, dst):
    """Copy the run's Hugging Face tokenizer into dst; for ours, one line on what the user must supply."""
    if meta["tokenizer"] == "hf":
        tokenizer_file = meta["tokenizer_file"]
        common.hf_tokenizer(tokenizer_file)  # one clear line if it is gone
        shutil.copyfile(tokenizer_file, os.path.join(dst, "tokenizer.json"))
        folder = os.path.dirname(tokenizer_file)
        for name in TOKENIZER_FILES[1:]:
            if os.path.exists(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(dst, name))
        if not os.path.exists(os.path.join(dst, "tokenizer_config.json")):  # AutoTokenizer wants the class name
            with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
        print(f"copied the tokenizer: {tokenizer_file}")
    elif meta["tokenizer"] == "gpt2":
        print(f"the run uses GPT-2's BPE: add its tokenizer files with transformers' "
              f"AutoTokenizer.from_pretrained('openai-community/gpt2').save_pretrained('{dst}')")
    else:
        print(f"the run's {meta['tokenizer']} tokenizer has no Hugging Face form: its ids index meta['chars'] of the "
              f"checkpoint; supply a tokenizer for {dst} yourself (the weights load without one)")


def export_hf(out_dir, dst):
    from safetensors.torch import save_file
    checkpoint = common.load_checkpoint(out_dir)
    path = common.checkpoint_path(out_dir)
    if "token_ids" in checkpoint["meta"]:
        common.die(f"{path} was trained on prepare.py --vocab=used ids (a renumbered subset of GPT-2's), which no "
                   f"Hugging Face tokenizer reads: export a model trained on a --vocab=full dataset")
    cfg, state = det_state(checkpoint, path)
    tensors = {theirs: state[ours].contiguous() for ours, theirs in weight_names(cfg.n_layer, cfg.tie_embeddings)}
    dtype = DTYPES[tensors["model.embed_tokens.weight"].dtype]
    hf = (checkpoint.get("config") or {}).get("hf_config") or {}  # an imported model keeps its special tokens
    gpt2_eot = 50256 if checkpoint["meta"]["tokenizer"] == "gpt2" else None
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config(cfg, dtype, hf.get("bos_token_id", gpt2_eot), hf.get("eos_token_id", gpt2_eot)), f,
                  indent=2)
    print(f"wrote {dst}/config.json and model.safetensors ({len(tensors)} tensors, {dtype}) from {path}")
    tokenizer_files(checkpoint["meta"], dst)


def main(argv=None):
    configurator.apply(globals(), argv, positional="direction")
    configurator.require(globals(), non_negative=("block_size",), choices={"direction": ("hf", "to_hf")})
    needed = {"hf": ("src", "out_dir"), "to_hf": ("out_dir", "dst")}[direction]
    if not all(globals()[key] for key in needed):
        common.die(f"convert.py {direction} needs {' and '.join(f'--{key}=...' for key in needed)}")
    if direction == "hf":
        import_hf(src, out_dir, block_size)
    else:
        export_hf(out_dir, dst)


if __name__ == "__main__":
    main()
