"""Scaling up: FSDP2 against one process and DDP, sharded checkpoints and resume (2 gloo processes on a CPU), the dry
run's numbers, and a dry run of every config file."""

import glob
import json
import math
import os
import re
import shutil
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import FORKRUN, ROOT, TINY, run_script

from nanolatent import ckpt, models

pytestmark = pytest.mark.slow  # every test here starts processes (python -m pytest -m "not slow" skips them)

# an evaluation and a checkpoint every 3 steps; 2 micro-batches per step, one per process on 2 processes
STEPS = ["--eval_interval=3", "--always_save_checkpoint=True", "--gradient_accumulation_steps=2"]


def train(data_root, out_dir, *args, nproc=0):
    """train.py on a tiny model: one plain process, or nproc processes as torchrun starts them (support/forkrun.py)."""
    torchrun = [FORKRUN, f"--nproc_per_node={nproc}"]
    return run_script(*(torchrun if nproc else []), "train.py", f"--out_dir={out_dir}", *TINY, *STEPS, *args,
                      data_dir=data_root)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["iter"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def sharded_weights(out_dir, tmp_path):
    """The full state dict of the FSDP checkpoint out_dir/ckpt_meta.pt links to, gathered on this one process."""
    path = tmp_path / f"gathered_{os.path.basename(out_dir)}.pt"
    dcp_to_torch_save(os.path.dirname(os.path.realpath(os.path.join(out_dir, "ckpt_meta.pt"))), path)
    return torch.load(path, weights_only=True)


def plain_weights(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["model"]


def assert_same_weights(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-6), k


@pytest.fixture(scope="module")
def det_runs(data_root, tmp_path_factory):
    """A tiny det model for 6 steps: on one process; under FSDP on 2; under FSDP stopped at step 3 and resumed on 2
    processes, and on 1."""
    root, det = tmp_path_factory.mktemp("det_runs"), ["--model_type=det", "--max_iters=6"]
    train(data_root, root / "single", *det)
    train(data_root, root / "fsdp", *det, "--fsdp=True", nproc=2)
    train(data_root, root / "part", "--model_type=det", "--max_iters=3", "--fsdp=True", nproc=2)
    shutil.copytree(root / "part", root / "part_on_1")
    train(data_root, root / "part_on_1", *det, "--fsdp=True", "--init_from=resume", nproc=1)
    train(data_root, root / "part", *det, "--fsdp=True", "--init_from=resume", nproc=2)
    return root


def test_fsdp_gives_the_same_weights_as_one_process_with_the_same_micro_batches(det_runs, tmp_path):
    assert os.readlink(det_runs / "fsdp" / "ckpt_meta.pt") == os.path.join(ckpt.CHECKPOINTS, "iter_0000006",
                                                                          "ckpt_meta.pt")
    assert_same_weights(sharded_weights(det_runs / "fsdp", tmp_path)["model"], plain_weights(det_runs / "single"))
    assert sorted(os.listdir(det_runs / "fsdp" / ckpt.CHECKPOINTS)) == ["iter_0000003", "iter_0000006"]
    assert not os.path.exists(det_runs / "fsdp" / "ckpt.pt")


def test_activation_checkpointing_under_fsdp_and_ddp_gives_the_same_weights(det_runs, data_root, tmp_path):
    """Each block recomputed in the backward: FSDP x 2 still gives the 1-process weights; EVE under DDP x 2 (noise
    drawn, homeostat statistics all-reduced) the weights of the same run without it."""
    train(data_root, tmp_path / "fsdp", "--model_type=det", "--max_iters=6", "--fsdp=True",
          "--activation_checkpointing=True", nproc=2)
    for name, flag in (("plain", "False"), ("checkpointed", "True")):
        train(data_root, tmp_path / name, "--model_type=eve", "--max_iters=4", "--homeostat=True",
              "--homeostat_warmup=1", "--homeostat_every=1", f"--activation_checkpointing={flag}", nproc=2)
    assert_same_weights(sharded_weights(tmp_path / "fsdp", tmp_path)["model"], plain_weights(det_runs / "single"))
    assert_same_weights(plain_weights(tmp_path / "checkpointed"), plain_weights(tmp_path / "plain"))


def test_fsdp_meta_checkpoint_holds_plain_types_and_the_run(det_runs):
    meta = torch.load(det_runs / "fsdp" / "ckpt_meta.pt", weights_only=True)
    assert sorted(meta) == ["best_val_loss", "config", "iter_num", "meta", "model_config", "model_type",
                            "selected_iter"]
    assert meta["model_type"] == "det" and meta["iter_num"] == 6 and meta["config"]["fsdp"] is True
    assert meta["model_config"]["n_embd"] == 32 and meta["meta"]["vocab_size"] == meta["model_config"]["vocab_size"]


def test_fsdp_run_resumed_from_its_sharded_checkpoint_logs_the_same_losses(det_runs, tmp_path):
    full, part = losses(det_runs / "fsdp"), losses(det_runs / "part")
    assert part == full and [i for i, _ in full] == list(range(6))
    assert_same_weights(sharded_weights(det_runs / "part", tmp_path)["model"],
                        sharded_weights(det_runs / "fsdp", tmp_path)["model"])


def test_fsdp_checkpoint_of_2_processes_resumes_on_1_with_the_same_weights(det_runs, tmp_path):
    assert_same_weights(sharded_weights(det_runs / "part_on_1", tmp_path)["model"],
                        sharded_weights(det_runs / "fsdp", tmp_path)["model"])


def test_the_docs_export_of_a_sharded_checkpoint_loads_with_the_runs_weights(det_runs, tmp_path):
    """docs/training.md's gathering snippet, run as written in a folder whose out/ is an FSDP run."""
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        snippet = re.search(r"^python - <<'PY'\n(.*?)^PY\n", f.read(), re.S | re.M).group(1)
    shutil.copytree(det_runs / "fsdp", tmp_path / "out", symlinks=True)  # as cp -r and rsync -a copy a run
    run_script(sys.executable, "-c", snippet, cwd=tmp_path, data_dir=tmp_path)
    model, checkpoint = ckpt.load_model(tmp_path / "out-export")
    assert checkpoint["iter_num"] == 6 and "optimizer" not in checkpoint
    assert_same_weights(model.state_dict(), sharded_weights(det_runs / "fsdp", tmp_path)["model"])


@pytest.mark.parametrize("model_type,extra", [
    ("eve", ["--homeostat_warmup=1", "--homeostat_every=1", "--beta_control=True"]),  # controllers at every step
    ("free", ["--latent_bits=4"]),  # the encoder block is an FSDP unit, the post-sampler in the root
])
def test_fsdp_gives_the_same_weights_as_ddp_for_stochastic_models(model_type, extra, data_root, tmp_path):
    """Noise is drawn per process, so a stochastic model is compared with DDP on as many processes."""
    args = [f"--model_type={model_type}", "--max_iters=3", *extra]
    train(data_root, tmp_path / "ddp", *args, nproc=2)
    train(data_root, tmp_path / "fsdp", *args, "--fsdp=True", nproc=2)
    sharded = sharded_weights(tmp_path / "fsdp", tmp_path)["model"]
    assert_same_weights(sharded, plain_weights(tmp_path / "ddp"))
    if model_type == "eve":  # three controller updates; the homeostat rescaled sharded weights at steps 1 and 2
        assert int(sharded["ctrl_step"]) == 3


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
