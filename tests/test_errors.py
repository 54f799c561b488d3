"""Everyday mistakes, each run as a user runs it: one line on stderr, exit code 2, no traceback, and nothing on disk
changed. Then the cases that must be accepted and do the right thing (eval_only, a partial log line, a lock), and
stopping: Ctrl-C, SIGTERM and a full disk (simulated by a sitecustomize.py the subprocess imports) leave a loadable
checkpoint at the expected step and no temporary file."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import FORKRUN, ROOT, TINY, assert_one_line_error, run_script, train_in_process, write


# ----------------------------------------------------------------------------------------------------------------
# train.py


@pytest.mark.parametrize("world_size", ["0", "-2", "two"])
def test_a_dry_run_under_a_world_size_that_is_no_number_of_processes_is_one_line(world_size, data_root, tmp_path,
                                                                                   monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    code, out, err = train_in_process(monkeypatch, capsys, data_root, tmp_path / "fresh", "--dry_run=True")
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), f"WORLD_SIZE={world_size!r}",
                          "--dry_run_world_size")


# ----------------------------------------------------------------------------------------------------------------
# stopping: Ctrl-C, SIGTERM, a full disk


# ----------------------------------------------------------------------------------------------------------------
# rlvr.py and convert.py write runs too


# ----------------------------------------------------------------------------------------------------------------
# sample.py, prepare.py, evaluate.py


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [
    (["--cvar_alpha=2"], ("cvar_alpha", "2")),
    (["--cvar_alpha=0"], ("cvar_alpha", "0")),
    (["--seq_len=1000"], ("seq_len=1000", "66")),
    (["--out_json=/no/such/folder/x.json"], ("--out_json=/no/such/folder/x.json",)),
    (["--out_json=/no/such/folder/x.json", "--dtype=float64"], ("dtype", "float64")),
])
def test_evaluate_mistake_is_one_line_before_any_evaluation(args, named, trained, data_root):
    proc = run_script("evaluate.py", f"--out_dir={trained}", *args, data_dir=data_root, check=False)
    assert_one_line_error(proc, *named)
    assert "lm:" not in proc.stdout  # refused before the evaluation started


FULL_DISK_JSON = """
import builtins, errno, os
_open = builtins.open
def open(file, mode="r", *args, **kwargs):  # the disk is full by the time the evaluation ends
    if "w" in mode and ".json.tmp" in str(file):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return _open(file, mode, *args, **kwargs)
builtins.open = open
"""


@pytest.mark.slow
def test_evaluate_on_a_full_disk_prints_the_results_keeps_the_old_file_and_says_so_in_one_line(trained, data_root,
                                                                                              tmp_path):
    write(tmp_path / "hook" / "sitecustomize.py", FULL_DISK_JSON)
    write(tmp_path / "eval.json", '{\n "task": "lm", "earlier": "results"}')  # evaluate.py's: it may replace it
    env = {**os.environ, "NANOLATENT_DATA": str(data_root), "PYTHONPATH": str(tmp_path / "hook"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "evaluate.py", f"--out_dir={trained}", "--max_tokens=256",
                           f"--out_json={tmp_path / 'eval.json'}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert_one_line_error(proc, str(tmp_path / "eval.json"), "No space left on device")
    printed = json.loads(proc.stdout[proc.stdout.index('{\n "task"'):])  # nothing lost: the file's text, on stdout
    assert printed["task"] == "lm" and printed["results"][str(trained)]["nll"] > 0
    assert (tmp_path / "eval.json").read_text() == '{\n "task": "lm", "earlier": "results"}'
    assert sorted(os.listdir(tmp_path)) == ["eval.json", "hook"]


@pytest.mark.slow
def test_evaluate_out_items_without_task_mc_is_one_line(trained, data_root, tmp_path):
    proc = run_script("evaluate.py", f"--out_dir={trained}", f"--out_items={tmp_path / 'items.jsonl'}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--out_items={tmp_path / 'items.jsonl'} writes the items of --task=mc, and "
                          "--task=lm has none")
    assert "lm:" not in proc.stdout and not (tmp_path / "items.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kernels", ["fast", "plain"])
def test_evaluate_in_reduced_precision_on_a_cpu_gives_the_float32_numbers_to_its_rounding(dtype, kernels, trained,
                                                                                          data_root):
    """--dtype=bfloat16/float16 on a CPU: through oneDNN (bfloat16 weights packed for it; float16, which it lacks
    here, through autocast's kernels) or torch's own kernels, the nll is float32's to the dtype's rounding."""
    nll = lambda *args: float(re.search(r"^nll +(\S+)", run_script(
        "evaluate.py", f"--out_dir={trained}", "--max_tokens=512", *args, data_dir=data_root).stdout, re.M).group(1))
    assert nll(f"--dtype={dtype}", f"--kernels={kernels}") == pytest.approx(nll("--dtype=float32"), abs=0.02)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "notes.json"])
def test_evaluate_never_replaces_a_file_it_did_not_write(name, trained, data_root, tmp_path):
    """--out_json=RUN/metrics.jsonl (the run's training log), or any JSON of another writer: one line before the
    evaluation, the file as it was; evaluate.py's own results file is replaced."""
    shutil.copytree(trained, tmp_path / "run")
    path = tmp_path / "run" / name
    if name == "notes.json":
        write(path, '{"task": "mine", "results": {}}')  # evaluate.py's keys, not its layout
    before = path.read_bytes()
    proc = run_script("evaluate.py", f"--out_dir={tmp_path / 'run'}", "--max_tokens=256", f"--out_json={path}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--out_json={path}", "did not write it")
    assert "lm:" not in proc.stdout and path.read_bytes() == before
    ours = tmp_path / "eval.json"
    for _ in range(2):  # written, then replaced
        run_script("evaluate.py", f"--out_dir={tmp_path / 'run'}", "--max_tokens=256", f"--out_json={ours}",
                   data_dir=data_root)
        assert json.loads(ours.read_text())["task"] == "lm"


@pytest.mark.slow
@pytest.mark.parametrize("content, phrase", [
    ("caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 text (byte 3: invalid continuation byte)"),
    (None, "is a folder"),
])
def test_evaluate_text_file_that_is_not_utf8_text_is_one_line_as_in_sample(content, phrase, trained, data_root,
                                                                           tmp_path):
    path = tmp_path / "latin1.txt" if content is not None else tmp_path
    if content is not None:
        path.write_bytes(content)
    proc = run_script("evaluate.py", f"--out_dir={trained}", "--task=tokens", f"--text=FILE:{path}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--text=FILE:{path} {phrase}")


@pytest.mark.parametrize("rank, printed", [("0", "error: no such run\n"), ("3", "")])
def test_an_error_is_printed_by_rank_0_alone(rank, printed, monkeypatch, capsys):
    from nanolatent import common
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit:
        common.die("no such run")
    assert exit.value.code == 2 and capsys.readouterr().err == printed


@pytest.mark.slow
def test_an_error_under_torchrun_is_one_line(tmp_path):
    """Both processes meet the missing dataset; the job fails with one line, rank 0's."""
    proc = run_script(FORKRUN, "--nproc_per_node=2", "train.py", "--dataset=no_such_data", *TINY,
                      "--gradient_accumulation_steps=2",
                      data_dir=tmp_path, check=False, timeout=300)
    assert proc.returncode != 0 and proc.stderr.count("error: ") == 1, proc.stderr[-2000:]
    assert "no_such_data" in proc.stderr
