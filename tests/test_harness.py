"""harness.py against lm-evaluation-harness itself: on a det run exported by convert.py to_hf, `--model nanolatent`
and lm_eval's own `--model hf` give the same per-item results on local tasks (multiple choice, loglikelihood,
rolling perplexity, generation); on EVE, B-Trans and Free runs the harness gives evaluate.py --task=mc's per-choice
log-likelihoods and accuracy item by item (same seed, same draws), whatever the batch size or --limit. Also the
GPT-2 tokenizer that to_hf writes (tiktoken's ids, GPT-2's own merges) and evaluate.py's --out_items."""

import json
import os

import pytest
import torch

from conftest import LOCAL_DATA, local_skip, needs_local, run_script

from scripts import convert
from nanolatent import ckpt, common, models, multiple_choice, tokendata

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)

GPT2_BPE = os.path.join(LOCAL_DATA, "gpt2", "gpt2.tiktoken")
GPT2_MERGES = os.path.join(LOCAL_DATA, "gpt2", "vocab.bpe")
needs_gpt2 = needs_local("gpt2/gpt2.tiktoken")
CHARS = " abcdefghijklmnopqrstuvwxyz.:?"
SEED = 1337


def checkpoint(path, model_type, vocab, meta, block_size=24, **kwargs):
    """A random tiny run, its weights drawn wide (norm gains around 1, embeddings of std 1) so that its choices get
    clearly different scores and a misplaced token shows."""
    torch.manual_seed(0)
    model = models.build_model(model_type, dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, block_size=block_size,
                                              vocab_size=vocab, **kwargs))
    with torch.no_grad():
        model.tok_emb.weight.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    os.makedirs(path, exist_ok=True)
    ckpt.save_checkpoint({"model_type": model_type, "model_config": models.config_dict(model.config),
                          "model": model.state_dict(), "config": {}, "iter_num": 0, "best_val_loss": 1.0,
                          "meta": meta}, os.path.join(path, "ckpt.pt"))
    return str(path)


def write_task(folder, name, data, output_type="multiple_choice", **fields):
    """A local lm_eval task: a YAML over a jsonl, as a user writes one for --include_path."""
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in data)
    lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {path}",
             "test_split: test", f"output_type: {output_type}", *(f"{k}: {v}" for k, v in fields.items())]
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


MC_FIELDS = dict(doc_to_text="context", doc_to_choice="choices", doc_to_target="label",
                 metric_list="\n  - metric: acc\n  - metric: acc_norm")


def needs_lm_eval():
    """harness.py (which registers nanolatent) and lm_eval, or a skip: lm_eval is optional."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install \"lm_eval[hf]\"")
    from scripts import harness
    return harness


def harness_run(model, model_args, tasks, include_path, **kwargs):
    """simple_evaluate on local tasks, on the CPU, with per-item samples: {task: [sample, ...]}, results. Only the
    local tasks are indexed: lm_eval's own thousands take 9 s a call here."""
    needs_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, device="cpu", log_samples=True,
                                  task_manager=TaskManager(include_path=str(include_path), include_defaults=False),
                                  **kwargs)
    return out["samples"], out["results"]


def lls(sample):
    """A logged sample's log-likelihoods: per choice (multiple choice: [(ll, is_greedy), ...]), of its continuation
    (loglikelihood: (ll, is_greedy)) or of its text (rolling: ll)."""
    resps = sample["filtered_resps"]
    if isinstance(resps, (list, tuple)) and isinstance(resps[0], (list, tuple)):
        return [float(r[0]) for r in resps]
    return [float(resps[0] if isinstance(resps, (list, tuple)) else resps)]


# ----------------------------------------------------------------------------------------------------------------
# GPT-2's tokenizer for an export


@needs_gpt2
def test_to_hf_writes_gpt2s_tokenizer_with_tiktokens_ids_and_gpt2s_own_merges(tmp_path):
    pytest.importorskip("tokenizers", reason="pip install tokenizers")
    from tokenizers import Tokenizer
    encoding, _ = tokendata.gpt2_encoding(GPT2_BPE)
    convert.gpt2_tokenizer_json(encoding._mergeable_ranks, str(tmp_path / "tokenizer.json"))
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in saved["model"]["merges"]]
    with open(GPT2_MERGES, encoding="utf-8") as f:  # GPT-2's release, never read by the export
        assert merges == [tuple(line.split()) for line in f.read().splitlines()[1:] if line]  # all 50,000, in order
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    shakespeare = os.path.join(LOCAL_DATA, "tinyshakespeare", "input.txt")
    if not os.path.exists(shakespeare):
        pytest.skip(local_skip("tinyshakespeare/input.txt"))
    with open(shakespeare) as f:
        shakespeare = f.read()[:5000]
    corpus = ["The cat sat on the", " mat.", "Question: what is 2 + 2?\nAnswer:", " 4", "  two spaces", "end  ",
              "a\n\n\nb\t\tc \n", "it's we'll they've I'm", "naïve café — 東京 🤖", "Ünïcödé ẞ ﬁ\u00a0nbsp",
              "12345 6.789",
              "<|endoftext|>after", "x" * 60, shakespeare]
    for text in corpus:
        ids = encoding.encode(text, allowed_special={"<|endoftext|>"})
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.get_vocab_size() == 50257 and tok.token_to_id("<|endoftext|>") == 50256


# ----------------------------------------------------------------------------------------------------------------
# det: nanolatent against lm_eval's hf model on the export


@pytest.fixture(scope="module")
def gpt2_det(tmp_path_factory):
    """A det run on GPT-2's BPE (its meta records the local BPE file, as prepare.py writes it), exported by to_hf."""
    if not os.path.exists(GPT2_BPE):
        pytest.skip(local_skip("gpt2/gpt2.tiktoken"))
    needs_lm_eval()
    pytest.importorskip("transformers", reason="lm_eval's hf model needs transformers (pip install \"lm_eval[hf]\")")
    root = tmp_path_factory.mktemp("gpt2_det")
    run = checkpoint(root / "run", "det", 50257, {"tokenizer": "gpt2", "bpe_file": GPT2_BPE, "vocab_size": 50257},
                     block_size=32)
    convert.main(["to_hf", f"--out_dir={run}", f"--dst={root / 'hf'}"])
    return root, run


@needs_gpt2
def test_nanolatent_and_hf_give_the_same_items_on_a_det_export(gpt2_det):
    root, run = gpt2_det
    tasks = root / "tasks"
    os.makedirs(tasks, exist_ok=True)
    model, _ = ckpt.load_model(run)
    encode, decode = tokendata.tokenizer(ckpt.load_checkpoint(run)["meta"])
    greedy = decode(model.generate(torch.tensor([encode("Once upon a")]), 3, temperature=0)[0, 3:].tolist())
    write_task(tasks, "mc", [
        {"context": "The cat sat on the", "choices": ["mat.", "moon", "naïve café"], "label": 0},
        {"context": "", "choices": ["Hello world", "Goodbye"], "label": 1},  # empty: conditioned on <|endoftext|>
        {"context": "Question: what is 2 + 2?\nAnswer: ", "choices": ["4", "five", "東京"], "label": 0},
        {"context": "A long context " * 12, "choices": ["yes", "no"], "label": 1}], **MC_FIELDS)  # left-truncated
    write_task(tasks, "ll", [{"context": "Once upon a", "target": greedy},
                             {"context": "Once upon a", "target": " dog"}], "loglikelihood",
               doc_to_text="context", doc_to_target="target", metric_list="\n  - metric: perplexity\n  - metric: acc")
    write_task(tasks, "ppl", [{"text": "A short text."}, {"text": "A longer text, " * 20 + "in several windows."}],
               "loglikelihood_rolling", doc_to_text="''", doc_to_target="text",
               metric_list="\n  - metric: word_perplexity")
    write_task(tasks, "gen", [{"q": "Once upon a"}, {"q": "The"}], "generate_until", doc_to_text="q",
               doc_to_target="q", generation_kwargs='\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false',
               metric_list="\n  - metric: exact_match")
    names = ["mc", "ll", "ppl", "gen"]
    ours, ours_results = harness_run("nanolatent", {"out_dir": run}, names, tasks, batch_size=2)
    theirs, theirs_results = harness_run("hf", {"pretrained": str(root / "hf"), "dtype": "float32"}, names, tasks)
    for name in names:
        assert len(ours[name]) == len(theirs[name]) > 0
        for a, b in zip(ours[name], theirs[name]):
            if name == "gen":
                assert a["filtered_resps"] == b["filtered_resps"]
                continue
            assert lls(a) == pytest.approx(lls(b), abs=1e-4)
            for metric in ("acc", "acc_norm"):
                assert a.get(metric) == b.get(metric)
    assert ours_results["mc"]["acc,none"] == theirs_results["mc"]["acc,none"]
    assert ours_results["ll"]["acc,none"] == theirs_results["ll"]["acc,none"] == 0.5  # is_greedy: the first only
    assert ours_results["ppl"]["word_perplexity,none"] == pytest.approx(theirs_results["ppl"]["word_perplexity,none"],
                                                                        rel=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# EVE, B-Trans, Free: the harness against evaluate.py --task=mc


EXAMPLES = [{"context": "the cat sat on the", "choices": ["mat.", "moon", "hat"], "label": 0},
            {"context": "one two", "choices": ["three", "four.", "a"], "label": 1},
            {"context": "is it: ", "choices": ["yes", "no"], "label": 1},
            {"context": "a long context " * 3, "choices": ["that ends here", "and there"], "label": 0},
            {"context": "x", "choices": ["a" * 30, "b"], "label": 0}]  # a continuation longer than the window


@pytest.fixture(scope="module")
def stochastic(tmp_path_factory):
    root = tmp_path_factory.mktemp("stochastic")
    meta = {"tokenizer": "char", "chars": list(CHARS), "vocab_size": len(CHARS)}
    runs = {t: checkpoint(root / t, t, len(CHARS), meta, **({"sigma": 0.5} if t == "btrans" else {}))
            for t in ("eve", "btrans", "free")}
    write_task(root, "mc", EXAMPLES, **MC_FIELDS)
    run_script("evaluate.py", "--task=mc", f"--mc_file={root / 'mc.jsonl'}", f"--out_dir={','.join(runs.values())}",
               "--mc_samples=8", f"--seed={SEED}", "--device=cpu", f"--out_json={root / 'mc.json'}",
               f"--out_items={root / 'items.jsonl'}", data_dir=root)
    with open(root / "mc.json") as f:
        results = json.load(f)["results"]
    with open(root / "items.jsonl") as f:
        items = [json.loads(line) for line in f]
    return root, runs, results, items


@pytest.mark.parametrize("model_type", ["btrans", "free"])
def test_harness_gives_evaluate_py_items_and_acc_on_stochastic_runs(stochastic, model_type):
    root, runs, results, items = stochastic
    args = {"out_dir": runs[model_type], "mc_samples": 8, "mixture": "auto", "seed": SEED}
    samples, out = harness_run("nanolatent", args, ["mc"], root)
    mine = [i for i in items if i["out_dir"] == runs[model_type]]
    mixture = results[runs[model_type]]["mixture"]
    assert mixture == {"btrans": "sequence", "free": "token"}[model_type]
    for sample, item in zip(samples["mc"], mine):
        assert lls(sample) == pytest.approx(item["loglikelihoods"][mixture], abs=1e-6)
        assert sample["acc"] == float(item["pred"]["acc"] == item["label"])
        assert sample["acc_norm"] == float(item["pred"]["acc_char"] == item["label"])
    assert out["mc"]["acc,none"] == results[runs[model_type]]["acc"]
    assert out["mc"]["acc_norm,none"] == results[runs[model_type]]["acc_char"]


def test_the_readme_command_on_an_eve_run_gives_evaluate_py_acc(stochastic, tmp_path):
    """`python harness.py --model nanolatent ...` from the command line, as the README gives it."""
    needs_lm_eval()
    root, runs, results, _ = stochastic
    run_script("-m", "scripts.harness", "--model", "nanolatent", "--model_args",
               f"out_dir={runs['eve']},mc_samples=8,mixture=auto,seed={SEED}", "--tasks", "mc", "--include_path",
               root, "--device", "cpu", "--output_path", tmp_path / "out", data_dir=root)
    (path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "out") for f in files
               if f.startswith("results")]
    with open(path) as f:
        acc = json.load(f)["results"]["mc"]
    assert acc["acc,none"] == results[runs["eve"]]["acc"] and acc["acc_norm,none"] == results[runs["eve"]]["acc_char"]


def test_each_document_draws_its_own_latents_whatever_the_batch_or_limit(stochastic):
    root, runs, _, _ = stochastic
    harness = needs_lm_eval()
    from lm_eval.api.instance import Instance
    lm = harness.NanoLatentLM(out_dir=runs["eve"], mc_samples=4, device="cpu")
    reqs = [Instance("loglikelihood", {}, (ex["context"], " " + c), k, ("mc", d, 1))
            for d, ex in enumerate(EXAMPLES) for k, c in enumerate(ex["choices"])]
    full = lm.loglikelihood(reqs)
    assert lm.loglikelihood(reqs[::-1]) == full[::-1]  # order, hence batching, changes nothing
    assert lm.loglikelihood(reqs[3:6]) == full[3:6]  # document 1 alone (--limit, other tasks)
    lm.seed += 1
    assert [ll for ll, _ in lm.loglikelihood(reqs)] != [ll for ll, _ in full]  # the seed sets the draws


def test_generation_fixes_each_requests_latents_and_repeats_draw_new_minds(stochastic):
    root, runs, _, _ = stochastic
    harness = needs_lm_eval()
    from lm_eval.api.instance import Instance
    lm = harness.NanoLatentLM(out_dir=runs["btrans"], device="cpu", seed=SEED, sigma=4.0)  # a Config override:
    # minds this far apart make this random model's greedy continuations differ
    assert lm.model.config.sigma == 4.0
    req = Instance("generate_until", {}, ("the cat", {"until": ["."], "max_gen_toks": 12, "do_sample": False}), 0,
                   ("gen", 3, 4))
    texts = lm.generate_until([req] * 4)  # repeats: 4, as a pass@k task asks
    for k, text in enumerate(texts):  # mind k of document 3: greedy decoding, the mind drawn from (seed, 3, 0, k)
        generator = torch.Generator().manual_seed(common.seed_of(SEED, 3, 0, k))
        idx = torch.tensor([[CHARS.index(ch) for ch in "the cat"]])
        new = lm.model.generate(idx, 12, temperature=0, latents=lm.model.sample_latents(1, generator, prompt=idx))
        assert text == "".join(CHARS[i] for i in new[0, 7:].tolist()).split(".")[0]
    assert len(set(texts)) > 1  # different minds, different greedy continuations
    assert lm.generate_until([req] * 4) == texts


@pytest.mark.parametrize("args, message", [
    ({"mc_samples": "abc"}, "--model_args mc_samples='abc': mc_samples must be an int (default 8)"),
    ({"mc_samples": 0}, "--model_args mc_samples=0: mc_samples must be >= 1"),
    ({"mc_samples": -2.0}, "--model_args mc_samples=-2: mc_samples must be >= 1"),  # lm_eval reads "-2" as -2.0
    ({"mixture": "best"}, "--model_args mixture='best': mixture must be one of auto, token, sequence"),
    ({"dtype": "float64"}, "--model_args dtype='float64': dtype must be one of float32, bfloat16, float16"),
    ({"seed": "x"}, "--model_args seed='x': seed must be an int (default 1337)"),
    ({"max_gen_toks": 0}, "--model_args max_gen_toks=0: max_gen_toks must be >= 1"),
    ({"model_type": "gpt"}, "--model_args model_type='gpt': model_type must be one of , det, eve, free, btrans"),
    ({"sigma": "abc", "model_type": "btrans"}, "--model_args sigma='abc': sigma must be a float (default"),
    ({"out_dir": ""}, "--model_args needs out_dir=RUN"),
])
def test_a_bad_model_arg_is_one_line_before_the_model_loads(stochastic, capsys, monkeypatch, args, message):
    """--model_args arrive as lm_eval parses them (numbers and true/false typed, the rest text) or as a Python
    caller passes them; each is checked like a script's value, before the model is built."""
    root, runs, _, _ = stochastic
    harness = needs_lm_eval()
    monkeypatch.setattr(ckpt, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        harness.NanoLatentLM(**{"out_dir": runs["eve"], **args}, device="cpu")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {message}"), err


def test_the_command_line_without_out_dir_says_what_to_give(stochastic, tmp_path):
    """lm_eval calls the model with the arguments it was given: out_dir missing was a TypeError."""
    needs_lm_eval()
    root, runs, _, _ = stochastic
    proc = run_script("-m", "scripts.harness", "--model", "nanolatent", "--model_args", "mc_samples=2", "--tasks", "mc",
                      "--include_path", root, "--device", "cpu", data_dir=root, check=False)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("20")]  # lm_eval's log lines: dated
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert errors == ["error: --model_args needs out_dir=RUN, the run to evaluate (its folder or a ckpt.pt): "
                      "--model_args out_dir=out-eve,mc_samples=8"]


# ----------------------------------------------------------------------------------------------------------------
# evaluate.py --out_items


def test_out_items_holds_each_choices_loglikelihoods_predictions_and_truncation(stochastic):
    root, runs, results, items = stochastic
    assert len(items) == 3 * len(EXAMPLES)
    encode = lambda text: [CHARS.index(ch) for ch in text]
    model, _ = ckpt.load_model(runs["free"])
    for item, ex in zip([i for i in items if i["out_dir"] == runs["free"]], EXAMPLES):
        pairs = [multiple_choice.choice_tokens(encode, ex["context"], c) for c in ex["choices"]]
        for mixture in ("token", "sequence"):  # both mixtures, on the draws of example_generator(seed, index)
            ll, n_tokens, cut = multiple_choice.score_choices(model, pairs, 8, multiple_choice.example_generator(model, SEED,
                                                                                                               item["index"]),
                                                              mixture=mixture)
            assert item["loglikelihoods"][mixture] == pytest.approx(ll, abs=1e-6)
        assert item["tokens"] == n_tokens and item["truncated"] == cut and item["label"] == ex["label"]
        ll = item["loglikelihoods"]["token"]
        assert item["pred"]["acc"] == max(range(len(ll)), key=ll.__getitem__)
        assert item["pred"]["acc_completion"] == max(range(len(ll)), key=lambda k: ll[k] / n_tokens[k])
    assert [i["truncated"] for i in items[:len(EXAMPLES)]] == [False, False, False, True, True]
    assert sum(i["truncated"] for i in items[:len(EXAMPLES)]) == results[runs["eve"]]["truncated"]


def test_out_items_in_a_missing_folder_is_refused_before_evaluating(stochastic, tmp_path):
    root, runs, _, _ = stochastic
    proc = run_script("evaluate.py", "--task=mc", f"--mc_file={root / 'mc.jsonl'}", f"--out_dir={runs['eve']}",
                      "--device=cpu", f"--out_items={tmp_path / 'no' / 'items.jsonl'}", data_dir=root, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --out_items=") and proc.stderr.count("\n") == 1
    assert "mc examples" not in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# the B-Trans paper's families imported


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_an_imported_llama3_or_qwen3_scores_as_lm_evals_hf_model_on_the_checkpoint(tmp_path, family):
    """harness.py on a convert.py hf import (Llama 3.1's remap with contexts past its original 16 positions; Qwen3's
    q/k norms and 32-wide heads) gives lm_eval's own hf model's per-choice log-likelihoods on the original folder."""
    transformers = pytest.importorskip("transformers", reason="lm_eval's hf model needs transformers")
    tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers (pip install tokenizers)")
    needs_lm_eval()
    text = "".join(f"The {a} cat sat on the {b}. " for a in ("small", "black", "old") for b in ("mat", "moon", "sofa"))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                                   initial_alphabet=tokenizers.pre_tokenizers.ByteLevel
                                                                   .alphabet()))
    torch.manual_seed(0)
    shape = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
    hf = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_parameters={
        "rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})) if family == "llama3" else
          transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=32)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    convert.main(["hf", f"--src={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'ours'}"])
    tasks = tmp_path / "tasks"
    os.makedirs(tasks)
    write_task(tasks, "mc", [
        {"context": "The small cat sat on the", "choices": ["mat.", "moon.", "sofa."], "label": 0},
        {"context": "The old cat sat on the sofa. The black cat sat on the", "choices": ["moon.", "mat."], "label": 1},
        {"context": text[:150], "choices": ["black cat", "old mat"], "label": 0}], **MC_FIELDS)
    ours, ours_results = harness_run("nanolatent", {"out_dir": str(tmp_path / "ours")}, ["mc"], tasks)
    theirs, theirs_results = harness_run("hf", {"pretrained": str(tmp_path / "hf"), "dtype": "float32"}, ["mc"], tasks)
    assert len(tok.encode(text[:150]).ids) > 16  # the last item reads past the original context
    assert len(ours["mc"]) == len(theirs["mc"]) == 3
    for a, b in zip(ours["mc"], theirs["mc"]):
        assert lls(a) == pytest.approx(lls(b), abs=2e-4) and len(set(lls(a))) == len(lls(a))
    assert ours_results["mc"]["acc,none"] == theirs_results["mc"]["acc,none"]
