"""The dry run's memory plan (nanolatent/plan.py) against what torch saves for the backward (measured on the CPU under
bf16 autocast), and activation checkpointing: the same gradients and statistics as without it, for every model; then
train.py --dry_run=True: the parameter count, FLOPs, speed and memory it prints against their formulas, and a dry run
of every config file."""

import glob
import inspect
import json
import math
import os
import re

import pytest
import torch

from conftest import ROOT, config_values, run_script
from nanolatent import eve_bank, models, plan

# small shapes apart from each other and from the defaults: GQA and not, a SwiGLU width of its own
SHAPES = [dict(n_embd=64, n_head=4, n_kv_head=2, n_layer=2),
          dict(n_embd=96, n_head=6, n_kv_head=3, n_layer=4, ffn_hidden=320)]
B, T, V = 2, 40, 320


def tiny(model_type, shape, **values):
    """A small model as train.py trains it: EVE's neurons through the fused bank."""
    torch.manual_seed(0)
    model = models.build_model(model_type, {"vocab_size": V, "block_size": T, **shape, **values})
    return eve_bank.fused_banks(model.train())


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


@pytest.mark.parametrize("shape", SHAPES, ids=["d64", "d96"])
@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_plan_of_saved_activations_and_autocast_copies_matches_torchs_saved_tensors(model_type, shape):
    model = tiny(model_type, shape)
    measured, copies = plan.saved_bytes(model, *batch())
    with torch.device("meta"):
        planned = models.build_model(model_type, {"vocab_size": V, "block_size": T, **shape})
    terms = plan.memory_plan(planned, B, fsdp=False, gpus=1)
    assert abs(terms["activations"] / measured - 1) < 0.15, (terms["activations"], measured)
    assert terms["copies"] == copies  # every weight a matmul reads, cast once per forward


@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_float32_plan_is_within_15_percent_of_the_saved_tensors_or_above_them(model_type):
    """Without autocast: no copies; det's, B-Trans's and the Free Transformer's counts hold at 4 bytes a value, EVE's
    neurons are doubled from their bf16 count, an upper bound."""
    model = tiny(model_type, SHAPES[1])
    measured, copies = plan.saved_bytes(model, *batch(), autocast_dtype=None)
    with torch.device("meta"):
        planned = models.build_model(model_type, {"vocab_size": V, "block_size": T, **SHAPES[1]})
    terms = plan.memory_plan(planned, B, fsdp=False, gpus=1, bytes_per_value=4)
    assert copies == terms["copies"] == 0
    if model_type == "eve":
        assert measured < terms["activations"] < 1.3 * measured
    else:
        assert abs(terms["activations"] / measured - 1) < 0.15, (terms["activations"], measured)


@pytest.mark.slow  # torch.compile of each model: about 30 s each on two cores
@pytest.mark.parametrize("model_type", ("det", "eve", "free"))
def test_compiled_graphs_save_no_more_than_the_eager_plan(model_type):
    # A fresh dynamo: in a long pytest process the earlier tests' compilations of Model.forward can reach its recompile
    # limit, and dynamo then runs the model eager, saving eager's bytes.
    torch._dynamo.reset()
    model = tiny(model_type, SHAPES[0])
    eager, _ = plan.saved_bytes(model, *batch())
    compiled, _ = plan.saved_bytes(torch.compile(model), *batch())
    with torch.device("meta"):
        planned = models.build_model(model_type, {"vocab_size": V, "block_size": T, **SHAPES[0]})
    # EVE's neuron bank is one autograd.Function: compile keeps what it saves (4 tensors a layer) and a little more
    assert compiled < (1.03 if model_type == "eve" else 1) * eager <= 1.15 * plan.memory_plan(planned, B, fsdp=False,
                                                                                                gpus=1)["activations"]


def test_checkpointing_plans_block_inputs_and_one_block():
    with torch.device("meta"):
        planned = models.build_model("det", {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_embd": 768,
                                             "n_head": 12, "n_kv_head": 4})
    full, recomputed = plan.saved_per_token(planned), plan.saved_per_token(planned, checkpointing=True)
    outside = 10 * 768 + 6 * 50304  # the final norm, the head's input, the logits and the loss's log-probabilities
    per_block = (full - outside) / 12
    assert recomputed == outside + 12 * 4 * 768 + per_block


@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_activation_checkpointing_gives_the_same_loss_gradients_and_statistics(model_type):
    """Dropout inside the blocks is drawn again identically (checkpoint restores the generator); the models' latents
    are drawn outside the blocks once; EVE's per-unit statistics are those of one forward, not two."""
    values = {"dropout": 0.1}
    plain, checkpointed = tiny(model_type, SHAPES[0], **values), tiny(model_type, SHAPES[0], **values)
    models.checkpoint_blocks(checkpointed)
    results = []
    for model in (plain, checkpointed):
        torch.manual_seed(7)  # the same latents and dropout masks for both
        _, loss, stats = model(*batch())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        stash = [b.mlp.stash.clone() for b in model.blocks] if model_type == "eve" else []
        results.append((loss.detach(), grads, {k: v.detach().clone() for k, v in stats.items()}, stash))
    (loss_a, grads_a, stats_a, stash_a), (loss_b, grads_b, stats_b, stash_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == sum(p.requires_grad for p in plain.parameters())
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)
    assert stats_a.keys() == stats_b.keys() and all(torch.equal(stats_a[k], stats_b[k]) for k in stats_a)
    assert len(stash_a) == len(stash_b) and all(torch.equal(a, b) for a, b in zip(stash_a, stash_b))
    if model_type == "eve":  # the controllers read the stash once: one step moves them as without checkpointing
        plain.update_controllers(), checkpointed.update_controllers()
        for a, b in zip(plain.buffers(), checkpointed.buffers()):
            assert torch.equal(a, b)


@pytest.mark.slow  # dynamo traces each model: about 10 s each on two cores
@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_checkpointed_blocks_trace_without_graph_breaks(model_type):
    model = tiny(model_type, SHAPES[0])
    models.checkpoint_blocks(model)
    explanation = torch._dynamo.explain(model)(*batch())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    # train.py under FSDP compiles each block alone (block.compile()): its checkpointed forward is one graph too
    block, calls = model.blocks[-1], []
    block.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    model(*batch())
    explanation = torch._dynamo.explain(block)(*calls[0][0], **calls[0][1])
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.slow  # torch.compile: about a minute a model on two cores
@pytest.mark.parametrize("model_type", ("eve", "free"))
def test_compiled_activation_checkpointing_gives_the_eager_gradients(model_type):
    """EVE (eps drawn, its stash set inside the blocks) and the Free Transformer (Z sampled, the mapper's own
    backward) compiled with their blocks checkpointed: eager's loss, gradients and EVE's stash. fallback_random keeps
    eager's random numbers, so both draw the same latents."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # compiled for certain, not run eager past a recompile limit (above)
    plain, checkpointed = tiny(model_type, SHAPES[0]), tiny(model_type, SHAPES[0])
    models.checkpoint_blocks(checkpointed)
    losses = []
    with inductor_config.patch(fallback_random=True):
        for model in (plain, torch.compile(checkpointed)):
            torch.manual_seed(7)  # the same latents for both
            loss = model(*batch())[1]
            loss.backward()
            losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 1e-5
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        if a.grad is not None:
            assert (b.grad - a.grad).abs().max() <= 1e-4 * a.grad.abs().max() + 1e-9, name
    for a, b in zip(plain.modules(), checkpointed.modules()):
        if getattr(a, "stash", None) is not None:
            torch.testing.assert_close(b.stash, a.stash, rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_keeps_the_state_dict_keys():
    model = tiny("free", SHAPES[0])
    keys = list(model.state_dict())
    models.checkpoint_blocks(model)
    assert list(model.state_dict()) == keys


# shapes from d = 32 to 128 and 2 to 6 layers, GQA, multi-query and not
BOUND_SHAPES = [dict(n_embd=32, n_head=2, n_kv_head=1, n_layer=2), dict(n_embd=32, n_head=2, n_kv_head=2, n_layer=4),
                dict(n_embd=48, n_head=3, n_kv_head=1, n_layer=6), *SHAPES,
                dict(n_embd=128, n_head=4, n_kv_head=4, n_layer=2)]


@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_plan_keeps_the_bound_docs_training_md_states_in_the_default_configs(model_type):
    """Within 1% of torch's saved tensors at d >= 64, 2.5% at smaller widths (docs/training.md, Dry run)."""
    for shape in BOUND_SHAPES:
        measured, _ = plan.saved_bytes(tiny(model_type, shape), *batch())
        with torch.device("meta"):
            planned = models.build_model(model_type, {"vocab_size": V, "block_size": T, **shape})
        ratio = plan.memory_plan(planned, B, fsdp=False, gpus=1)["activations"] / measured
        assert abs(ratio - 1) < (0.01 if shape["n_embd"] >= 64 else 0.025), (shape, ratio)


@pytest.mark.parametrize("model_type", models.MODEL_TYPES)
def test_plan_reads_the_kind_of_model_from_what_the_model_states_not_its_module(model_type):
    """A model class defined elsewhere (a subclass here, in this test module) gets its own file's plan, and every model
    file states what a pass draws the same way: a latent_kind property."""
    module = models.import_model(model_type)
    assert isinstance(inspect.getattr_static(module.Model, "latent_kind"), property)
    renamed = type("Renamed", (module.Model,), {})
    values = {"vocab_size": V, "block_size": T, **SHAPES[1]}
    with torch.device("meta"):
        planned = models.build_model(model_type, values)
        elsewhere = renamed(planned.config)
    assert type(elsewhere).__module__ != type(planned).__module__
    for bytes_per_value in (2, 4):
        assert plan.saved_per_token(elsewhere, bytes_per_value=bytes_per_value) == plan.saved_per_token(
            planned, bytes_per_value=bytes_per_value)


def free_8b():
    import configurator
    values = configurator.read_config_file(os.path.join(ROOT, "config", "free_8b.py"))
    return {k: v for k, v in values.items() if k in models.config_fields("free")}, values


@pytest.mark.parametrize("gpus, gpu_gib, warned", [(8, 80.0, True), (256, 80.0, False), (256, 60.0, True)])
def test_dry_run_warns_above_the_gpus_memory_with_what_each_change_would_plan(gpus, gpu_gib, warned, capsys):
    model_values, run = free_8b()
    plan.plan_run("free", dict(model_values), run["batch_size"], run["gradient_accumulation_steps"], 10, True, "cpu",
                  gpus, 0.4, gpu_gib=gpu_gib)
    out = capsys.readouterr().out
    total = float(re.search(r"memory per GPU: ([\d.]+) GiB", out)[1])
    assert (total > gpu_gib) == warned == ("warning:" in out)
    if warned:  # the remedies not already on, each planned alone: checkpointing, half the micro-batch (FSDP is on)
        planned = models.meta_model("free", model_values)
        expect = {"--activation_checkpointing=True": plan.memory_plan(planned, 2, True, gpus, checkpointing=True),
                  "--batch_size=1 --gradient_accumulation_steps=1024": plan.memory_plan(planned, 1, True, gpus)}
        warning = out[out.index("warning:"):]
        assert f"{total:.2f} GiB a GPU exceeds the {gpu_gib:g} GiB" in warning and "--fsdp" not in warning
        for change, terms in expect.items():
            assert f"{change} " in warning and f": {sum(terms.values()) / 2**30:.2f} GiB" in warning


# ----------------------------------------------------------------------------------------------------------------
# train.py --dry_run=True: its printed numbers against the formulas, and a dry run of every config file


def dry_run(*args, data_dir):
    return run_script("train.py", "--dry_run=True", *args, data_dir=data_dir).stdout


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_dry_run_prints_the_parameter_count_flops_speed_and_memory_of_its_formulas(fsdp, tmp_path):
    V, T, L, d, heads, kv, B = 50304, 1024, 8, 1024, 16, 4, 8
    out = dry_run("--model_type=det", f"--vocab_size={V}", f"--block_size={T}", f"--n_layer={L}", f"--n_embd={d}",
                  f"--n_head={heads}", f"--n_kv_head={kv}", f"--batch_size={B}", "--gradient_accumulation_steps=8",
                  f"--fsdp={fsdp}", "--dry_run_world_size=4", "--dry_run_mfu=0.5", "--max_iters=1000",
                  data_dir=tmp_path)  # an empty data folder: vocab_size is given, nothing is read
    hd, ffn = d // heads, 32 * math.ceil(int(8 * d / 3) / 32)  # SwiGLU width: 8/3 d rounded up to 32
    per_block = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * ffn + 2 * d  # wq wo, wk wv, w1 w2 w3, two norms
    n_params = V * d + L * per_block + d  # tied embedding and head, final norm
    flops = 6 * n_params + 12 * L * d * T
    tokens_per_s = 0.5 * 989e12 / flops
    saved = B * T * (L * (26 * d + 6 * d + 4 * kv * hd + 8 * ffn + 4 * heads) + 10 * d + 6 * V)  # plan.saved_per_token
    # FSDP: the root (embedding = head, final norm) and two blocks gathered in bf16; DDP: fp32 buckets and autocast's
    # bf16 copies of every matmul's weight (the blocks' and the tied head's)
    gathered = 2 * (V * d + d + 2 * per_block) if fsdp else 4 * n_params + 2 * (n_params - L * 2 * d - d)
    memory = 16 * n_params / (4 if fsdp else 1) + gathered + saved + 6 * B * T * V
    assert f"{n_params:,} parameters" in out
    assert f"{tokens_per_s:,.0f} tokens/s per GPU at 50% MFU of 989 TFLOP/s" in out
    assert f"{8 * B * T:,} tokens per step: {8 * B * T / (4 * tokens_per_s):.3g} s per step" in out
    assert f"memory per GPU: {memory / 2**30:.2f} GiB" in out


def script_of(config):
    """The script a config file is for: the one its header runs it with (`python -m scripts.rlvr config/rlvr_arith.py`)."""
    with open(os.path.join(ROOT, config)) as f:
        scripts = set(re.findall(r"python (\w+\.py|-m scripts\.\w+) " + re.escape(config), f.read()))
    return "train.py" if not scripts or "train.py" in scripts else scripts.pop()


TRAIN_CONFIGS = sorted(c for c in (os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "config", "*.py")))
                       if script_of(c) == "train.py")  # scripts/rlvr.py's configs are tested in test_rlvr.py


@pytest.mark.slow
@pytest.mark.parametrize("config", TRAIN_CONFIGS)
def test_every_config_parses_and_dry_runs(config, tmp_path):
    values = config_values(os.path.join(ROOT, config))
    model_type = values.get("model_type", "free")
    if "vocab_size" not in values:  # a meta.json is all a dry run reads: no tokens
        os.makedirs(tmp_path / values["dataset"])
        (tmp_path / values["dataset"] / "meta.json").write_text(json.dumps({"vocab_size": 65, "tokenizer": "char"}))
    out = dry_run(config, data_dir=tmp_path)
    fields = models.config_fields(model_type)
    model_values = {k: v for k, v in values.items() if k in fields and k not in ("block_size", "vocab_size")}
    with torch.device("meta"):
        model = models.build_model(model_type, {**model_values, "vocab_size": values.get("vocab_size", 65),
                                                "block_size": values.get("block_size", fields["block_size"])})
    assert f"dry run: {model_type} model, {model.num_params():,} parameters" in out


@pytest.mark.slow
def test_paper_scale_configs_have_the_papers_sizes():
    """free_8b.py is Llama-3 8B's shape: as a det model with its 128,256-token vocabulary and an untied head, exactly
    Llama-3 8B's parameter count; free_1b5.py's baseline is 1.5B with the paper's 2^17-token vocabulary (§4.2)."""
    def det_params(config, vocab_size):
        values = config_values(os.path.join(ROOT, "config", config))
        fields = models.config_fields("det")
        with torch.device("meta"):
            model = models.build_model("det", {**{k: v for k, v in values.items() if k in fields},
                                               "vocab_size": vocab_size})
        return model.num_params()
    assert det_params("free_8b.py", 128256) + 128256 * 4096 == 8_030_261_248
    assert 1.45e9 < det_params("free_1b5.py", 2 ** 17) < 1.55e9
