"""scripts/convert.py's one-line refusals, each leaving no trace: a run or a folder it would replace, a write that fails,
a malformed config.json, safetensors missing, a GGUF it cannot read. None needs a Hugging Face package (the imports
themselves: test_convert.py)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, assert_one_line_error, run_script, snapshot, write


@pytest.mark.slow
def test_convert_hf_never_replaces_a_run_unasked(run, data_root, tmp_path):
    """A trained run given as --out_dir: one line, the run as it was (as rlvr.py, in test_rlvr.py)."""
    before = snapshot(run)
    proc = run_script("-m", "scripts.convert", "hf", f"--src={tmp_path}", f"--out_dir={run}", data_dir=data_root,
                      check=False)
    assert_one_line_error(proc, f"{run} already holds a run ({run / 'ckpt.pt'})", "--overwrite=True")
    assert snapshot(run) == before


@pytest.mark.slow
def test_to_hf_refuses_a_folder_that_is_not_empty(run, data_root, tmp_path):
    dst = tmp_path / "hf"
    dst.mkdir()
    write(dst / "config.json", '{"model_type": "llama"}')
    write(dst / "model.safetensors", "weights")
    before = snapshot(dst)
    proc = run_script("-m", "scripts.convert", "to_hf", f"--out_dir={run}", f"--dst={dst}", data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--dst={dst} is not empty (config.json, model.safetensors)", "--overwrite=True")
    assert snapshot(dst) == before


WRITE_FAILS = """
import builtins, errno, os
_open, _makedirs = builtins.open, os.makedirs
def open(file, mode="r", *args, **kwargs):  # the disk fills up at config.json
    if "w" in mode and str(file).endswith("config.json"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return _open(file, mode, *args, **kwargs)
def makedirs(name, *args, **kwargs):  # the folder is read-only (root passes chmod, so it is said here)
    if ".tmp" in str(name):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(name))
    return _makedirs(name, *args, **kwargs)
builtins.open = open
if os.environ.get("FAIL") == "read-only":
    os.makedirs = makedirs
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault, reason", [("full", "No space left on device"), ("read-only", "Permission denied")])
def test_to_hf_that_cannot_write_is_one_line_and_leaves_no_folder(fault, reason, run, data_root, tmp_path):
    pytest.importorskip("safetensors", reason="to_hf writes safetensors (pip install safetensors)")
    write(tmp_path / "hook" / "sitecustomize.py", WRITE_FAILS)
    env = {**os.environ, "NANOLATENT_DATA": str(data_root), "PYTHONPATH": str(tmp_path / "hook"), "FAIL": fault}
    dst = tmp_path / "new" / "hf"
    proc = subprocess.run([sys.executable, "-m", "scripts.convert", "to_hf", f"--out_dir={run}", f"--dst={dst}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert_one_line_error(proc, str(dst), reason)
    assert sorted(os.listdir(tmp_path)) == ["hook", "run"]  # neither new/, nor hf/, nor a staging folder


@pytest.mark.slow
def test_convert_hf_on_a_malformed_config_is_one_line(data_root, tmp_path):
    write(tmp_path / "src" / "config.json", '{"model_type": "llama", "hidden_size": ')
    proc = run_script("-m", "scripts.convert", "hf", f"--src={tmp_path / 'src'}", f"--out_dir={tmp_path / 'out'}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, f"{tmp_path / 'src' / 'config.json'} is malformed (JSONDecodeError")
    assert not (tmp_path / "out" / "ckpt.pt").exists()


@pytest.mark.slow
def test_to_hf_without_safetensors_names_the_package(run, data_root, tmp_path):
    write(tmp_path / "hook" / "safetensors" / "__init__.py", "raise ImportError('not installed')\n")
    env = {**os.environ, "NANOLATENT_DATA": str(data_root), "PYTHONPATH": str(tmp_path / "hook")}
    proc = subprocess.run([sys.executable, "-m", "scripts.convert", "to_hf", f"--out_dir={run}", f"--dst={tmp_path / 'hf'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert_one_line_error(proc, "pip install safetensors")
    assert not (tmp_path / "hf").exists() or not os.listdir(tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("src, phrase", [
    ("{tmp}", "--src={tmp} is a folder: pass the path of a .gguf file in it"),
    ("{tmp}/half.gguf", "half.gguf"),  # not a readable GGUF, or no gguf package to read it: refused either way
])
def test_a_refused_gguf_import_leaves_no_trace(src, phrase, data_root, tmp_path):
    write(tmp_path / "half.gguf", "GGUF cut short")
    out = tmp_path / "new" / "run"
    proc = run_script("-m", "scripts.convert", "gguf", f"--src={src.format(tmp=tmp_path)}", f"--out_dir={out}",
                      data_dir=data_root, check=False)
    assert_one_line_error(proc, phrase.format(tmp=tmp_path))
    assert not (tmp_path / "new").exists()  # not even a folder holding a .lock
