"""Overrides a script's module-level defaults from Python config files and --key=value arguments: nanoGPT's
configurator, made strict (an unknown key or a value of the wrong type is one clear error and exit code 2).

    python train.py config/free_synthetic.py --batch_size=32 --kappa_bits=0.5

Every script calls it once, right below its defaults, as nanoGPT's scripts exec configurator.py there:

    config, model_config = configurator.apply(globals())

The defaults are the module's public names bound to an int, float, bool, str or tuple above that line. Config files
(arguments ending in .py) are plain Python: every top-level name they assign becomes an override. A value on the
command line is read as the type of its default: a str is taken as written (--start=123 is the text "123"), a tuple
is split on commas (--kappas=1_64,8), a number or bool is a Python literal (--compile=False). Keys that are fields of
the chosen model's Config dataclass (n_layer, sigma, kappa_bits, ...) are accepted too and returned separately.
--help (or -h) prints the script's docstring and every default with its comments, read from the script's source, and
exits 0; with --model_type=X, model_X.py's Config fields too. --quiet turns off the progress lines (common.progress) of
the script and of the processes it starts.

This module loads no torch: a script imports it first, and a bare `--help` is answered at that import, from the
script's source alone (a default that code computes is shown as its code), before torch takes seconds to load.
"""

import ast
import dataclasses
import difflib
import io
import math
import os
import sys
import tokenize
import types

TYPES = (int, float, bool, str, tuple)  # what a default may be


def die(message):
    """common.die, imported at the first error only: this module loads no torch (see the docstring)."""
    from nanolatent import common
    common.die(message)


def read_config_file(path):
    """Top-level assignments of a Python config file, one line on stderr for anything wrong with it."""
    if not os.path.isfile(path):
        die(f"config file {path!r} {'is a directory' if os.path.isdir(path) else 'not found'} (arguments are "
                   f"config files ending in .py, or --key=value)")
    namespace = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), namespace)
    except SyntaxError as e:
        die(f"config file {path} line {e.lineno}: {e.msg}")
    except SystemExit as e:  # an exit would end the run there, silently, with the exit's code
        die(f"config file {path} called sys.exit({e.code!r}): a config file only assigns values")
    except Exception as e:
        die(f"config file {path} failed: {type(e).__name__}: {e}")
    # every value it assigns, checked as --key=value is (a dict, torch.bfloat16: refused, never dropped); what it
    # imports or defines to compute them is not a value
    return {k: v for k, v in namespace.items() if not k.startswith("_")
            and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def literal(text):
    """A Python literal, or the text itself when it is none (--model_type=btrans)."""
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text


def parse(key, text, default):
    """A command-line value as the type of its default."""
    if isinstance(default, str):
        value = literal(text)
        return value if isinstance(value, str) else text  # quoted or not, a string stays as written
    if isinstance(default, tuple):
        if default and isinstance(default[0], str):
            return tuple(part for part in text.split(",") if part)  # --kappas=1_64,8: words, never numbers
        value = literal(text)
        return check(key, value if isinstance(value, (tuple, list)) else (value,), default)
    return check(key, literal(text), default)


def check(key, value, default, source=None):
    """The value must have the default's type; an int may stand for a float; a None default takes anything; a
    tuple's elements must have the type of the default's first element (a None value only where the default is
    None). source: the config file that set it."""
    if default is None:
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, tuple) and isinstance(value, (list, tuple)):
        return tuple(check(key, v, default[0], source) for v in value) if default else tuple(value)
    if type(value) is not type(default):
        where = f"{key} = {value!r} in config file {source}: " if source else ""
        kind = type(default).__name__
        die(f"{where}--{key} expects {'an' if kind[0] in 'aeiou' else 'a'} {kind} (default {default!r}), got "
                   f"{value!r} of type {type(value).__name__}")
    return value


def configure(defaults, argv, model_fields=None, positional=None, given=None):
    """Returns (script values, model values). model_fields(values) -> {field: default} of the chosen model's Config,
    called with the script's values after overrides (so it can look at the model key). positional names the default
    that takes the arguments which are neither config files nor --key=value: a str takes one (prepare.py's source), a
    tuple all of them (scripts/plot.py's runs). given, a set, receives the keys that a file or the command line set."""
    file_values, sources, cli_texts, free = {}, {}, {}, []
    for arg in argv:
        if arg.startswith("--"):
            key, sep, text = arg[2:].partition("=")
            if not sep:
                die(f"argument {arg!r} has no value: write --{key}=VALUE")
            cli_texts[key] = text
        elif arg.endswith(".py") or positional is None:
            values = read_config_file(arg)
            file_values.update(values)
            sources.update(dict.fromkeys(values, arg))
        else:
            free.append(arg)
    if given is not None:
        given.update(file_values, cli_texts)
    values = dict(defaults)
    if positional is not None and free:
        if isinstance(defaults[positional], str) and len(free) > 1:
            die(f"one {positional} at a time, got {' '.join(free)}")
        values[positional] = tuple(free) if isinstance(defaults[positional], tuple) else free[0]
    for key, value in file_values.items():
        if key in defaults:
            values[key] = check(key, tuple(value) if isinstance(value, list) else value, defaults[key], sources[key])
    for key, text in cli_texts.items():  # the command line wins over config files
        if key in defaults:
            values[key] = parse(key, text, defaults[key])
    fields = model_fields(values) if model_fields else {}
    model_values = {}
    for key in [*file_values, *cli_texts]:
        if key in defaults:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(defaults) + list(fields), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            where = f" (set in config file {sources[key]})" if key in sources and key not in cli_texts else ""
            die(f"unknown config key {key!r}{where}{hint}; known keys: {', '.join(sorted(defaults))}"
                       + (f", and the model's Config fields: {', '.join(sorted(fields))}" if fields else ""))
        model_values[key] = (parse(key, cli_texts[key], fields[key]) if key in cli_texts
                             else check(key, file_values[key], fields[key], sources[key]))
    return values, model_values


class Written:
    """A default that code computes (device = "cuda" if torch.cuda.is_available() else "cpu"), as the source writes it:
    what a --help answered before the script ran shows."""

    def __init__(self, code):
        self.code = code


def shown(value):
    """A default as --key= takes it back: words as written, a tuple comma-separated, anything else as a literal."""
    if isinstance(value, Written):
        return f"<{value.code}>"
    if value == ():
        return "()"
    if isinstance(value, tuple):
        parts = [shown(v) for v in value]
        return ",".join(parts) if all(p == str(v) and "," not in p for p, v in zip(parts, value)) else repr(value)
    if isinstance(value, str):
        plain = value and value.isprintable() and " " not in value and value == value.strip("'\"")
        return value if plain else repr(value)
    return repr(value)


def settings(path, values, scope=None):
    """The lines that document values, as the file at path writes them: each assignment of a key at the top level
    of the file (or of the class scope, a Config) as --key=value with its trailing comment, the default being the
    value in values (what the code computed), and the comment lines around and between them, in the file's order."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    body = tree if scope is None else next(node for node in ast.walk(tree)
                                           if isinstance(node, ast.ClassDef) and node.name == scope)
    hidden, found = [], {}  # lines of functions (their comments are not a setting's); the first assignment per key
    stack = list(ast.iter_child_nodes(body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            hidden.append(range(node.lineno - len(node.decorator_list), node.end_lineno + 1))
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            names += [e.id for t in targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)]
            for name in names:
                if name in values and (name not in found or found[name].lineno > node.lineno):
                    found[name] = node
        elif isinstance(node, (ast.If, ast.With, ast.Try)):  # `if __name__ == "__main__":` defaults
            stack.extend(ast.iter_child_nodes(node))
    lines = source.splitlines()
    comments = {}  # line -> (own line?, text)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (not lines[row - 1][:col].strip(), tok.string.lstrip("#").strip())
    if not found:
        return [f"--{key}={shown(value)}" for key, value in values.items()]
    starts = {}  # first line of an assignment -> its keys
    for name, node in found.items():
        starts.setdefault(node.lineno, []).append(name)
    owned = {row for node in found.values() for row in range(node.lineno, node.end_lineno + 1)}
    first, last = min(starts), max(node.end_lineno for node in found.values())
    while first - 1 in comments and comments[first - 1][0]:  # the comment block right above the first
        first -= 1
    while last + 1 in comments and comments[last + 1][0]:  # and right below the last
        last += 1
    out = []
    for row in range(first, last + 1):
        if any(row in r for r in hidden):
            continue
        if row in starts:
            node = found[starts[row][0]]
            trailing = " ".join(comments[r][1] for r in range(row, node.end_lineno + 1) if r in comments)
            for name in starts[row]:
                out.append(f"--{name}={shown(values[name])}" + (f"  # {trailing}" if trailing else ""))
        elif row in comments and comments[row][0] and row not in owned:
            text = comments[row][1]
            if text.strip("-=# "):  # not a separator line
                out.append(f"# {text}")
        elif not lines[row - 1].strip() and out and out[-1]:
            out.append("")
    out += [f"--{key}={shown(value)}" for key, value in values.items() if key not in found]
    return out


def constant(key):
    """An upper-case name (ROOT, ARMS) is a script's constant, left out of --help (configure() accepts it as any
    default); a one-letter one (K: minds per prompt) is a symbol of the paper, a setting."""
    return key.isupper() and len(key) > 1


def model_types():
    """models.MODEL_TYPES, read from nanolatent/models.py's source (importing it loads torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nanolatent", "models.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "MODEL_TYPES" for t in node.targets))


def usage(path, doc, defaults, argv, positional):
    """--help: the script's docstring, then its settings; with --model_type=X (or a config file setting it), the
    fields of model_X.py's Config."""
    root = os.path.dirname(os.path.abspath(__file__))
    relative = os.path.relpath(os.path.abspath(path), root)
    command = (f"python {relative}" if os.sep not in relative
               else f"python -m {relative[:-3].replace(os.sep, '.')}")
    free = f" [{positional}]" if positional else ""
    out = [f"usage: {command}{free} [config.py ...] [--key=value ...] [--quiet] [--help]", ""]
    if doc:
        out += [doc.strip(), ""]
    out += ["settings (--key=default  # what it is), as the script groups them:", ""]
    out += settings(path, {k: v for k, v in defaults.items() if not constant(k)})
    model_type = ""
    for arg in argv:
        if arg.startswith("--model_type="):
            model_type = arg.partition("=")[2]
        elif arg.endswith(".py") and os.path.isfile(arg) and "model_type" in defaults:
            model_type = read_config_file(arg).get("model_type", model_type)
    if model_type:
        from nanolatent import models
        module = models.import_model(model_type)
        fields = {f.name: f.default for f in dataclasses.fields(module.Config) if f.init}
        out += ["", f"model_{model_type}.py's Config fields, set like the settings above (--{next(iter(fields))}=...):",
                ""]
        out += settings(module.__file__, fields, scope="Config")
    elif "model_type" in defaults:
        out += ["", f"--model_type=X --help also lists model_X.py's Config fields (X: {', '.join(model_types())})"]
    return "\n".join(out)


def written_settings(path):
    """What --help needs of a script, from its source without running it: (docstring, {key: default} of the names it
    assigns above its configurator.apply(globals(), ...) call, the call's positional) or None where it makes no such
    call. A default is its literal, or Written where code computes it."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    call = next((node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) ==
                 "configurator.apply" and node.args and ast.unparse(node.args[0]) == "globals()"), None)
    if call is None:
        return None
    positional = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "positional"), None)
    defaults, stack = {}, [node for node in tree.body if node.lineno < call.lineno]
    while stack:  # in the file's order, into `if __name__ == "__main__":` and the like, never into a function
        node = stack.pop(0)
        if isinstance(node, (ast.If, ast.With, ast.Try)):
            stack[:0] = [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt) and n.lineno < call.lineno]
            continue
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = ([(target, node.value)] if isinstance(target, ast.Name) else
                     list(zip(target.elts, node.value.elts)) if isinstance(target, ast.Tuple) and
                     isinstance(node.value, ast.Tuple) else [])
            for name, value in pairs:
                if not isinstance(name, ast.Name) or name.id.startswith("_") or name.id != name.id.lower():
                    continue  # private, or an upper-case constant: not a setting (apply's rule)
                try:
                    default = ast.literal_eval(value)
                except ValueError:
                    default = Written(ast.get_source_segment(source, value))
                if isinstance(default, (*TYPES, Written)):
                    defaults[name.id] = default
    return ast.get_docstring(tree, clean=False), defaults, positional


def answer_help_first():
    """`python script.py --help` (or -h) alone: its usage from the script's source, and exit, at this module's import
    by the script (its first import), so that torch is never loaded for it."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if sys.argv[1:] not in (["--help"], ["-h"]) or not path or not path.endswith(".py") or not os.path.isfile(path):
        return
    written = written_settings(path)
    if written is not None:
        doc, defaults, positional = written
        print(usage(path, doc, defaults, [], positional))
        raise SystemExit(0)


def apply(namespace, argv=None, model_fields=None, positional=None):
    """configure() on the caller's module globals (their lower-case int/float/bool/str/tuple names: an upper-case
    name is a constant, never a setting), which it updates.
    Returns (config, model values): config is every script value after overrides, as a checkpoint records it. The
    defaults are those the module had at its first call, so a main() called twice (in tests) starts afresh."""
    if "_config_defaults" not in namespace:
        namespace["_config_defaults"] = {k: v for k, v in namespace.items() if not k.startswith("_")
                                         and k == k.lower() and isinstance(v, TYPES)}
    defaults = namespace["_config_defaults"]
    argv = sys.argv[1:] if argv is None else argv
    if "--quiet" in argv:  # no progress lines, in this process and in those it starts (they inherit the variable)
        argv = [arg for arg in argv if arg != "--quiet"]
        from nanolatent import common
        os.environ[common.PROGRESS_ENV] = "off"
    if "--help" in argv or "-h" in argv:
        print(usage(namespace["__file__"], namespace.get("__doc__"), defaults, argv, positional))
        raise SystemExit(0)
    namespace["_config_given"] = set()
    config, model_values = configure(defaults, argv, model_fields, positional, namespace["_config_given"])
    namespace.update(config)
    return config, model_values


def given(namespace):
    """The keys a config file or the command line set (to any value, the default's included), after apply()."""
    return namespace["_config_given"]


def require(config, positive=(), non_negative=(), choices=None, within=None):
    """Refuse values that parse but make no sense (--max_iters=-5, --eval_interval=0, --dtype=float64, --beta1=1.5,
    learning_rate=float('nan') or max_iters = 10**400 in a config file), one line each. within: {key: interval}
    written as in mathematics, "[0, 1)" or "(0, 1]"."""
    for key, value in config.items():
        if isinstance(value, float) and math.isnan(value):
            die(f"--{key} is nan: give a number")
        if isinstance(value, int) and abs(value) >= 2**63:  # 10**400 in a config file: no tensor or float holds it
            die(f"--{key} is a number of {value.bit_length()} bits: give one below 2**63")
    for key in positive:
        if not config[key] > 0 or config[key] == math.inf:
            die(f"--{key} must be > 0, got {config[key]!r}")
    for key in non_negative:
        if not config[key] >= 0 or config[key] == math.inf:
            die(f"--{key} must be >= 0, got {config[key]!r}")
    for key, allowed in (choices or {}).items():
        if config[key] not in allowed:
            die(f"--{key} must be one of {', '.join(map(str, allowed))}, got {config[key]!r}")
    for key, interval in (within or {}).items():
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        value = config[key]
        above = value > lo if interval[0] == "(" else value >= lo
        below = value < hi if interval[-1] == ")" else value <= hi
        if not (above and below):
            die(f"--{key} must lie in {interval}, got {value!r}")


answer_help_first()

if __name__ == "__main__":  # a module the scripts import, with no settings of its own: say so, not nothing
    told = ("configurator.py is not run directly: each script reads its settings through it, and `python train.py "
            "--help` (or sample.py, evaluate.py, prepare.py) lists that script's")
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(told)
    else:
        die(told)

