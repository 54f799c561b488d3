"""The rule for every speed-up applied from outside the model files: a fast forward takes a module's place only after a
probe, built from that module's own shapes and dtype, shows that it computes what the module's own forward computes
(outputs, and for training every input and parameter gradient). A module that fails keeps its own forward, and the
run says so in one line. Nothing is chosen by class name or source text: a comment changes nothing, and an edit that
changes what a module computes (a norm, an nn.Linear subclass, a prior) is what runs. docs/models.md, Changing a model.
"""

import contextlib
import inspect

import torch

KERNELS = ("fast", "plain")  # the scripts' --kernels: 'plain' runs every module's own forward, no speed-up anywhere
enabled = True

# How far a speed-up's outputs and gradients may be from the module's own, relative to the largest magnitude of the
# module's, by the probe's dtype: another summation order (measured: float32 1e-7, float64 1e-16), never another
# computation (a 1.0001 scale, a zero-initialised LoRA's gradient).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def use(kernels):
    """Set once by a script from its --kernels setting: 'fast' applies the speed-ups (each after its probe)."""
    global enabled
    enabled = kernels == "fast"


def flatten(out):
    """A forward's output as a flat list: tensors, Nones and other values, dicts by key (the keys too)."""
    if isinstance(out, dict):
        return [item for key in sorted(out) for item in (key, *flatten(out[key]))]
    if isinstance(out, (tuple, list)):
        return [item for o in out for item in flatten(o)]
    return [out]


def difference(ours, ref):
    """The largest difference of two flat outputs relative to ref's largest magnitude (inf: another structure)."""
    if len(ours) != len(ref):
        return float("inf")
    worst = 0.0
    for a, b in zip(ours, ref):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            worst = max(worst, 0.0 if type(a) is type(b) and a == b else float("inf"))
        elif a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        elif not a.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(a, b) else float("inf"))
        elif a.numel():  # largest magnitudes by one pass each, no copy of a large weight's gradient in float64
            norm = lambda t: max(-(m := torch.aminmax(t)).min.item(), m.max.item())
            gap = norm(a - b) / max(norm(b), 1e-30)
            worst = max(worst, gap if gap == gap else float("inf"))  # NaN: no match
    return worst


def run(forward, args, params, train):
    """forward(*args) on copies of args; with train also the gradients, with respect to every floating tensor argument
    and every parameter that takes one, of the outputs weighted by fixed random tensors (one for each)."""
    leaves = [a.detach().clone().requires_grad_(train and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
              for a in args]
    with torch.enable_grad() if train else torch.no_grad():
        out = flatten(forward(*leaves))
        if not train:
            return out
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(o.shape, generator=g, dtype=torch.float64) if isinstance(o, torch.Tensor)
                   and o.is_floating_point() else None for o in out]
        terms = [(o * w.to(o.device, o.dtype)).sum() for o, w in zip(out, weights) if w is not None and o.requires_grad]
        wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad] + [p for p in params
                                                                                         if p.requires_grad]
        grads = torch.autograd.grad(sum(terms), wrt, allow_unused=True, materialize_grads=True) if terms else \
            [torch.zeros_like(t) for t in wrt]
    return out + list(grads)


def probe(module, own, fast, args, train, tolerance, context):
    """The probe's verdict: (None, difference) when fast computes what own computes on args, else (reason,
    difference). The global generators are left as they were: a probe draws nothing a run would draw."""
    params = list(module.parameters())
    devices = [args[0].device] if isinstance(args[0], torch.Tensor) and args[0].device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), context():
            ref = run(own, args, params, train)
        with torch.random.fork_rng(devices=devices), context():
            ours = run(fast, args, params, train)
    except Exception as error:  # an edited forward the speed-up cannot stand for (another signature, other shapes)
        return f"the probe failed ({type(error).__name__}: {str(error)[:80]})", float("inf")
    gap = difference(ours, ref)
    return (None if gap <= tolerance else "it computes otherwise"), gap


def computation(m, attr, own):
    """What decides a module's computation apart from its parameters' values: its class, the function it runs, its
    parameters' and buffers' shapes and dtypes, and its attributes of plain values (eps, sizes, flags). Modules alike in
    all of these compute the same function of their parameters, so one probe answers for all of them."""
    function = own.__func__ if getattr(own, "__self__", None) is m else own  # a patched forward: its own object
    tensors = tuple((n, t.shape, t.dtype, t.requires_grad) for n, t in (*m.named_parameters(), *m.named_buffers()))
    plain = tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, type(None)))))
    alone = any(isinstance(v, torch.Tensor) for v in vars(m).values())  # a tensor not registered: probed on its own
    return type(m), attr, function, tensors, plain, repr(getattr(m, "config", None)), id(m) if alone else None


def swap(speedup, modules, attr, make, probes, train, log=print, dtype=None, context=None, install=None):
    """For each named module of `modules`, make(module, own) is the speed-up's stand-in for its `attr` (its forward,
    or EVE's bank), own being what it has; it takes that place where, on every argument tuple of probes(module), it
    computes what own computes to TOLERANCE (of the probe's dtype, or `dtype`'s), run inside context() if given (and,
    with train, its gradients too); install(module, own), if given, is what is put in place then, in make's stead. One
    probe stands for the modules of one computation(). Else the module keeps own, and one line for each kind of module
    says so. -> [(module, attr, own)]: the swapped modules and what they had, for restore()."""
    if not enabled:
        return []
    swapped, kept, verdicts = [], {}, {}
    for name, m in modules:
        own = getattr(m, attr)
        if getattr(own, "speedup", None) == speedup:
            continue  # applied already
        key = computation(m, attr, own)
        if key not in verdicts:
            verdicts[key] = verdict(m, attr, own, make, probes, train, dtype, context)
        reason, gap = verdicts[key]
        if reason:
            kept.setdefault((type(m).__name__, reason), []).append((name, gap))
            continue
        stand_in = (install or make)(m, own)
        stand_in.speedup = speedup
        setattr(m, attr, stand_in)
        swapped.append((m, attr, own))
    for (kind, reason), names in kept.items():
        if log:
            gaps = [g for _, g in names if g is not None]
            size = " ({:.1e} apart, tolerance {:.0e})".format(*max(gaps)) if gaps else ""
            who = f"{names[0][0] or 'the model'} ({kind})" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            one = len(names) == 1
            log(f"{speedup}: {who} keep{'s' if one else ''} {'its' if one else 'their'} own {attr}: {reason}{size}")
    return swapped


def verdict(m, attr, own, make, probes, train, dtype, context):
    """(None, 0) where make(m, own) computes what own computes on each of probes(m), else (why, (difference,
    tolerance) or None)."""
    positional = [p for p in inspect.signature(own).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    args_list = probes(m)
    covered = len(args_list[-1])
    if any(p.kind == p.VAR_POSITIONAL for p in positional) or len(positional) != covered:
        names = ", ".join(p.name for p in positional)
        return f"its {attr} takes ({names}), not the {covered} argument(s) the probe covers", None
    candidate = make(m, own)
    for args in args_list:
        tolerance = TOLERANCE.get(dtype or args[0].dtype, TOLERANCE[torch.float32])
        reason, gap = probe(m, own, candidate, args, train, tolerance, context or contextlib.nullcontext)
        if reason:
            return reason, None if gap == float("inf") else (gap, tolerance)
    return None, 0.0


def restore(swapped):
    """Undo swap(): each module's own `attr` again (an instance's own patch too)."""
    for m, attr, own in swapped:
        if getattr(own, "__self__", None) is m and getattr(type(m), attr, None) is getattr(own, "__func__", None):
            delattr(m, attr)  # the class's method: nothing of the instance's was there
        else:
            setattr(m, attr, own)
