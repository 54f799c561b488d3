"""CPU speed, applied from outside the model files: oneDNN's matrix kernels for training, weight layouts for
inference, RMSNorm's backward in closed form, and malloc's thresholds. The model files stay plain
PyTorch; the scripts call these on a CPU (as gpt-fast's quantize.py swaps nn.Linear and nanochat's fp8.py is switched
on by its training script). Each swap takes a module's place only after speedups.py's probe shows it computes what
that module's own forward computes, to float rounding (tests/test_cpu.py, test_speedups.py); BENCHMARKS.md has what
each gains."""

import collections
import contextlib
import ctypes
import functools

import torch
import torch.nn.functional as F

from nanolatent import speedups

# oneDNN's float32 kernels where they were measured: x86 CPUs with AVX2 or AVX-512 (oneDNN also builds elsewhere)
ONEDNN_CPU = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def onednn_linear(x, weight, bias):
    """F.linear(x, weight, bias) by oneDNN, for a weight packed by inference_linears or a plain (out, in) one, also a
    strided view such as a transpose ("none": no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class LinearFunction(torch.autograd.Function):
    """F.linear for CPU training: the product x W^T and the input's gradient g W by oneDNN (the kernel of
    torch.compile's CPU weight prepacking), the weight's gradient g^T x by torch's GEMM (MKL), each product by the
    kernel that times faster on our CPU (scripts/bench_cpu.py --linears=True). The same values to float32 rounding."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)  # (..., out)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.size(-1))  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad, weight.t(), None)  # (..., in)
        if ctx.needs_input_grad[1]:
            grad_w = grad_2d.t().mm(x.reshape(-1, x.size(-1)))  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)  # (out,)
        return grad_x, grad_w, grad_b


class RMSNormFunction(torch.autograd.Function):
    """F.rms_norm's forward, op for op, with its backward in closed form: torch's CPU rms_norm is composite, so
    autograd goes back through each of its ops."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 at least, as F.rms_norm computes
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        x_hat = xf * rstd  # (..., C)
        ctx.save_for_backward(x_hat, weight, rstd)
        ctx.x_dtype = x.dtype
        return x_hat.type_as(x) * weight

    @staticmethod
    def backward(ctx, grad):
        # y = x_hat * w with x_hat = x * rstd: dx = rstd * (g_hat - x_hat * mean(g_hat * x_hat)) for g_hat = g * w.
        x_hat, weight, rstd = ctx.saved_tensors
        g_hat = (grad * weight).to(x_hat.dtype)
        prod = g_hat * x_hat  # (..., C), reused below for the gain's gradient
        dot = prod.mean(-1, keepdim=True)  # (..., 1)
        grad_w = torch.mul(grad, x_hat, out=prod).sum(tuple(range(grad.dim() - 1)))  # (C,)
        grad_x = g_hat.addcmul_(x_hat, dot, value=-1).mul_(rstd)
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), None


def training_linear(m, own, x):
    """An nn.Linear's forward in CPU training: float32 with gradients through LinearFunction, the rest its own."""
    if x.dtype == torch.float32 and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
        return LinearFunction.apply(x, m.weight, m.bias)
    return own(x)  # inference and autocast: torch's own kernels


def training_rms_norm(m, own, x):
    """A norm's forward in CPU training: RMSNormFunction with gradients, the rest its own."""
    return RMSNormFunction.apply(x, m.weight, m.eps) if torch.is_grad_enabled() else own(x)


def probe_input(m, features):
    """A probe for a module of `features` inputs, in its weight's dtype and device: (2, 3, features), N(0, 4)."""
    w = m.weight
    return (2 * torch.randn(2, 3, features, generator=torch.Generator().manual_seed(1), dtype=torch.float64)).to(
        w.device, w.dtype)


def training_kernels(model, log=print):
    """The CPU training kernels, in place, under speedups' rule: every nn.Linear (and subclass) whose forward a probe
    shows is F.linear gets LinearFunction's products (float32 with gradients, on an x86 CPU with oneDNN's AVX2/AVX-512
    kernels); every module with a one-dimensional gain `weight`, an `eps` and a forward(x) that a probe shows is
    F.rms_norm gets RMSNormFunction's closed-form backward. A module whose forward computes otherwise (B-Trans's
    BayesianBiasNorm, an edited norm, a LoRA) keeps it. Parameters and state dict are untouched; eager only (train.py
    leaves a compiled model to inductor)."""
    modules = list(model.named_modules())
    if ONEDNN_CPU:
        linears = [(n, m) for n, m in modules if isinstance(m, torch.nn.Linear)]
        speedups.swap("cpu.training_kernels (oneDNN linears)", linears, "forward",
                      lambda m, own: functools.partial(training_linear, m, own),
                      lambda m: [(probe_input(m, m.in_features),)], train=True, log=log)
    norms = [(n, m) for n, m in modules if isinstance(getattr(m, "weight", None), torch.nn.Parameter)
             and m.weight.dim() == 1 and isinstance(getattr(m, "eps", None), float) and not list(m.children())]
    speedups.swap("cpu.training_kernels (RMSNorm backward)", norms, "forward",
                  lambda m, own: functools.partial(training_rms_norm, m, own),
                  lambda m: [(probe_input(m, m.weight.numel()),)], train=True, log=log)
    return model


def laid_out(weight, dtype, vector):
    """An (out, in) weight laid out for inference_linears' product: column-major where out > in for vector (one
    sequence, one thread), else oneDNN's blocked layout."""
    w = weight.detach().to(dtype)
    if vector:
        return w.t().contiguous().t() if w.size(0) > w.size(1) else w
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def inference_linear(product, weight, bias, dtype, x):
    return product(x if x.dtype == dtype else x.to(dtype), weight, bias)


@contextlib.contextmanager
def inference_linears(model, dtype=torch.float32, batch_size=None, min_weights=2**16, log=print):
    """CPU inference with every nn.Linear of `model` multiplying by its weight laid out for the product, instead of
    torch's default GEMM on the (out, in) weight, which at these shapes is slower (BENCHMARKS.md, Linear layouts):
    - by default oneDNN's blocked layout (torch.ops.mkldnn, what torch.compile's CPU weight prepacking uses);
    - batch_size=1 (one sequence decoded) on one thread, in float32: every decode step is a matrix-vector product,
      which MKL's GEMM streams fastest along the weight's longer side, so a weight with out > in is stored
      transposed (column-major, still (out, in) to F.linear) and the others stay as they are. oneDNN's blocked
      layout is the faster one there with two threads, or from two rows on; the prompt's prefill, many rows, takes
      the GEMM's speed on the plain weight.
    A Linear of fewer than `min_weights` weights keeps its own forward: a call into oneDNN costs about 10 us more
    than F.linear's, which so small a product does not win back (at the quick start's shapes oneDNN takes 1.8-2.7x
    F.linear's time). Under speedups' rule, a Linear's laid-out product takes its place on entering only where a
    probe shows it computes what the module's own forward computes (both under autocast to `dtype` where that is not
    the weight's): a subclass with its own forward, or a patched one, keeps it. Results equal F.linear's to float
    rounding (another summation order), not bit for bit. A swapped module's plain weight is released unless another
    module shares it (a tied head): inside, the new copy is the weight, so memory stays that of the model. Inference
    only: no gradients flow through, and a swapped Linear's weight and bias must not be read or changed inside. On
    leaving, every module is as before, bit for bit (each layout is a permutation). On a GPU, for weights in neither
    float32 nor `dtype`, or without oneDNN, nothing changes.

    dtype: what the forwards inside run in. bfloat16 weights (sample.py --dtype=bfloat16) are packed as they are.
    float32 weights under bfloat16 (evaluate.py --dtype's autocast) get packed bfloat16 copies and their inputs cast
    to it, as autocast does for F.linear (faster than autocast's own products where the CPU has bfloat16
    instructions: BENCHMARKS.md); the float32 weights stay, so that leaving restores them bit for bit, and memory is
    1.5x the model's. float16 (oneDNN has no float16 inner product on CPUs without AVX512-FP16 or AMX-FP16), or
    bfloat16 where oneDNN lacks it, changes nothing: autocast's own kernels do the products."""
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m.weight.numel() >= min_weights]
    supported = {torch.float32: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    if not (torch.backends.mkldnn.is_available() and linears and supported.get(dtype, False) and all(
            m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, dtype) for _, m in linears)):
        yield model
        return
    vector = batch_size == 1 and dtype == torch.float32 and torch.get_num_threads() == 1

    def fast(m, own):
        bias = None if m.bias is None else m.bias.detach().to(dtype)
        return functools.partial(inference_linear, F.linear if vector else onednn_linear,
                                 laid_out(m.weight, dtype, vector), bias, dtype)

    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    released = []  # (module, its laid-out weight), to restore the plain weight from on leaving

    def first_call(m, x):  # laid out (again, for a probed module), and the plain weight released: the model's memory
        m.forward = fast(m, None)
        m.forward.speedup = "cpu.inference_linears"
        # Nothing else reads the plain weight (a Linear never called, like Free's post_sampler whose weight Free reads
        # directly, or a tied embedding keeps it): release it
        if uses[id(m.weight)] == 1 and m.weight.dtype == dtype:
            released.append((m, m.forward.args[1]))
            m.weight.data = m.weight.data.new_empty(0)
        return m.forward(x)

    # the module's own forward as the run computes it: under autocast to dtype where the weights are not in it
    context = (lambda: torch.autocast("cpu", dtype=dtype)) if linears[0][1].weight.dtype != dtype else None
    swapped = speedups.swap("cpu.inference_linears", linears, "forward", fast,
                            lambda m: [(probe_input(m, m.in_features),)], train=False, log=log, dtype=dtype,
                            context=context, install=lambda m, own: functools.partial(first_call, m))
    try:
        yield model
    finally:
        speedups.restore(swapped)
        for m, w in released:
            m.weight.data = w.contiguous() if vector else w.to_dense()


def keep_freed_memory():
    """Keep the memory of freed tensors in the process, for the next training step to reuse (glibc, Linux). glibc's
    malloc returns large freed blocks to the kernel (unmapping them, trimming the heap's top) by thresholds it adapts
    as it runs; a step that frees its activations and allocates them again then faults on their pages, every step
    (BENCHMARKS.md counts them). Fixed thresholds of 1 GiB keep freed blocks for reuse, as the jemalloc or tcmalloc
    PyTorch's CPU tuning guide recommends do; the resident memory then stays at its peak between steps.
    -> True when glibc took both settings; False elsewhere (macOS, Windows, musl), where nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return [mallopt(param, 1 << 30) for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)] == [1, 1]
