"""Scaling up: FSDP2 against one process and DDP, sharded checkpoints and resume (2 gloo processes on a CPU), the dry
run's numbers, and a dry run of every config file."""

import glob
import json
import math
import os
import re

import pytest
import torch

from conftest import ROOT, run_script

from nanolatent import models

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)


# ----------------------------------------------------------------------------------------------------------------
# dry run


def dry_run(*args, data_dir):
    return run_script("train.py", "--dry_run=True", *args, data_dir=data_dir).stdout


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


def config_values(path):
    """What a config file sets, executed as the configurator does (from the repo root, for its exec lines)."""
    namespace, cwd = {}, os.getcwd()
    try:
        os.chdir(ROOT)
        exec(open(path).read(), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def script_of(config):
    """The script a config file is for: the one its header runs it with (`python -m scripts.rlvr config/rlvr_arith.py`)."""
    with open(os.path.join(ROOT, config)) as f:
        scripts = set(re.findall(r"python (\w+\.py|-m scripts\.\w+) " + re.escape(config), f.read()))
    return "train.py" if not scripts or "train.py" in scripts else scripts.pop()


TRAIN_CONFIGS = sorted(c for c in (os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "config", "*.py")))
                       if script_of(c) == "train.py")  # scripts/rlvr.py's configs are tested in test_rlvr.py


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
