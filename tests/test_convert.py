"""convert.py against transformers, an implementation no one here wrote: a Hugging Face Llama, Llama-3.1-style
(rope_type llama3, read beyond its original context) or Qwen3 (q/k norms, its own head_dim) imported into model_det
gives transformers' logits, loss and greedy tokens, and B-Trans minds drawn from it; a det checkpoint exported loads
in transformers with the same logits; an imported tokenizer works through sample.py, prepare.py and evaluate.py; other
architectures and broken files are refused with one line (the refusals that need no Hugging Face package:
test_convert_refusals.py). Also the tie_embeddings switch of the four model files."""

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the reference implementation of Llama (pip install transformers)")
pytest.importorskip("safetensors", reason="Hugging Face checkpoints are safetensors files (pip install safetensors)")
tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers (pip install tokenizers)")
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config,  # noqa: E402
                          Qwen3ForCausalLM)

from conftest import run_script  # noqa: E402

from nanolatent import ckpt, hf_format, models, tokendata  # noqa: E402
from scripts import convert  # noqa: E402

TEXT = "".join(  # a few KB of English-like text, enough for a BPE of a few hundred tokens
    f"The {a} model reads the {b} and writes a {c}. Each mind of the {a} model sees the same {b}, yet writes its "
    f"own {c}; a population of minds explores more than one.\n"
    for a in ("small", "tiny", "random", "pretrained") for b in ("prompt", "context", "question", "story")
    for c in ("answer", "story", "line"))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE (GPT-2's scheme) trained on TEXT, saved as a tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_llama(folder, tokenizer_file, tie, n_kv_head=2, rope_theta=500.0, rms_norm_eps=1e-3, max_shard_size=None,
             legacy_config=False):
    """A random LlamaForCausalLM saved with save_pretrained (+ tokenizer.json). Weights are drawn wider than a fresh
    model's and the norm gains away from 1, so that any misplaced tensor or constant moves the logits visibly.
    legacy_config rewrites config.json the way transformers 4 wrote it (SmolLM2's): rope_theta at the top level."""
    torch.manual_seed(0)
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=n_kv_head, max_position_embeddings=64,
                         rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie,
                         initializer_range=0.1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    shutil.copyfile(tokenizer_file, os.path.join(folder, "tokenizer.json"))
    if legacy_config:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            values = json.load(f)
        values["rope_theta"] = values.pop("rope_parameters")["rope_theta"]
        values["rope_scaling"] = None
        with open(path, "w") as f:
            json.dump(values, f)
    return model


# The paper's two families, tiny: Llama 3.1's RoPE remap with an original context of 64 positions, read up to 160
# (head_dim 16 and theta 100 put 2 frequencies below the remap's band, 3 in it, 3 above); Qwen3's per-head q/k
# RMSNorms with heads 32 wide where hidden_size / heads is 16.
FAMILIES = {
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(
        max_position_embeddings=160, rope_parameters={
            "rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(max_position_embeddings=160, head_dim=32, rope_theta=1000.0)),
}


def hf_family(folder, tokenizer_file, family, tie):
    """A random Llama-3.1-style or Qwen3-style model saved with save_pretrained (+ tokenizer.json), its norm gains
    (q/k norms included) away from 1, as hf_llama's."""
    torch.manual_seed(0)
    config_class, model_class, values = FAMILIES[family]
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                          initializer_range=0.1, **values)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    shutil.copyfile(tokenizer_file, os.path.join(folder, "tokenizer.json"))
    return model


def refusal(capsys, *argv):
    """Run convert.py in-process expecting a refusal: exit code 2 and one line on stderr; returns the line."""
    capsys.readouterr()  # what ran before (transformers' progress bars)
    with pytest.raises(SystemExit) as exit_info:
        convert.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face -> ours


@pytest.mark.parametrize("tie, n_kv_head, rope_theta, rms_norm_eps, max_shard_size, legacy_config", [
    (True, 2, 500.0, 1e-3, None, False),  # tied, GQA (2 query heads per KV head), transformers 5's config.json
    (False, 1, 100.0, 1e-4, "40KB", False),  # untied, multi-query, sharded files
    (False, 4, 50.0, 1e-2, None, True),  # multi-head, rope_theta at the top level (transformers 4's config.json)
], ids=["tied-gqa", "untied-mqa-sharded", "untied-mha-legacy-config"])
def test_import_gives_the_logits_loss_and_greedy_tokens_of_transformers(tmp_path, tokenizer_file, tie, n_kv_head,
                                                                        rope_theta, rms_norm_eps, max_shard_size,
                                                                        legacy_config):
    hf = hf_llama(tmp_path / "hf", tokenizer_file, tie, n_kv_head, rope_theta, rms_norm_eps, max_shard_size,
                  legacy_config)
    assert (len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1) == bool(max_shard_size)
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    ours, checkpoint = ckpt.load_model(tmp_path / "ours")
    ours.eval()
    cfg = ours.config
    assert (cfg.n_kv_head, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (n_kv_head, rope_theta, rms_norm_eps,
                                                                                 tie)
    assert (cfg.block_size, cfg.ffn_hidden, cfg.vocab_size) == (64, 96, hf.config.vocab_size)
    assert (ours.lm_head.weight is ours.tok_emb.weight) == tie
    assert checkpoint["meta"]["tokenizer"] == "hf" and checkpoint["meta"]["vocab_size"] == cfg.vocab_size

    idx = torch.randint(cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx, labels=idx)  # transformers shifts the labels inside: position t predicts idx[t + 1]
        logits, loss, _ = ours(idx[:, :-1], idx[:, 1:])
    assert ref.logits.abs().max() > 1  # far from the ~0 logits of an untrained head: the comparison has teeth
    torch.testing.assert_close(logits, ref.logits[:, :-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)

    prompt = idx[:, :8]
    expected = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 20, temperature=0), expected)


@pytest.mark.slow  # transformers' generate as the reference: about 10 s
@pytest.mark.parametrize("family, tie", [("llama3", True), ("qwen3", False), ("qwen3", True)],
                         ids=["llama3-tied", "qwen3-untied", "qwen3-tied"])
def test_llama3_and_qwen3_import_gives_transformers_logits_beyond_the_original_context_and_30_greedy_tokens(
        tmp_path, tokenizer_file, family, tie):
    hf = hf_family(tmp_path / "hf", tokenizer_file, family, tie)
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    ours, _ = ckpt.load_model(tmp_path / "ours")
    ours.eval()
    cfg = ours.config
    expected = {"llama3": (16, False, (8.0, 1.0, 4.0, 64)), "qwen3": (32, True, None)}[family]
    assert (cfg.head_dim, cfg.qk_norm, cfg.rope_scaling) == expected and cfg.block_size == 160
    assert (ours.lm_head.weight is ours.tok_emb.weight) == tie

    idx = torch.randint(cfg.vocab_size, (2, 151), generator=torch.Generator().manual_seed(1))  # 150 > 64 positions
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        logits, loss, _ = ours(idx[:, :-1], idx[:, 1:])
    assert ref.logits.abs().max() > 1
    torch.testing.assert_close(logits, ref.logits[:, :-1], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(loss, ref.loss, rtol=2e-5, atol=2e-5)
    # The family's own computation is what matches: without it (plain RoPE; no q/k norms) the logits move.
    plain = models.build_model("det", {**models.config_dict(cfg), "rope_scaling": None, "qk_norm": False}).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "q_norm" not in k and "k_norm" not in k})
    with torch.no_grad():
        assert (plain(idx[:, :-1], idx[:, 1:])[0] - ref.logits[:, :-1]).abs().max() > 1e-2

    prompt = idx[:, :100]  # greedy decoding from position 100 on, past the original context of 64
    expected = hf.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 30, temperature=0), expected)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_llama3_and_qwen3_export_gives_back_the_same_tensors_and_config(tmp_path, tokenizer_file, family):
    hf_family(tmp_path / "hf", tokenizer_file, family, tie=False)
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    convert.main(["to_hf", f"--out_dir={tmp_path / 'ours'}", f"--dst={tmp_path / 'back'}"])
    from safetensors.torch import load_file
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    assert any("q_norm" in k for k in back) == (family == "qwen3")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model) is type(reference) is FAMILIES[family][1]
    for field in ("head_dim", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
                  "max_position_embeddings"):
        assert getattr(model.config, field) == getattr(reference.config, field), field
    idx = torch.randint(model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(idx).logits, reference(idx).logits)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_btrans_minds_of_an_imported_family_are_det_at_sigma_0_differ_per_sequence_and_stay_frozen(
        tmp_path, tokenizer_file, family):
    hf_family(tmp_path / "hf", tokenizer_file, family, tie=True)
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    det, _ = ckpt.load_model(tmp_path / "ours")
    zero, _ = ckpt.load_model(tmp_path / "ours", model_type="btrans", sigma=0.0)
    minds, _ = ckpt.load_model(tmp_path / "ours", model_type="btrans", sigma=0.05)
    det.eval(), zero.eval(), minds.eval()
    # §4: the offsets follow the 2L + 1 hidden-size norms; Qwen3's per-head q/k norms stay plain (docs/models.md)
    plain = [name for name, m in minds.named_modules() if type(m).__name__ == "RMSNorm"]
    assert plain == ([f"blocks.{i}.attn.{w}_norm" for i in range(2) for w in "qk"] if family == "qwen3" else [])
    assert [type(norm).__name__ for norm in minds.norms()] == ["BayesianBiasNorm"] * 5
    idx = torch.randint(det.config.vocab_size, (3, 120), generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        assert torch.equal(zero(idx, idx, latents=zero.sample_latents(3, g))[0], det(idx, idx)[0])
        same = idx[:1].expand(3, -1)  # one sequence read by three minds
        latents = minds.sample_latents(3, g)
        logits = minds(same, same, latents=latents)[0]
        assert all((logits[i] - logits[j]).abs().max() > 1e-3 for i, j in ((0, 1), (0, 2), (1, 2)))
        # §4.3: each mind's eps is frozen for its sequence: generating with the KV cache, step by step, applies the
        # same offsets as one forward over the whole generated text (its greedy argmax is every generated token)
        out = minds.generate(same[:, :60], 30, temperature=0, latents=latents)
        full = minds(out[:, :-1], out[:, 1:], latents=latents)[0]
    assert torch.equal(full[:, 59:].argmax(-1), out[:, 60:])
    assert len({tuple(row) for row in out[:, 60:].tolist()}) > 1  # the minds wrote different continuations


def test_export_of_an_import_gives_back_the_same_files(tmp_path, tokenizer_file, capsys):
    hf_llama(tmp_path / "hf", tokenizer_file, tie=False)
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    convert.main(["to_hf", f"--out_dir={tmp_path / 'ours'}", f"--dst={tmp_path / 'back'}"])
    assert "copied the tokenizer" in capsys.readouterr().out
    from safetensors.torch import load_file
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for field in ("num_key_value_heads", "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
                  "bos_token_id", "eos_token_id"):
        assert getattr(model.config, field) == getattr(reference.config, field), field
    tok, text = AutoTokenizer.from_pretrained(tmp_path / "back"), "Each mind of the model writes its own story."
    assert tok(text)["input_ids"] == tokenizers.Tokenizer.from_file(str(tokenizer_file)).encode(text).ids
    # the import records its config.json under the key the export and harness.py read
    checkpoint = ckpt.load_checkpoint(tmp_path / "ours")
    assert reference.config.bos_token_id is not None
    assert hf_format.imported_hf_config(checkpoint)["bos_token_id"] == reference.config.bos_token_id


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_the_chat_template_and_generation_config_survive_import_and_export(tmp_path, tokenizer_file, where):
    """transformers 5 saves the template as chat_template.jinja, older saves inside tokenizer_config.json: either way
    hf and to_hf carry it (and generation_config.json) unchanged, and --chat renders it as transformers does."""
    hf_llama(tmp_path / "hf", tokenizer_file, tie=True)
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}"  # and Qwen3's switch for its thinking trace
                "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                # Llama 3.x dates its system turn; transformers' tojson leaves <, > and & as they are
                "{{ strftime_now('%Y') }}{{ {'tag': '<a&b>', 'é': 1} | tojson }}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if where == "chat_template.jinja":
        (tmp_path / "hf" / where).write_text(template)
    else:
        config["chat_template"] = template
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    convert.main(["to_hf", f"--out_dir={tmp_path / 'ours'}", f"--dst={tmp_path / 'back'}"])
    for name in (where, "generation_config.json"):  # save_pretrained wrote the generation config
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    meta = ckpt.load_checkpoint(tmp_path / "ours")["meta"]
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "back")
    for switch in ({}, {"enable_thinking": False}):
        expected = hf_tok.apply_chat_template([{"role": "user", "content": "Each mind"}], tokenize=False,
                                              add_generation_prompt=True, **switch)
        assert tokendata.chat_prompt(meta, "Each mind", **switch) == expected == (
            "<user>Each mind<|endoftext|>\n<assistant>" + ("<think></think>" if switch else "")
            + time.strftime("%Y") + '{"tag": "<a&b>", "é": 1}')
    # the end of a turn, where rlvr.py and the Pass@K study cut a reply: the eos_token of tokenizer_config.json
    encode, _ = tokendata.tokenizer(meta)
    assert tokendata.turn_end(meta, encode) == hf_tok.eos_token_id == hf_tok.convert_tokens_to_ids("<|endoftext|>")


# ----------------------------------------------------------------------------------------------------------------
# ours -> Hugging Face


def our_checkpoint(path, model_type="det", tie=True, **config):
    """A random det model of ours saved in train.py's format (char tokenizer), norm gains away from 1; the model."""
    torch.manual_seed(0)
    model = models.build_model(model_type, dict(vocab_size=40, n_layer=2, n_embd=48, n_head=4, n_kv_head=2,
                                                block_size=32, rope_theta=300.0, norm_eps=1e-4, tie_embeddings=tie,
                                                **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.normal_(1.0, 0.3)
    os.makedirs(path, exist_ok=True)
    ckpt.save_checkpoint({"model_type": model_type, "model_config": models.config_dict(model.config),
                          "model": model.state_dict(), "config": {}, "iter_num": 0, "best_val_loss": 1.0,
                          "meta": {"tokenizer": "char", "chars": [chr(32 + i) for i in range(40)],
                                   "vocab_size": 40}}, os.path.join(path, "ckpt.pt"))
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, capsys, tie):
    ours = our_checkpoint(tmp_path / "run", tie=tie)
    convert.main(["to_hf", f"--out_dir={tmp_path / 'run'}", f"--dst={tmp_path / 'hf'}"])
    assert "char tokenizer has no Hugging Face form" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.tie_word_embeddings == tie and hf.config.rope_parameters["rope_theta"] == 300.0
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tie
    idx = torch.randint(40, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx, idx)[0], rtol=1e-5, atol=1e-5)


def test_btrans_exports_only_with_its_noise_off(tmp_path, capsys):
    det = our_checkpoint(tmp_path / "off", "btrans", sigma=0.0)
    convert.main(["to_hf", f"--out_dir={tmp_path / 'off'}", f"--dst={tmp_path / 'hf'}"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, det(idx, idx)[0], rtol=1e-5, atol=1e-5)
    our_checkpoint(tmp_path / "on", "btrans", sigma=0.02)
    assert "B-Trans population (sigma=0.02" in refusal(capsys, "to_hf", f"--out_dir={tmp_path / 'on'}",
                                                       f"--dst={tmp_path / 'x'}")
    our_checkpoint(tmp_path / "eve", "eve")
    assert "holds a eve model" in refusal(capsys, "to_hf", f"--out_dir={tmp_path / 'eve'}", f"--dst={tmp_path / 'x'}")


def test_a_model_on_renumbered_gpt2_ids_is_not_exported(tmp_path, capsys):
    our_checkpoint(tmp_path / "used")
    path = tmp_path / "used" / "ckpt.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["meta"] = {"tokenizer": "gpt2", "vocab_size": 40, "token_ids": list(range(0, 400, 10))}
    ckpt.save_checkpoint(checkpoint, path)
    assert "--vocab=used" in refusal(capsys, "to_hf", f"--out_dir={tmp_path / 'used'}", f"--dst={tmp_path / 'x'}")
    assert not os.path.exists(tmp_path / "x")


# ----------------------------------------------------------------------------------------------------------------
# the scripts on an imported model, with its tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def imported(request, tmp_path_factory, tokenizer_file):
    """An untied random Llama, or Qwen3, with the BPE tokenizer, imported by the command line; (folder, HF model,
    tokenizer)."""
    root = tmp_path_factory.mktemp("imported")
    hf = (hf_llama(root / "hf", tokenizer_file, tie=False) if request.param == "llama" else
          hf_family(root / "hf", tokenizer_file, request.param, tie=False))
    run_script("-m", "scripts.convert", "hf", f"--src={root / 'hf'}", f"--out_dir={root / 'ours'}", data_dir=root)
    return root, hf, tokenizers.Tokenizer.from_file(str(tokenizer_file))


@pytest.mark.slow
def test_sample_py_decodes_the_greedy_tokens_of_transformers_also_as_btrans_minds(imported):
    root, hf, tok = imported
    prompt = "Each mind of the"
    ids = torch.tensor([tok.encode(prompt).ids])
    expected = tok.decode(hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0].tolist())
    args = ["sample.py", f"--out_dir={root / 'ours'}", f"--start={prompt}", "--temperature=0", "--max_new_tokens=12",
            "--device=cpu"]
    out = run_script(*args, "--num_samples=1", data_dir=root).stdout
    assert out.count(expected + "\n---------------\n") == 1
    # The untied checkpoint as B-Trans minds: with sigma = 0 every mind is the det model.
    out = run_script(*args, "--model_type=btrans", "--minds=3", "--sigma=0.0", data_dir=root).stdout
    assert out.count(expected + "\n---------------\n") == 3


@pytest.mark.slow
def test_sample_py_chat_refuses_a_run_without_a_chat_template_in_one_line(imported):
    root, _, _ = imported
    proc = run_script("sample.py", f"--out_dir={root / 'ours'}", "--chat=True", "--start=Each mind", "--device=cpu",
                      data_dir=root, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "has no chat template" in proc.stderr


@pytest.mark.slow
def test_evaluate_py_mc_and_lm_agree_with_transformers(imported, tmp_path):
    root, hf, tok = imported
    encode = lambda text: tok.encode(text).ids

    def log_likelihood(context, choice):  # the harness' tokenization: the continuation is what follows the context
        ctx, full = encode(context), encode(context + " " + choice)
        with torch.no_grad():
            log_p = hf(torch.tensor([full])).logits[0].log_softmax(-1)
        return sum(log_p[t - 1, full[t]].item() for t in range(len(ctx), len(full)))

    # Each example's label is transformers' pick, so evaluate.py's accuracy is 1 only if it agrees on every one.
    words = ["prompt", "story", "answer", "line", "context", "question"]
    examples = [{"context": f"The {a} model reads the", "choices": [words[(i + k) % 6] for k in range(3)]}
                for i, a in enumerate(("small", "tiny", "random", "pretrained", "big", "odd"))]
    for e in examples:
        e["label"] = int(np.argmax([log_likelihood(e["context"], c) for c in e["choices"]]))
    assert len({e["label"] for e in examples}) > 1
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    run_script("evaluate.py", f"--out_dir={root / 'ours'}", "--task=mc", f"--mc_file={tmp_path / 'mc.jsonl'}",
               f"--out_json={tmp_path / 'mc.json'}", "--device=cpu", data_dir=tmp_path)
    assert json.loads((tmp_path / "mc.json").read_text())["results"][str(root / "ours")]["acc"] == 1.0

    # prepare.py tokenizes a text with the model's tokenizer; evaluate.py's lm task gives transformers' mean loss.
    (tmp_path / "text.txt").write_text(TEXT)
    run_script("prepare.py", "text", f"--input={tmp_path / 'text.txt'}",
               f"--tokenizer={root / 'ours' / 'tokenizer.json'}", "--name=bpe", "--val_fraction=0.2", data_dir=tmp_path)
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    val = np.fromfile(tmp_path / "bpe" / "val.bin", dtype=meta["dtype"]).astype(np.int64)
    assert meta["tokenizer"] == "hf" and val.tolist() == encode(TEXT[int(len(TEXT) * 0.8):])
    run_script("evaluate.py", f"--out_dir={root / 'ours'}", "--dataset=bpe", "--seq_len=32",
               f"--out_json={tmp_path / 'lm.json'}", "--device=cpu", data_dir=tmp_path)
    nll = json.loads((tmp_path / "lm.json").read_text())["results"][str(root / "ours")]["nll"]
    windows = torch.tensor(np.stack([val[s:s + 33] for s in range(0, len(val) - 32, 32)]))  # evaluate.lm_windows
    with torch.no_grad():
        assert nll == pytest.approx(hf(windows, labels=windows).loss.item(), abs=1e-5)


@pytest.mark.slow
def test_rlvr_reads_the_same_arith_problems_in_the_model_vocabulary(imported, tmp_path, monkeypatch):
    root, _, _ = imported
    for name, tokenizer in (("arith_char", "char"), ("arith_bpe", root / "ours" / "tokenizer.json")):
        run_script("prepare.py", "arith", "--num_train=300", "--num_val=40", f"--name={name}",
                   f"--tokenizer={tokenizer}", data_dir=tmp_path)
    monkeypatch.setenv("NANOLATENT_DATA", str(tmp_path))
    from nanolatent import tasks
    for split in ("train", "val"):
        char, bpe = (tasks.load_prompts("arith", name, split, tokendata.load_meta(name)) for name in ("arith_char",
                                                                                                      "arith_bpe"))
        assert bpe == char and len(char) == {"train": 300, "val": 40}[split]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("edit, theta, scaled", [
    ({"rope_scaling": {"rope_type": "default"}, "rope_theta": 50.0}, 50.0, False),  # rope_scaling set: it wins
    ({"rope_scaling": None, "rope_theta": 50.0}, 500.0, False),  # rope_scaling null: rope_parameters' theta
    ({"rope_scaling": LLAMA3, "rope_theta": 50.0}, 50.0, True),  # the remap, with the top-level theta
    ({"rope_scaling": {**LLAMA3, "rope_theta": 70.0}, "rope_theta": 50.0}, 70.0, True),  # the remap's own theta
], ids=["scaling-default", "scaling-null", "scaling-llama3", "scaling-llama3-own-theta"])
def test_a_config_with_both_rope_conventions_imports_as_transformers_reads_it(tmp_path, tokenizer_file, capsys,
                                                                                edit, theta, scaled):
    """config.json with transformers 5's rope_parameters (theta 500) and the older rope_scaling and rope_theta
    beside it: the theta and remap transformers takes, and its logits; a disagreement is said in one line."""
    hf_llama(tmp_path / "hf", tokenizer_file, tie=True)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reference.config.rope_parameters["rope_theta"] == theta  # what transformers reads, independently
    capsys.readouterr()
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    assert "which disagree: read as transformers 5 reads them" in capsys.readouterr().out
    ours, _ = ckpt.load_model(tmp_path / "ours")
    assert (ours.config.rope_theta, ours.config.rope_scaling is not None) == (theta, scaled)
    idx = torch.randint(ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(idx, idx)[0], reference(idx).logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# refusals: one line naming the field, file or tensor


@pytest.mark.parametrize("edit, named", [
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling="),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, "rope_parameters="),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
     "rope_parameters="),
    ({"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    ({"head_dim": 15}, "head_dim=15"),  # RoPE turns channel pairs
    ({"model_type": "qwen2"}, 'model_type="qwen2"'),
    ({"model_type": "qwen3"}, 'architectures=["LlamaForCausalLM"]'),  # a Llama's config that calls itself Qwen3
    ({"architectures": ["MistralForCausalLM"]}, "architectures="),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
])
def test_a_config_model_det_cannot_compute_is_refused_naming_the_field(tmp_path, tokenizer_file, capsys, edit,
                                                                       named):
    hf_llama(tmp_path / "hf", tokenizer_file, tie=True)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    assert named in refusal(capsys, "hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}")
    assert not (tmp_path / "ours" / "ckpt.pt").exists()


@pytest.mark.slow
def test_broken_or_foreign_weights_are_refused_in_one_line(tmp_path, tokenizer_file, capsys):
    from safetensors.torch import load_file, save_file
    hf_llama(tmp_path / "hf", tokenizer_file, tie=True, max_shard_size="40KB")
    src, args = tmp_path / "hf", ["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"]
    shards = sorted(src.glob("model-*.safetensors"))
    # a QK-norm gain (Qwen3, OLMo 2) under a llama config: a tensor with no place in model_det
    tensors = load_file(shards[0])
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, shards[0],
              metadata={"format": "pt"})
    assert "tensor model.layers.0.self_attn.q_norm.weight (and 0 more) has no place" in refusal(capsys, *args)
    save_file(tensors, shards[0], metadata={"format": "pt"})
    # a shard cut short by an interrupted download: from the command line, exit 2 and one line, no traceback
    shards[-1].write_bytes(shards[-1].read_bytes()[:-100])
    proc = run_script("-m", "scripts.convert", *args, data_dir=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{shards[-1]} is unreadable" in proc.stderr and "truncated" in proc.stderr
    shards[-1].unlink()
    assert f"{shards[-1]} is missing" in refusal(capsys, *args)
    (src / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in refusal(capsys, *args)


def test_a_missing_tokenizer_file_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tokendata.tokenizer({"tokenizer": "hf", "tokenizer_file": "/nonexistent/tokenizer.json"})
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "/nonexistent/tokenizer.json not found" in err


def test_a_hub_id_goes_through_snapshot_download(tmp_path, tokenizer_file, monkeypatch, capsys):
    """Offline here: snapshot_download is replaced by a stand-in serving a local folder, then by a failing one."""
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="the hub client (pip install huggingface_hub)")
    hf_llama(tmp_path / "hf", tokenizer_file, tie=True)
    calls = []

    def snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path / "hf")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    convert.main(["hf", "--src=HuggingFaceTB/SmolLM2-135M", f"--out_dir={tmp_path / 'ours'}"])
    (repo_id, patterns), = calls
    assert repo_id == "HuggingFaceTB/SmolLM2-135M" and {"config.json", "tokenizer.json"} <= set(patterns)
    assert ckpt.load_checkpoint(tmp_path / "ours")["config"]["src"] == "HuggingFaceTB/SmolLM2-135M"

    def offline(repo_id, allow_patterns):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert "could not be downloaded" in refusal(capsys, "hf", "--src=HuggingFaceTB/SmolLM2-135M",
                                                f"--out_dir={tmp_path / 'x'}")


# ----------------------------------------------------------------------------------------------------------------
# tie_embeddings in the four model files


@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_an_untied_head_is_its_own_matrix_and_costs_the_same_flops(model_type):
    values = dict(vocab_size=50, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, block_size=16)
    tied, untied = (models.build_model(model_type, {**values, "tie_embeddings": t}) for t in (True, False))
    assert tied.lm_head.weight is tied.tok_emb.weight and untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 50 * 32  # the head's own matrix
    # 6N counts the head's matmul once either way; an untied embedding is a lookup, no FLOPs
    assert untied.flops_per_token() == tied.flops_per_token()


def test_a_det_checkpoint_loaded_as_btrans_counts_its_new_parameters_in_one_line(tmp_path, capsys):
    det = our_checkpoint(tmp_path / "run")
    capsys.readouterr()
    btrans, _ = ckpt.load_model(tmp_path / "run", model_type="btrans")
    new = [name for name in btrans.state_dict() if name not in det.state_dict()]
    assert len(new) == 5 and all(name.endswith(".mu") for name in new)  # 2 norms per block x 2 blocks + the final one
    assert capsys.readouterr().out == (f"loaded a det checkpoint into btrans; 5 new parameters keep their init "
                                       f"({new[0]} ... {new[-1]})\n")


def test_a_tied_config_with_a_stored_head_that_differs_is_refused_and_an_equal_copy_imports_tied(tmp_path,
                                                                                               tokenizer_file, capsys):
    """tie_word_embeddings=true beside a stored lm_head.weight: transformers computes with the stored head, so one
    that differs from the embedding is refused in one line (imported tied, the logits would not be transformers');
    a stored copy equal to it imports tied."""
    from safetensors.torch import load_file, save_file
    hf_llama(tmp_path / "hf", tokenizer_file, tie=True)
    path, args = tmp_path / "hf" / "model.safetensors", ["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"]
    tensors = load_file(path)
    embedding = tensors["model.embed_tokens.weight"]
    head = embedding + 0.5 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0))
    save_file({**tensors, "lm_head.weight": head}, path, metadata={"format": "pt"})
    assert torch.equal(LlamaForCausalLM.from_pretrained(tmp_path / "hf").lm_head.weight, head)  # what transformers uses
    line = refusal(capsys, *args)
    assert "tie_word_embeddings" in line and "lm_head.weight" in line and "differs" in line
    assert not (tmp_path / "ours" / "ckpt.pt").exists()
    save_file({**tensors, "lm_head.weight": embedding.clone()}, path, metadata={"format": "pt"})
    convert.main(args)
    ours, _ = ckpt.load_model(tmp_path / "ours")
    assert ours.lm_head.weight is ours.tok_emb.weight and torch.equal(ours.tok_emb.weight, embedding)
