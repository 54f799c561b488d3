"""--help and -h on every entry point: the script's settings with their defaults and comments, read from its source,
exit 0; with --model_type=X the model's Config fields too. Run in-process, each script up to its configurator call."""

import dataclasses
import glob
import importlib
import os
import re
import runpy
import signal
import subprocess
import sys

import pytest

import configurator
from conftest import ROOT

# every file that reads its settings through configurator.apply: the four scripts, scripts/ and experiments/
ENTRY_POINTS = sorted(os.path.relpath(path, ROOT) for pattern in ("*.py", "scripts/*.py", "experiments/*.py")
                      for path in glob.glob(os.path.join(ROOT, pattern))
                      if re.search(r"^[^#\n]*configurator\.apply\(globals\(\)", open(path).read(), re.M)
                      and not path.endswith("configurator.py"))


def run_help(monkeypatch, capsys, path, *args):
    """(exit code, stdout, the namespace configurator.apply saw) of `python path args` or `python -m module args`."""
    seen = []
    apply = configurator.apply

    def recording(namespace, *a, **k):
        seen.append(namespace)
        return apply(namespace, *a, **k)

    monkeypatch.setattr(configurator, "apply", recording)
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.chdir(ROOT)
    handler = signal.getsignal(signal.SIGINT)  # the explorer takes Ctrl-C for its own as it starts: given back below
    with pytest.raises(SystemExit) as exit:
        if os.sep in path:
            module = path[:-3].replace(os.sep, ".")
            monkeypatch.delitem(sys.modules, module, raising=False)  # imported by another study: run afresh
            runpy.run_module(module, run_name="__main__")
        else:
            runpy.run_path(os.path.join(ROOT, path), run_name="__main__")
    signal.signal(signal.SIGINT, handler)
    return exit.value.code, capsys.readouterr().out, seen[0] if seen else None


def test_every_script_reads_its_settings_through_the_configurator():
    assert {"train.py", "sample.py", "evaluate.py", "prepare.py", "scripts/convert.py", "scripts/explore.py",
            "experiments/btrans_passk_pretrained.py", "experiments/results.py"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_help_lists_every_setting_with_its_default_and_comment_in_the_files_order(monkeypatch, capsys, path):
    code, out, namespace = run_help(monkeypatch, capsys, path, "--help")
    assert code == 0
    defaults = {k: v for k, v in namespace["_config_defaults"].items() if not configurator.constant(k)}
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("settings ("))  # after the docstring's examples
    printed = {}  # key -> (line number, the value as printed)
    for i, line in enumerate(lines[start:], start):
        if m := re.match(r"--(\w+)=(.*?)(  # .*)?$", line):
            printed.setdefault(m[1], (i, m[2]))
    assert set(printed) == set(defaults)
    for key, (_, text) in printed.items():  # the default as printed, given back, is the default: on the command line,
        # or as a config file's literal where the command line cannot spell it (a tuple of texts with newlines)
        assert defaults[key] in (configurator.parse(key, text, defaults[key]), configurator.literal(text)), (key, text)
    source = open(os.path.join(ROOT, path)).read()
    first = {}  # key -> its first assignment's line in the source
    for m in re.finditer(r"^\s*(\w+(?:, \w+)*) = (.*)$", source, re.M):  # n_layer, n_embd = 8, 256 too
        for key in m[1].split(", "):
            if key in defaults:
                first.setdefault(key, m[2])
    assert sorted(defaults, key=lambda k: printed[k][0]) == list(first)
    for key, rest in first.items():  # each setting's own comment, on its line
        if comment := re.search(r"  # (.*)$", rest):
            assert comment[1] in lines[printed[key][0]], (key, comment[1])

def test_h_is_help(monkeypatch, capsys):
    code, out, _ = run_help(monkeypatch, capsys, "sample.py", "-h")
    assert code == 0 and (code, out) == run_help(monkeypatch, capsys, "sample.py", "--help")[:2]


def test_help_keeps_the_files_groups_and_their_comments(monkeypatch, capsys):
    code, out, _ = run_help(monkeypatch, capsys, "train.py", "--help")
    lines = out.splitlines()
    assert lines[0] == "usage: python train.py [config.py ...] [--key=value ...] [--quiet] [--help]"
    assert lines.index("# I/O") < lines.index("--out_dir=out") < lines.index("# data") < lines.index(
        "--dataset=synthetic") < lines.index("# system")
    # an own-line comment that continues a setting's comment stays under it
    code, out, _ = run_help(monkeypatch, capsys, "evaluate.py", "--help")
    lines = out.splitlines()
    kernels = next(i for i, line in enumerate(lines) if line.startswith("--kernels="))
    assert lines[kernels + 1].startswith("# module): faster, rounding apart.")
    code, out, _ = run_help(monkeypatch, capsys, "scripts/convert.py", "-h")
    assert code == 0 and out.startswith("usage: python -m scripts.convert [direction] [config.py ...]")


@pytest.mark.parametrize("model_type", ["det", "eve", "free", "btrans"])
def test_help_with_a_model_type_lists_its_config_fields(monkeypatch, capsys, model_type):
    code, out, _ = run_help(monkeypatch, capsys, "train.py", f"--model_type={model_type}", "--help")
    assert code == 0
    head, _, fields_part = out.partition(f"model_{model_type}.py's Config fields")
    assert fields_part, out[-500:]
    module = importlib.import_module(f"model_{model_type}")
    fields = {f.name: f for f in dataclasses.fields(module.Config) if f.init}
    printed = dict(re.findall(r"^--(\w+)=(.*?)(?:  # .*)?$", fields_part, re.M))
    assert set(printed) == set(fields)
    for name, text in printed.items():
        assert configurator.parse(name, text, fields[name].default) == fields[name].default
    source = open(module.__file__).read()
    body = source[source.index("class Config"):]
    for name, comment in re.findall(r"^    (\w+): \w+ = [^#\n]*?  # (.*)$", body, re.M)[:len(fields)]:
        if name in fields:
            assert comment in fields_part, (name, comment)


def test_help_without_a_model_type_names_the_option(monkeypatch, capsys):
    code, out, _ = run_help(monkeypatch, capsys, "evaluate.py", "--help")
    assert code == 0 and "Config fields" not in out.split("--model_type=X --help")[0]
    assert out.rstrip().endswith("(X: det, eve, free, btrans)")


def test_harness_help_is_lm_evals(monkeypatch, capsys):
    pytest.importorskip("lm_eval", reason="scripts/harness.py is lm_eval's command line: pip install 'lm_eval[hf]'")
    from lm_eval.api import registry
    # run as a script it registers its model again: the in-process import of another test (test_harness) made the first
    monkeypatch.delitem(registry.model_registry._objs, "nanolatent", raising=False)
    code, out, _ = run_help(monkeypatch, capsys, "scripts/harness.py", "--help")
    assert code == 0 and "--model_args" in out


def test_configurator_run_directly_says_it_is_not_and_names_the_scripts_help(monkeypatch, capsys):
    for args, code in ((["--help"], None), ([], 2)):
        monkeypatch.setattr(sys, "argv", ["configurator.py", *args])
        if code is None:
            runpy.run_path(os.path.join(ROOT, "configurator.py"), run_name="__main__")
            out = capsys.readouterr().out
        else:
            with pytest.raises(SystemExit) as exit:
                runpy.run_path(os.path.join(ROOT, "configurator.py"), run_name="__main__")
            assert exit.value.code == code
            out = capsys.readouterr().err
        assert out.removeprefix("error: ").startswith("configurator.py is not run directly")
        assert "python train.py --help" in out
        assert out.count("\n") == 1


def test_harness_help_without_lm_eval_says_what_it_is_and_how_to_get_lm_eval(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as where it is not installed: its import fails
    monkeypatch.setitem(sys.modules, "lm_eval.models", None)
    code, out, _ = run_help(monkeypatch, capsys, "scripts/harness.py", "--help")
    assert code == 0 and out.startswith("EleutherAI's lm-evaluation-harness on nanolatent runs")
    assert 'pip install "lm_eval[hf]"' in out.splitlines()[-1]


def test_a_wrong_type_is_named_with_its_article(capsys):
    for default, article in ((3, "an int"), (0.5, "a float"), ("x", "a str")):
        with pytest.raises(SystemExit):
            configurator.check("k", [1], default)
        assert f"--k expects {article} (default" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_a_bare_help_answers_from_the_source_without_loading_torch(monkeypatch, capsys, tmp_path, path):
    """`python X --help` is answered as X imports configurator, before torch (seconds on a loaded CPU): with a torch
    that cannot be imported on the path it prints what the in-process --help prints, but for a default that code
    computes, shown as that code."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch is not loaded for --help')\n")
    command = [sys.executable, path] if os.sep not in path else [sys.executable, "-m", path[:-3].replace(os.sep, ".")]
    proc = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    code, out, namespace = run_help(monkeypatch, capsys, path, "--help")
    written = configurator.written_settings(os.path.join(ROOT, path))[1]
    computed = {k for k, v in written.items() if isinstance(v, configurator.Written)}
    assert {k for k in written if not configurator.constant(k)} == \
        {k for k in namespace["_config_defaults"] if not configurator.constant(k)}
    for fast, slow in zip(proc.stdout.splitlines(), out.splitlines(), strict=True):
        key = re.match(r"--(\w+)=", slow)
        if key and key[1] in computed:
            assert fast.startswith(f"--{key[1]}=<{written[key[1]].code}>"), (fast, slow)
        else:
            assert fast == slow
