"""Hugging Face's format of a det model, as a Llama-3 or a Qwen3: its tensor names and config.json for a det
checkpoint, the config.json an import recorded, and the det model inside a checkpoint (scripts/convert.py's conversions,
scripts/harness.py, scripts/bench_cpu.py's transformers comparison)."""

import dataclasses

from nanolatent import common, models

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
QK_NORM_NAMES = [("attn.q_norm.weight", "self_attn.q_norm.weight"), ("attn.k_norm.weight", "self_attn.k_norm.weight")]
# Llama 3.1's rope_scaling keys, in the order of det's rope_scaling tuple
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def weight_names(cfg):
    """(ours, Hugging Face's) for every tensor of a det model of Config cfg; a tied head is the embedding, stored
    once; a model with qk_norm has Qwen3's two per-head gains in each block."""
    names = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm_f.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    layer = LAYER_NAMES + (QK_NORM_NAMES if cfg.qk_norm else [])
    for i in range(cfg.n_layer):
        names += [(f"blocks.{i}.{ours}", f"model.layers.{i}.{theirs}") for ours, theirs in layer]
    return names


def hf_config(cfg, dtype, bos_token_id, eos_token_id):
    """config.json of Qwen3ForCausalLM for a det Config with qk_norm, else of LlamaForCausalLM (with Llama 3.1's
    rope_scaling if it has one). The RoPE settings are written twice: at the top level (rope_theta, rope_scaling),
    where transformers 4 reads them, and under rope_parameters, where transformers 5 does."""
    rope = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        rope = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": float(low),
                "high_freq_factor": float(high), "original_max_position_embeddings": int(original)}
    family = ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}
              if cfg.qk_norm else {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False})
    return {
        **family,
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
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


def imported_hf_config(checkpoint):
    """The config.json an imported model came with (scripts/convert.py hf and gguf record it in the checkpoint's config), or
    {}: its special token ids, which an export and lm-evaluation-harness take back."""
    return (checkpoint.get("config") or {}).get("hf_config") or {}


def det_state(checkpoint, path):
    """The det model inside a checkpoint: (det Config, state_dict). A B-Trans checkpoint is one when its noise is
    off (sigma 0 everywhere, or noise_mode 'mean') and its mu offsets are 0: a Llama or a Qwen3 has no offset."""
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
        common.die(f"{path} holds a {model_type} model: only det (or B-Trans with its noise off) is a Llama or a Qwen3")
    module = models.import_model("det")
    fields = {f.name for f in dataclasses.fields(module.Config)}
    return module.Config(**{k: v for k, v in values.items() if k in fields}), state
