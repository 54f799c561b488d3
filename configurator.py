"""Overrides a script's module-level defaults from Python config files and --key=value arguments (nanoGPT's
configurator, made strict: an unknown key or a value of the wrong type is one clear error and exit code 2).

    python train.py config/free_synthetic.py --batch_size=32 --kappa_bits=0.5

Config files are plain Python: every top-level name they assign becomes an override. Values on the command line are
parsed with ast.literal_eval (so --compile=False is a bool and --start=hello a string). Keys that are fields of the
chosen model's Config dataclass (n_layer, sigma, kappa_bits, ...) are accepted too and returned separately.
"""

import ast
import difflib
import sys


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv):
    """Split argv into config-file overrides and command-line overrides, in order of precedence."""
    file_values, cli_values = {}, {}
    for arg in argv:
        if not arg.startswith("--"):
            namespace = {}
            try:
                with open(arg) as f:
                    exec(f.read(), namespace)
            except FileNotFoundError:
                fail(f"config file {arg!r} not found (arguments are config files or --key=value)")
            file_values.update({k: v for k, v in namespace.items()
                                if not k.startswith("_") and not callable(v) and type(v).__name__ != "module"})
        else:
            key, sep, text = arg[2:].partition("=")
            if not sep:
                fail(f"argument {arg!r} has no value: write --{key}=VALUE")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare word is a string: --model=btrans
            cli_values[key] = value
    return file_values, cli_values


def check_type(key, value, default):
    """The value must have the default's type; an int may stand for a float; a None default takes anything."""
    if default is None or value is None:
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    if type(value) is not type(default):
        fail(f"--{key} expects a {type(default).__name__} (default {default!r}), got {value!r} "
             f"of type {type(value).__name__}")
    return value


def configure(defaults, argv, model_fields):
    """Returns (script_values, model_values). model_fields(values) -> {field: default} of the chosen model's Config,
    called with the script's values after overrides (so it can look at the model key)."""
    file_values, cli_values = parse_args(argv)
    overrides = {**file_values, **cli_values}
    script_values = dict(defaults)
    for key, value in overrides.items():
        if key in defaults:
            script_values[key] = check_type(key, value, defaults[key])
    fields = model_fields(script_values)
    model_values = {}
    for key, value in overrides.items():
        if key in defaults:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(defaults) + list(fields), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            fail(f"unknown config key {key!r}{hint}; known keys: {', '.join(sorted(defaults))}, "
                 f"and the model's Config fields: {', '.join(sorted(fields))}")
        model_values[key] = check_type(key, value, fields[key])
    return script_values, model_values
