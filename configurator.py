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
"""

import ast
import difflib
import math
import os
import sys
import types

from nanolatent import common

TYPES = (int, float, bool, str, tuple)  # what a default may be


def read_config_file(path):
    """Top-level assignments of a Python config file, one line on stderr for anything wrong with it."""
    if not os.path.isfile(path):
        common.die(f"config file {path!r} {'is a directory' if os.path.isdir(path) else 'not found'} (arguments are "
                   f"config files ending in .py, or --key=value)")
    namespace = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), namespace)
    except SyntaxError as e:
        common.die(f"config file {path} line {e.lineno}: {e.msg}")
    except SystemExit as e:  # an exit would end the run there, silently, with the exit's code
        common.die(f"config file {path} called sys.exit({e.code!r}): a config file only assigns values")
    except Exception as e:
        common.die(f"config file {path} failed: {type(e).__name__}: {e}")
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
    tuple's elements must have the type of the default's first element. source: the config file that set it."""
    if default is None or value is None:
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, tuple) and isinstance(value, (list, tuple)):
        return tuple(check(key, v, default[0], source) for v in value) if default else tuple(value)
    if type(value) is not type(default):
        where = f"{key} = {value!r} in config file {source}: " if source else ""
        common.die(f"{where}--{key} expects a {type(default).__name__} (default {default!r}), got {value!r} "
                   f"of type {type(value).__name__}")
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
                common.die(f"argument {arg!r} has no value: write --{key}=VALUE")
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
            common.die(f"one {positional} at a time, got {' '.join(free)}")
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
            common.die(f"unknown config key {key!r}{where}{hint}; known keys: {', '.join(sorted(defaults))}"
                       + (f", and the model's Config fields: {', '.join(sorted(fields))}" if fields else ""))
        model_values[key] = (parse(key, cli_texts[key], fields[key]) if key in cli_texts
                             else check(key, file_values[key], fields[key], sources[key]))
    return values, model_values


def apply(namespace, argv=None, model_fields=None, positional=None):
    """configure() on the caller's module globals (their public int/float/bool/str/tuple names), which it updates.
    Returns (config, model values): config is every script value after overrides, as a checkpoint records it. The
    defaults are those the module had at its first call, so a main() called twice (in tests) starts afresh."""
    if "_config_defaults" not in namespace:
        namespace["_config_defaults"] = {k: v for k, v in namespace.items() if not k.startswith("_")
                                         and isinstance(v, TYPES)}
    defaults = namespace["_config_defaults"]
    namespace["_config_given"] = set()
    config, model_values = configure(defaults, sys.argv[1:] if argv is None else argv, model_fields, positional,
                                     namespace["_config_given"])
    namespace.update(config)
    return config, model_values


def given(namespace):
    """The keys a config file or the command line set (to any value, the default's included), after apply()."""
    return namespace["_config_given"]


def require(config, positive=(), non_negative=(), choices=None, within=None):
    """Refuse values that parse but make no sense (--max_iters=-5, --eval_interval=0, --dtype=float64, --beta1=1.5,
    learning_rate=float('nan') in a config file), one line each. within: {key: interval} written as in mathematics,
    "[0, 1)" or "(0, 1]"."""
    for key, value in config.items():
        if isinstance(value, float) and math.isnan(value):
            common.die(f"--{key} is nan: give a number")
    for key in positive:
        if not config[key] > 0 or config[key] == math.inf:
            common.die(f"--{key} must be > 0, got {config[key]!r}")
    for key in non_negative:
        if not config[key] >= 0 or config[key] == math.inf:
            common.die(f"--{key} must be >= 0, got {config[key]!r}")
    for key, allowed in (choices or {}).items():
        if config[key] not in allowed:
            common.die(f"--{key} must be one of {', '.join(map(str, allowed))}, got {config[key]!r}")
    for key, interval in (within or {}).items():
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        value = config[key]
        above = value > lo if interval[0] == "(" else value >= lo
        below = value < hi if interval[-1] == ")" else value <= hi
        if not (above and below):
            common.die(f"--{key} must lie in {interval}, got {value!r}")
