"""The README and docs/ cannot drift from the code: every `python <script>.py ... --key=value` and
`python -m scripts.<name> ...` or `python -m experiments.<name> ... --key=value` they show names a key the script
accepts, every config file they pass exists, every sample.py line fits the context of the run a train.py line of the
same page trains, every run, file, folder and prepared dataset a command reads is made by an earlier command of the
page (or shipped in the repo), and every local link and image resolves. Parsed, never run: the whole check takes well
under a second."""

import ast
import functools
import glob
import os
import re
import shlex

import numpy as np
import pytest

import configurator
from conftest import ROOT
from nanolatent import tasks

DOCS = ["README.md", "BENCHMARKS.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
MODEL_SCRIPTS = {"train.py", "sample.py", "evaluate.py"}  # also take any field of the model's Config
MODELS = ("det", "eve", "free", "btrans")
NOT_CONFIGURATOR = {"scripts.harness"}  # lm_eval's own command line


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def module_assignments(tree, before=None):
    """Names bound at a module's top level (above line `before`), as configurator.apply(globals()) sees them."""
    names = set()
    for node in tree.body:
        if before is not None and node.lineno >= before:
            break
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name) and not name.id.startswith("_") and not name.id.isupper():
                    names.add(name.id)
    return names


def script_keys(path):
    """The --key names a script's configurator accepts: its public module-level names bound above its first
    configurator.apply call (the defaults), parsed from the source."""
    source = read(path)
    tree = ast.parse(source)
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "apply" and isinstance(n.func.value, ast.Name) and n.func.value.id == "configurator"]
    assert calls, f"{path} has no configurator.apply call"
    top = [node for node in tree.body if node.lineno <= min(calls) <= (node.end_lineno or node.lineno)]
    return module_assignments(tree, before=top[0].lineno if top else min(calls))


def config_fields(model):
    """The init fields of model_<model>.py's Config dataclass, parsed from the source."""
    tree = ast.parse(read(f"model_{model}.py"))
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    return {n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def code_spans(text):
    """Fenced code blocks (continuation lines joined) and inline code spans of a markdown text."""
    spans = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        spans += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans += re.findall(r"`([^`\n]+)`", prose)
    return spans


def substituted(span):
    """span with each $(...) (a command substitution: python -c "...; ...") as one word."""
    while (start := span.find("$(")) >= 0:
        depth, end = 0, start + 1
        for end in range(start + 1, len(span)):
            depth += {"(": 1, ")": -1}.get(span[end], 0)
            if depth == 0:
                break
        span = span[:start] + "SUBSTITUTED" + span[end + 1:]
    return span


def commands(text, spans=code_spans):
    """(script, [arguments]) for every python command of a markdown text: script is 'x.py', 'scripts.x' or
    'experiments.x'."""
    found = []
    for span in spans(text):
        span = substituted(span)
        for part in re.split(r"&&|;|\|(?!\|)", span):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote in prose: not a command
                continue
            for i, word in enumerate(words):
                if word in ("python", "python3", "torchrun"):
                    rest = words[i + 1:]
                    if rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith(("experiments.", "scripts.")):
                        found.append((rest[1], rest[2:]))
                    else:
                        scripts = [j for j, w in enumerate(rest) if w.endswith(".py") and "/" not in w]
                        if scripts and (word == "torchrun" or scripts[0] == 0):
                            found.append((rest[scripts[0]], rest[scripts[0] + 1:]))
                    break
    return found


def all_commands():
    return [(doc, script, args) for doc in DOCS for script, args in commands(read(doc))]


def test_the_docs_show_commands_of_every_kind():
    scripts = {script for _, script, _ in all_commands()}
    assert {"train.py", "sample.py", "evaluate.py", "prepare.py", "scripts.convert", "scripts.rlvr", "scripts.bench",
            "scripts.bench_cpu", "experiments.free_synthetic"} <= scripts


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_command_passes_keys_its_script_accepts(doc):
    fields = {m: config_fields(m) for m in MODELS}
    problems = []
    for script, args in commands(read(doc)):
        if script in NOT_CONFIGURATOR:
            continue
        path = script if script.endswith(".py") else script.replace(".", "/") + ".py"
        if not os.path.isfile(os.path.join(ROOT, path)):
            problems.append(f"{script}: no such script")
            continue
        keys = script_keys(path)
        given = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
        if script in MODEL_SCRIPTS:  # the model's Config fields too: the named model's, else any of the four
            named = given.get("model_type")
            keys |= fields[named] if named in fields else set().union(*fields.values())
        if script == "scripts.rlvr":  # the policy is always B-Trans
            keys |= fields["btrans"]
        for key in given:
            if key not in keys:
                problems.append(f"{script} --{key}: not a key of {path}")
        for arg in args:
            if arg.startswith("config/") and arg.endswith(".py") and not os.path.isfile(os.path.join(ROOT, arg)):
                problems.append(f"{script} {arg}: no such config file")
    assert not problems, f"{doc}:\n" + "\n".join(problems)


def literal_defaults(tree, names):
    """{name: value} of the module-level (or class-level) assignments of names whose value is a literal."""
    found = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id in names and node.value is not None:
            try:
                found[target.id] = ast.literal_eval(node.value)
            except ValueError:  # an expression (device = "cuda" if ...): not a default this check needs
                pass
    return found


def trained_block_sizes(doc_commands):
    """{out_dir: block_size} of the runs a page's train.py lines train, each read as train.py reads it: its defaults,
    then its config files (run from the repo root, as the page's commands are), then --key=value; the block_size a
    run leaves unset is its model's default, or one synthetic sequence (train.py's default for fixed-length data)."""
    defaults = literal_defaults(ast.parse(read("train.py")), {"out_dir", "model_type", "dataset"})
    runs, cwd = {}, os.getcwd()
    os.chdir(ROOT)  # a config file may exec another by a path relative to the repo root
    try:
        for script, args in doc_commands:
            if script != "train.py":
                continue
            values = dict(defaults)
            for arg in args:
                if arg.endswith(".py"):
                    values.update(configurator.read_config_file(arg))
            values.update(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
            if "block_size" not in values:
                if values["dataset"] == "synthetic":
                    values["block_size"] = len(tasks.synthetic_sequences(1, np.random.default_rng(0))[0]) - 1
                else:
                    config = next(n for n in ast.parse(read(f"model_{values['model_type']}.py")).body
                                  if isinstance(n, ast.ClassDef) and n.name == "Config")
                    values["block_size"] = literal_defaults(config, {"block_size"})["block_size"]
            runs[values["out_dir"]] = int(values["block_size"])
    finally:
        os.chdir(cwd)
    return runs


def sample_lengths(args):
    """(out_dir, the most tokens the prompt can take, new tokens) of a sample.py line: a token is at least one byte in
    every tokenizer the runs use (characters, GPT-2's byte-level BPE)."""
    defaults = literal_defaults(ast.parse(read("sample.py")), {"out_dir", "start", "max_new_tokens"})
    values = {**defaults, **dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)}
    out_dir = values["out_dir"][:-len("/ckpt.pt")] if values["out_dir"].endswith("/ckpt.pt") else values["out_dir"]
    return out_dir, len(values["start"].encode()), int(values["max_new_tokens"])


def checked_sample_lines(doc):
    """(out_dir, prompt tokens, new tokens, the run's block_size) for the page's sample.py lines whose run a train.py
    line of the same page, or else of the README, trains (a prompt read from a file, and runs imported or trained
    elsewhere, are not known here)."""
    found = commands(read(doc))
    runs = {**trained_block_sizes(commands(read("README.md"))), **trained_block_sizes(found)}
    lines = [sample_lengths(args) for script, args in found
             if script == "sample.py" and not any(a.startswith("--start=FILE:") for a in args)]
    return [(out_dir, prompt, new, runs[out_dir]) for out_dir, prompt, new in lines if out_dir in runs]


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_sample_line_fits_the_context_of_its_run(doc):
    """sample.py refuses a prompt plus --max_new_tokens beyond the run's block_size: a page's command must fit."""
    problems = [f"sample.py --out_dir={out_dir}: prompt of up to {prompt} tokens + {new} new tokens exceeds the run's "
                f"block_size={block_size}" for out_dir, prompt, new, block_size in checked_sample_lines(doc)
                if prompt + new > block_size]
    assert not problems, f"{doc}:\n" + "\n".join(problems)


def test_the_context_check_reads_the_runs_of_the_readme_and_catches_a_line_too_long():
    checked = {(out_dir, block_size) for out_dir, _, _, block_size in checked_sample_lines("README.md")}
    assert {("out", 66), ("out-det-shakespeare-char", 128)} <= checked  # the quick start's run and Tiny Shakespeare's
    too_long = commands("```sh\npython train.py config/det_shakespeare_char.py\npython sample.py "
                        "--out_dir=out-det-shakespeare-char --start=ROMEO: --max_new_tokens=123\n```\n")
    assert "out-det-shakespeare-char" in {line[0] for line in checked_sample_lines("docs/evaluation.md")}  # README's
    assert trained_block_sizes(too_long) == {"out-det-shakespeare-char": 128}
    assert sample_lengths(too_long[1][1]) == ("out-det-shakespeare-char", 6, 123)  # 6 + 123 > 128


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path):
    text = re.sub(r"^```.*?^```", "", read(path), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_local_link_and_image_resolves(doc):
    text = re.sub(r"^```.*?^```", "", read(doc), flags=re.S | re.M)
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(os.path.join(ROOT, resolved)):
            problems.append(f"{target}: {resolved} does not exist")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved}")
    assert not problems, f"{doc}:\n" + "\n".join(problems)


@pytest.mark.slow
def test_the_parser_reads_keys_continuations_and_inline_commands():
    text = ("Run `python train.py --max_iters=300` first.\n\n```sh\npython -m experiments.eve_vs_det \\\n"
            "    --device=cuda   # a GPU\nOMP_NUM_THREADS=1 python -m scripts.bench --peer=x.py && python sample.py --out_dir=out\n"
            "torchrun --standalone --nproc_per_node=8 train.py config/free_1b5.py --fsdp=True\n```\n")
    assert commands(text) == [("experiments.eve_vs_det", ["--device=cuda"]), ("scripts.bench", ["--peer=x.py"]),
                              ("sample.py", ["--out_dir=out"]), ("train.py", ["config/free_1b5.py", "--fsdp=True"]),
                              ("train.py", ["--max_iters=300"])]
    assert {"max_iters", "out_dir", "dataset"} <= script_keys("train.py") and "config" not in script_keys("train.py")
    assert "kappa_bits" in config_fields("free") and "sigma" in config_fields("btrans")
    assert slug("B-Trans Pass@K on SmolLM2 (§5.1)") == "b-trans-passk-on-smollm2-51"


def spans_in_order(text):
    """code_spans in the order a reader meets them: fenced blocks and inline spans by position."""
    spans = []
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```|`([^`\n]+)`", text, flags=re.S | re.M):
        spans += m[1].replace("\\\n", " ").splitlines() if m[1] is not None else [m[2]]
    return spans


def run_folder(path):
    """A run as a command names it: its folder, or its ckpt.pt (the folder then)."""
    path = path.rstrip("/")
    return os.path.dirname(path) if path.endswith(".pt") else path


def runs_made_and_read(doc):
    """[(run folder, 'made' or 'read', command)] of a page's commands in its order: train.py and scripts.rlvr make
    their out_dir (--out_dir, else their config file's, else the default), scripts.convert hf and gguf theirs;
    sample.py, evaluate.py (each of its runs), the explorer, scripts.convert to_hf, scripts.plot (its run folders),
    the harness (model_args out_dir=) and a study's --out_dir, --sft_dir, --det_dir or --eve_dir read one."""
    path = lambda script: script if script.endswith(".py") else script.replace(".", "/") + ".py"
    defaults = {script: literal_defaults(ast.parse(read(path(script))), {"out_dir"}).get("out_dir")
                for script in ("train.py", "sample.py", "evaluate.py", "scripts.explore", "scripts.rlvr")}
    found, cwd = [], os.getcwd()
    os.chdir(ROOT)  # config files are read as the commands, run from the repo root, read them
    try:
        for span in spans_in_order(read(doc)):
            # a folder the shell or a Python snippet of the page makes (mkdir, os.makedirs) is made too
            made = re.findall(r"(?:mkdir(?: -p)?|os\.makedirs\()\s*\"?([\w./-]+)", span)
            found += [(run_folder(run), "made", span) for run in made]
            found += page_runs(commands(span, lambda span: [span]), defaults)
    finally:
        os.chdir(cwd)
    return found


def page_runs(span_commands, defaults):
    """runs_made_and_read's entries for the commands of one code span."""
    found = []
    for script, args in span_commands:
        given = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
        free = [a for a in args if not a.startswith("-") and not a.endswith(".py")]
        line = f"{script} {' '.join(args)}"
        if script in ("train.py", "scripts.rlvr"):
            out_dir = defaults[script]
            for arg in args:
                if arg.endswith(".py"):
                    out_dir = configurator.read_config_file(arg).get("out_dir", out_dir)
            found.append((run_folder(given.get("out_dir", out_dir)), "made", line))
        elif script == "scripts.convert":
            if "out_dir" in given:
                found.append((run_folder(given["out_dir"]), "read" if free[:1] == ["to_hf"] else "made", line))
        elif script in ("sample.py", "evaluate.py", "scripts.explore"):
            found += [(run_folder(run), "read", line) for run in given.get("out_dir", defaults[script]).split(",")
                      if run]
        elif script == "scripts.plot":
            found += [(run_folder(run), "read", line) for run in free if not run.endswith((".json", ".png"))]
        elif script == "scripts.harness":
            model_args = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--model_args"), "")
            found += [(run_folder(v), "read", line) for k, _, v in (a.partition("=") for a in model_args.split(","))
                      if k == "out_dir"]
        elif script.startswith("experiments."):
            found += [(run_folder(given[k]), "read", line) for k in ("out_dir", "sft_dir", "det_dir", "eve_dir")
                      if k in given]
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_run_a_documented_command_reads_is_made_by_an_earlier_command_of_the_page(doc):
    made, problems = set(), []
    for run, what, line in runs_made_and_read(doc):
        if what == "made":
            made.add(run)
        elif run not in made and not run.startswith("$"):  # a shell variable: its loop lists the runs
            problems.append(f"{run} ({line[:100]})")
    assert not problems, f"{doc}: runs read before any command of the page makes them:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------------------------------------------
# the files, folders and prepared datasets a command reads: made by an earlier command of the same page

REPO_FOLDERS = ("config", "assets", "docs", "scripts", "experiments", "nanolatent", "tests")  # read as shipped
MADE_BY_FLAG = {  # (script or its prefix, flag) -> what the flag's path is: what the script writes there
    ("evaluate.py", "out_json"): "file", ("evaluate.py", "out_items"): "file", ("scripts.plot", "out"): "file",
    ("scripts.convert", "dst"): "folder", ("experiments.", "results"): "file", ("experiments.", "figure"): "file",
    ("experiments.", "json_out"): "file", ("experiments.", "runs_dir"): "folder", ("scripts.bench_speedrun",
                                                                                    "out_json"): "file"}
READ_BY_FLAG = {  # the same for the paths a script reads
    ("prepare.py", "input"): "file", ("prepare.py", "val_input"): "file", ("prepare.py", "bpe_file"): "file",
    ("train.py", "init_embeddings"): "file", ("scripts.bench", "peer"): "file", ("scripts.bench_speedrun",
                                                                                 "nanogpt"): "folder",
    ("scripts.bench_speedrun", "input"): "file", ("scripts.bench_cpu", "src"): "folder",
    ("experiments.", "rlvr_config"): "file"}


def shell_commands(span):
    """The words of each shell command of a code span (split at &&, ||, ;, |, quotes kept whole, comments dropped):
    [] for prose that is not shell (an unbalanced quote)."""
    lexer = shlex.shlex(span, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    found, words = [], []
    for token in tokens + [";"]:
        if token.strip(";&|"):
            words.append(token)
        elif words:
            found.append(words)
            words = []
    return found


def shell_made(words):
    """The paths one shell command (its words) writes: curl -O/-o, wget, cp, git clone, mkdir, a > redirect, and the
    file names a `python -c` snippet writes ('{...}' in an f-string name: any text there)."""
    while words and re.match(r"\w+=", words[0]):  # VAR=value before the command
        words = words[1:]
    made, name = [], words[0] if words else ""
    for i, word in enumerate(words):  # > file, >> file, >file
        if word in (">", ">>") and i + 1 < len(words):
            made.append(words[i + 1])
        elif word.startswith(">") and len(word) > 1 and not word.startswith(">&"):
            made.append(word.lstrip(">"))
    args = [w for w in words[1:] if w not in (">", ">>") and not w.startswith(">")]
    plain = [w for w in args if not w.startswith("-")]
    if name == "curl":
        if "-O" in args:
            made += [w.rsplit("/", 1)[-1] for w in plain if "://" in w]
        made += [args[i + 1] for i, w in enumerate(args[:-1]) if w in ("-o", "--output")]
    elif name == "wget":
        given = [args[i + 1] for i, w in enumerate(args[:-1]) if w == "-O"]
        made += given or [w.rsplit("/", 1)[-1] for w in plain if "://" in w]
    elif name == "cp" and len(plain) >= 2:
        *sources, dst = plain
        made += [os.path.join(dst, os.path.basename(s.rstrip("/"))) if dst in (".", "./") or dst.endswith("/")
                 else dst for s in sources]
    elif name == "git" and plain[:1] == ["clone"] and len(plain) >= 2:
        made.append(plain[2] if len(plain) > 2 else plain[1].rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))
    elif name == "mkdir":
        made += plain
    elif name == "pip" and plain[:1] == ["install"]:  # a package's files, as PACKAGE/FILE (scripts.convert gguf --src)
        made += [re.split(r"[=<>\[]", w)[0].replace("-", "_") + "/" for w in plain[1:] if "/" not in w]
    elif name in ("python", "python3") and args[:1] == ["-c"] and len(args) > 1:
        made += re.findall(r"""['"]([\w{}./-]+\.(?:jsonl|json|txt|npy|bin))['"]""", args[1])
        made += re.findall(r"""makedirs\(['"]([\w./-]+)['"]""", args[1])
    return made


def dataset_made(args):
    """The dataset a prepare.py command writes: --name, else the source's own name (text: <input stem>_<tokenizer>)."""
    given = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
    source = next((a for a in args if not a.startswith("-")), "")
    if given.get("name"):
        return given["name"]
    if source == "text":
        tokenizer = given.get("tokenizer", "gpt2")
        return f"{os.path.splitext(os.path.basename(given.get('input', '')))[0]}_" + \
            (tokenizer if tokenizer in ("gpt2", "char") else "hf")
    return source


def datasets_read(script, args, given):
    """The prepared datasets a command reads: train.py's (--dataset, else its config file's, else the default; a dry
    run only where the config leaves vocab_size to the data), evaluate.py's and a study's --dataset (a study's
    default too)."""
    if script == "train.py" or (script.startswith("experiments.") and script != "experiments.results"):
        path = "train.py" if script == "train.py" else script.replace(".", "/") + ".py"
        if not os.path.isfile(os.path.join(ROOT, path)):  # no such study: the keys' check says so
            return []
        values = literal_defaults(parsed(path), {"dataset"})
        for arg in args:
            if arg.endswith(".py") and script == "train.py":
                values.update(configurator.read_config_file(arg))
        values.update(given)
        if script == "train.py" and values.get("dry_run") in (True, "True") and "vocab_size" in values:
            return []
        return [values["dataset"]] if values.get("dataset") else []
    if script == "evaluate.py" and given.get("dataset"):
        return [given["dataset"]]
    return []


def inputs_made_and_read(text):
    """[(what, 'made' or 'read', command)] of a page's (a markdown text's) commands in its order, what being ('file', path),
    ('folder', path) or ('dataset', name): what shell commands and scripts write (see shell_made, dataset_made,
    MADE_BY_FLAG; a run folder runs_made_and_read finds made is a folder made too) and what scripts read
    (READ_BY_FLAG, datasets_read, --start=FILE: and --text=FILE:, prepare.py's --tokenizer file, --mc_file as a path,
    scripts.plot's .json files, scripts.convert gguf --src, the harness's --include_path; its --output_path is made)."""
    found, cwd = [], os.getcwd()
    os.chdir(ROOT)  # config files are read as the commands, run from the repo root, read them
    try:
        for span in spans_in_order(text):
            for words in shell_commands(span):
                found += [(("folder" if w.endswith("/") or "." not in os.path.basename(w) else "file", w), "made",
                           " ".join(words)) for w in shell_made(words)]
                if words[0] == "lm_eval":  # lm_eval itself: the exported folder it reads, its local tasks
                    found += harness_inputs(words[1:], " ".join(words))
            for script, args in commands(span, lambda span: [span]):
                found += command_inputs(script, args)
            found += [(("folder", run), "made", line) for run, what, line in runs_made_and_read_in(span)
                      if what == "made"]
    finally:
        os.chdir(cwd)
    return found


@functools.cache
def parsed(path):
    """A file of the repo as a syntax tree, parsed once."""
    return ast.parse(read(path))


def runs_made_and_read_in(span):
    """runs_made_and_read's entries for one code span (run from the repo root)."""
    path = lambda script: script if script.endswith(".py") else script.replace(".", "/") + ".py"
    defaults = {script: literal_defaults(parsed(path(script)), {"out_dir"}).get("out_dir")
                for script in ("train.py", "sample.py", "evaluate.py", "scripts.explore", "scripts.rlvr")}
    return page_runs(commands(span, lambda span: [span]), defaults)


def command_inputs(script, args):
    """inputs_made_and_read's entries for one command."""
    given = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
    free = [a for a in args if not a.startswith("-") and not a.endswith(".py")]
    line = f"{script} {' '.join(args)}"
    flagged = lambda table: [((kind, given[flag]), line) for (who, flag), kind in table.items()
                             if (script == who or who.endswith(".") and script.startswith(who)) and given.get(flag)]
    found = [(what, "made", line) for what, line in flagged(MADE_BY_FLAG)]
    found += [(what, "read", line) for what, line in flagged(READ_BY_FLAG)]
    if script == "prepare.py":
        tokenizer = given.get("tokenizer", "")
        if "/" in tokenizer or tokenizer.endswith(".json"):
            found.append((("file", tokenizer), "read", line))
        found.append((("dataset", dataset_made(args)), "made", line))
    found += [(("dataset", name), "read", line) for name in datasets_read(script, args, given)]
    found += [(("file", v[len("FILE:"):]), "read", line) for k, v in given.items()
              if k in ("start", "text") and v.startswith("FILE:")]
    if script == "evaluate.py" and ("/" in given.get("mc_file", "") or given.get("mc_file", "").endswith(".jsonl")):
        found.append((("file", given["mc_file"]), "read", line))
    if script == "scripts.plot":
        found += [(("file", a), "read", line) for a in free if a.endswith(".json")]
    if script == "scripts.convert" and free[:1] == ["gguf"] and given.get("src"):
        found.append((("file", given["src"]), "read", line))
    if script == "scripts.harness":
        found += harness_inputs(args, line)
    return found


def harness_inputs(args, line):
    """What lm_eval's command line (scripts.harness's or lm_eval's own) reads: --include_path, a --model hf export
    (model_args pretrained=); and makes: --output_path."""
    option = lambda name: [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    found = [(("folder", p), "read", line) for p in option("--include_path")]
    found += [(("folder", v), "read", line) for model_args in option("--model_args")
              for k, _, v in (a.partition("=") for a in model_args.split(",")) if k == "pretrained"]
    return found + [(("folder", p), "made", line) for p in option("--output_path")]


def unmade_reads(entries):
    """The reads of entries (inputs_made_and_read's) that nothing before them made: a file is made by itself or by a
    folder above it made (a run folder holds its tokenizer.json); a file of the repo's own folders is shipped; a
    dataset by prepare.py or by a made data/<name> folder; a path of a variable, a substitution, a placeholder or an
    absolute path is the reader's own."""
    made, problems = set(), []
    for (kind, path), what, line in entries:
        path = os.path.normpath(path) if kind != "dataset" else path
        if what == "made":
            made.add(("dataset", path) if kind == "dataset" else ("dataset", path[len("data/"):])
                     if kind == "folder" and path.startswith("data/") else ("path", path))
            continue
        if re.match(r"[$<~/]|SUBSTITUTED", path) or "..." in path:
            continue
        if kind == "dataset":
            if ("dataset", path) not in made:
                problems.append(f"data/{path} ({line[:100]})")
            continue
        parents = [path] + [os.path.join(*path.split(os.sep)[:i]) for i in range(1, path.count(os.sep) + 1)]
        patterns = [re.escape(p).replace(r"\{", "{").replace(r"\}", "}") for _, p in made if "{" in p]
        if any(("path", p) in made for p in parents) or any(
                re.fullmatch(re.sub(r"\{[^}]*\}", ".+", p), path) for p in patterns) or (
                path.split(os.sep)[0] in REPO_FOLDERS and os.path.exists(os.path.join(ROOT, path))):
            continue
        problems.append(f"{path} ({line[:100]})")
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_folder_and_dataset_a_documented_command_reads_is_made_by_an_earlier_command_of_the_page(doc):
    problems = unmade_reads(inputs_made_and_read(read(doc)))
    assert not problems, f"{doc}: read before any command of the page makes them:\n" + "\n".join(problems)


def test_the_made_before_read_check_catches_each_kind_of_read_before_its_command_and_passes_the_page_in_order():
    reads = """```sh
python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
python train.py config/det_arith.py --init_embeddings=emb.npy
python evaluate.py --out_dir=out-det-shakespeare-char --dataset=shakespeare --text=FILE:story.txt
python -m scripts.plot eval.json --out=curves.png
python -m scripts.convert gguf --src=SmolLM2.gguf --out_dir=out-smollm2
python prepare.py text --input=input.txt --tokenizer=out-smollm2/tokenizer.json --name=shakespeare_smollm2
python -m scripts.harness --model nanolatent --model_args out_dir=out-smollm2 --tasks hs_local --include_path my_tasks/
python -m scripts.bench --peer=nanoGPT/model.py
python -m experiments.eve_paper_protocol --dataset=wp25_cpu --rlvr_config=config/rlvr_arith.py
lm_eval --model hf --model_args pretrained=hf-det,dtype=float32 --tasks my_mc --include_path my_tasks/
```
"""
    makes = """```sh
curl -O https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt   # or: cp x .
python -c "import numpy as np; np.save('emb.npy', np.zeros((65, 128)))"
echo "ROMEO:" > story.txt && python prepare.py text --input=input.txt --name=shakespeare
mkdir -p my_tasks && cp $NANOLATENT_LOCAL_DATA/wp/wp_sample_train.jsonl wp_train.jsonl
git clone https://github.com/karpathy/nanoGPT
curl -L -o SmolLM2.gguf https://example.com/SmolLM2.gguf
python -m experiments.btrans_passk_pretrained --json_out=x.json && python evaluate.py --out_dir=out-x --out_json=eval.json
python prepare.py text --input=wp_train.jsonl --name=wp25_cpu && python prepare.py arith
python -m scripts.convert to_hf --out_dir=out-smollm2 --dst=hf-det
```
"""
    unmade = [problem.split(" (")[0] for problem in unmade_reads(inputs_made_and_read(reads))]
    assert unmade == ["input.txt", "emb.npy", "data/arith", "data/shakespeare", "story.txt", "eval.json",
                      "SmolLM2.gguf", "input.txt", "my_tasks", "nanoGPT/model.py", "data/wp25_cpu", "my_tasks", "hf-det"]
    # made first, in any order: the shipped config file is read as it is; convert's run folder holds tokenizer.json
    assert unmade_reads(inputs_made_and_read(makes + reads)) == []


def test_every_row_of_the_resume_table_names_tests_that_exist():
    """docs/training.md's table of what a resume can change: each row names its tests (functions of the file named,
    or, quoted, cases of test_train.py's TRAIN_CASES), and each of them exists."""
    text = read("docs/training.md")
    rows = text[text.index("| Setting, on resume |"):].split("\n\n")[0].splitlines()[2:]
    assert len(rows) >= 10
    for row in rows:
        cell = row.rstrip(" |").rsplit("|", 1)[1]
        source = read(os.path.join("tests", re.search(r"`(test_\w+\.py)", cell).group(1)))
        named = [f"def {name}(" for name in re.findall(r"\b(test_\w+)`", cell)]
        named += [f'"{case}": (' for case in re.findall(r'"([^"]+)"', cell)]
        assert named and all(n in source for n in named), row
