"""Everyday mistakes, each run as a user runs it: one line on stderr, exit code 2, no traceback, and nothing on disk
changed. Then the cases that must be accepted and do the right thing (eval_only, a partial log line, a lock)."""

import fcntl
import json
import os
import shutil

import pytest
import torch

from conftest import TINY, records, run_script, train_det

RUN_ARGS = ["--max_iters=4", "--eval_interval=2"]


@pytest.fixture(scope="module")
def trained(data_root, tmp_path_factory):
    """A finished tiny det run: 4 steps, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("trained")
    train_det(data_root, out, *RUN_ARGS)
    return out


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the finished run, for a case to try its mistake on."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def snapshot(folder):
    """{relative path: bytes} of every file under folder: what 'nothing changed' compares."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files if f != ".lock"}


def assert_one_line_error(proc, *phrases):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


def write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return path


# ----------------------------------------------------------------------------------------------------------------
# train.py


TRAIN_CASES = {  # name: (extra arguments, what the line says); {tmp} is a scratch folder, {run} the trained run
    "scratch over a trained run": ([], "already holds a run"),
    "max_iters negative": (["--init_from=resume", "--max_iters=-5"], "--max_iters must be >= 0"),
    "eval_interval zero": (["--init_from=resume", "--eval_interval=0"], "--eval_interval must be > 0"),
    "log_interval zero": (["--init_from=resume", "--log_interval=0"], "--log_interval must be > 0"),
    "eval_iters zero": (["--init_from=resume", "--eval_iters=0"], "--eval_iters must be > 0"),
    "batch_size zero": (["--init_from=resume", "--batch_size=0"], "--batch_size must be > 0"),
    "dtype float64": (["--init_from=resume", "--dtype=float64"], "--dtype must be one of float32, bfloat16"),
    "init_from unknown": (["--init_from=latest"], "--init_from must be one of scratch, resume"),
    "shape-changing override on resume": (["--init_from=resume", "--n_layer=3"], "would change the shape"),
    "resume on another vocabulary": (["--init_from=resume", "--dataset=tiny_vocab"], "trained on a vocabulary of"),
    "config file with a syntax error": (["{tmp}/bad_syntax.py"], "bad_syntax.py line 1"),
    "config file with a NameError": (["{tmp}/bad_name.py"], "bad_name.py failed: NameError"),
    "config file that is a directory": (["{tmp}"], "is a directory"),
    "out_dir under a file": (["--out_dir={tmp}/a_file/run"], "cannot write to out_dir"),
    "dataset too small": (["--out_dir={tmp}/fresh", "--dataset=tiny_vocab"], "too few for one window"),
    "dataset not prepared": (["--out_dir={tmp}/fresh", "--dataset=mystuff"], "python prepare.py text --input=FILE"),
}
if not torch.cuda.is_available():
    TRAIN_CASES["cuda without a GPU"] = (["--out_dir={tmp}/fresh", "--device=cuda"], "has no CUDA GPU")


@pytest.fixture(scope="module")
def tiny_vocab(data_root):
    """A second dataset beside the synthetic one: 3 characters, 40 tokens."""
    write(data_root / "tiny.txt", "ab\n" * 20)
    run_script("prepare.py", "text", f"--input={data_root / 'tiny.txt'}", "--tokenizer=char", "--name=tiny_vocab",
               data_dir=data_root)


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_mistake_is_one_line_and_changes_nothing(case, run, tmp_path, data_root, tiny_vocab):
    args, phrase = TRAIN_CASES[case]
    write(tmp_path / "bad_syntax.py", "n_layer = = 3\n")
    write(tmp_path / "bad_name.py", "n_layer = undefined_name\n")
    write(tmp_path / "a_file", "")
    before = snapshot(run)
    proc = train_det(data_root, run, *[a.format(tmp=tmp_path) for a in args], check=False)
    assert_one_line_error(proc, phrase)
    assert snapshot(run) == before


@pytest.mark.parametrize("content, phrase", [
    (b"", "is empty"),
    (b"not a torch file at all", "is unreadable"),
    ("foreign", "not a nanolatent checkpoint"),
])
def test_unusable_checkpoint_is_one_line_naming_the_file(content, phrase, run, data_root):
    path = run / "ckpt.pt"
    if content == "foreign":
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    before = snapshot(run)
    proc = train_det(data_root, run, "--init_from=resume", check=False)
    assert_one_line_error(proc, phrase, str(path))
    assert snapshot(run) == before


def test_a_second_writer_stops_at_once_naming_the_first(run, data_root):
    with open(run / ".lock", "w") as lock:  # as a running train.py holds it
        lock.write("train.py (pid 4242)")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(run)
        proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6", check=False)
        assert_one_line_error(proc, "is in use by train.py (pid 4242)")
        assert snapshot(run) == before
    train_det(data_root, run, "--init_from=resume", "--max_iters=6")  # released: the lock never outlives its holder


def test_eval_only_evaluates_the_checkpoint_and_leaves_the_log_alone(run, data_root):
    before = snapshot(run)
    proc = train_det(data_root, run, "--eval_only=True")
    val_loss = float(proc.stdout.split("val_loss ")[1].split()[0])
    saved_at = torch.load(run / "ckpt.pt", weights_only=True)["iter_num"]
    logged = next(r for r in records(run) if r["iter"] == saved_at and "val_loss" in r)
    assert val_loss == pytest.approx(logged["val_loss"], abs=1e-4)  # the same weights on the same eval batches
    assert snapshot(run) == before


def test_resume_applies_an_override_that_changes_no_shape_and_says_so(run, data_root):
    proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6", "--rope_theta=5000.0")
    assert "rope_theta=5000.0 (was rope_theta=10000.0)" in proc.stdout
    assert torch.load(run / "ckpt.pt", weights_only=True)["model_config"]["rope_theta"] == 5000.0


def test_overwrite_replaces_a_trained_run_when_asked(run, data_root):
    train_det(data_root, run, "--max_iters=2", "--eval_interval=2", "--overwrite=True")
    assert torch.load(run / "ckpt.pt", weights_only=True)["iter_num"] == 2
    assert max(r["iter"] for r in records(run)) == 2


def test_a_partial_last_log_line_is_dropped_with_a_warning_on_resume(run, data_root):
    write(run / "metrics.jsonl", '{"iter": 5, "lo', mode="a")  # a crash mid-append
    proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6", "--eval_interval=2")
    assert "ends in a partial line" in proc.stderr
    assert [r["iter"] for r in records(run) if "val_loss" in r] == [0, 2, 4, 6]


def test_log_lines_show_progress_and_fit_120_columns(data_root, tmp_path):
    proc = run_script("train.py", "--model=eve", f"--out_dir={tmp_path}", *TINY, "--max_iters=3", "--eval_interval=3",
                      data_dir=data_root)  # EVE logs the most stats
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert lines and all(len(line) <= 120 for line in lines), max(lines, key=len)
    assert any("iter 1/3: loss" in line and "elapsed, ETA" in line for line in lines)


# ----------------------------------------------------------------------------------------------------------------
# sample.py, prepare.py, evaluate.py


@pytest.mark.parametrize("args, phrase", [
    (["--temperature=-1"], "--temperature must be >= 0"),
    (["--num_samples=0"], "--num_samples must be > 0"),
    (["--max_new_tokens=-1"], "--max_new_tokens must be > 0"),
    (["--top_k=-1"], "--top_k must be >= 0"),
    (["--start="], "--start is empty"),
    (["--start=FILE:no_such_prompt.txt"], "no such file"),
    (["--latents=everywhere"], "--latents must be one of independent, shared, posterior"),
])
def test_sample_mistake_is_one_line(args, phrase, trained, data_root):
    assert_one_line_error(run_script("sample.py", f"--out_dir={trained}", *args, data_dir=data_root, check=False),
                          phrase)


def test_sample_reads_the_prompt_as_text_even_when_it_looks_like_a_number(trained, data_root):
    proc = run_script("sample.py", f"--out_dir={trained}", "--start=K>", "--num_samples=1", data_dir=data_root)
    assert proc.stdout.startswith("K>")
    proc = run_script("sample.py", f"--out_dir={trained}", "--start=12", "--num_samples=1", data_dir=data_root,
                      check=False)
    assert_one_line_error(proc, "not in this dataset's vocabulary")  # '1' is no letter of the task: said, not crashed


@pytest.mark.parametrize("name, content, phrase", [
    ("empty.txt", b"", "holds no text"),
    ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 text"),
    ("broken.jsonl", b'{"text": "fine"}\n{"text": broken\n', "could not be parsed"),
    ("missing.txt", None, "not found"),
])
def test_prepare_bad_input_is_one_line_and_writes_nothing(name, content, phrase, tmp_path):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    proc = run_script("prepare.py", "text", f"--input={tmp_path / name}", "--tokenizer=char", "--name=x",
                      data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, phrase, name)
    assert not (tmp_path / "data" / "x").exists()


@pytest.mark.parametrize("args, phrase", [
    (["--vocab=some"], "--vocab must be one of full, used"),
    (["--vocab=used"], "--vocab=used renumbers GPT-2 BPE ids"),  # a char vocabulary is already what the text uses
])
def test_prepare_bad_vocab_is_one_line_and_writes_nothing(args, phrase, tmp_path):
    (tmp_path / "in.txt").write_text("some text\n")
    proc = run_script("prepare.py", "text", f"--input={tmp_path / 'in.txt'}", "--tokenizer=char", "--name=x", *args,
                      data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, phrase)
    assert not (tmp_path / "data" / "x").exists()


def test_prepare_vocab_used_on_a_char_task_is_one_line(tmp_path):
    proc = run_script("prepare.py", "synthetic", "--vocab=used", data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, "--vocab=used renumbers GPT-2 BPE ids", "not to synthetic")
    assert not (tmp_path / "data").exists()


def test_prepare_without_a_source_says_which_there_are(tmp_path):
    assert_one_line_error(run_script("prepare.py", data_dir=tmp_path, check=False), "synthetic, arith, text")


@pytest.mark.parametrize("line, phrase", [
    ('{"context": "a", "choices": ["x", "y"], "label": 2}', "label must be the index (0 to 1)"),
    ('{"context": "a", "choices": "sat", "label": 0}', "choices must be a list of at least two"),
    ('{"context": "a", "choices": [], "label": 0}', "choices must be a list of at least two"),
    ('{"context": "a", "choices": ["x", "y"], "label": "A"}', "label must be the index"),
    ('{"context": "a", "choices": ["x", "y"], "label": 0', "is not JSON"),
])
def test_evaluate_mc_bad_example_is_one_line_naming_the_line(line, phrase, trained, data_root, tmp_path):
    path = write(tmp_path / "mc.jsonl", '{"context": "K>", "choices": ["_", "!"], "label": 0}\n' + line + "\n")
    proc = run_script("evaluate.py", f"--out_dir={trained}", "--task=mc", f"--mc_file={path}", data_dir=data_root,
                      check=False)
    assert_one_line_error(proc, "mc.jsonl line 2", phrase)


def test_plot_skips_a_partial_last_line(trained, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install matplotlib); CI installs it")
    shutil.copytree(trained, tmp_path / "run")
    write(tmp_path / "run" / "metrics.jsonl", '{"iter": 9, "val_lo', mode="a")
    proc = run_script("plot.py", tmp_path / "run", f"--out={tmp_path / 'p.png'}", data_dir=tmp_path)
    assert "ends in a partial line" in proc.stderr and (tmp_path / "p.png").exists()
    assert json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())["iter"] == 0
