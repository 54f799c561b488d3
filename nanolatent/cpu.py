"""CPU speed, applied from outside the model files: oneDNN's matrix kernels for training, weight layouts for
inference, RMSNorm's backward in closed form, the thread count and malloc's thresholds. The model files stay plain
PyTorch; the scripts call these on a CPU (as gpt-fast's quantize.py swaps nn.Linear and nanochat's fp8.py is switched
on by its training script). Every swap computes what the plain module computes, to float rounding
(tests/test_cpu.py); BENCHMARKS.md has what each gains."""

import collections
import contextlib
import ctypes
import os
import types

import torch
import torch.nn.functional as F

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
        xf = x.float()  # float32 at least, as F.rms_norm computes
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        x_hat = xf * rstd  # (..., C)
        ctx.save_for_backward(x_hat, weight, rstd)
        ctx.x_dtype = x.dtype
        return x_hat.type_as(x) * weight

    @staticmethod
    def backward(ctx, grad):
        # y = x_hat * w with x_hat = x * rstd: dx = rstd * (g_hat - x_hat * mean(g_hat * x_hat)) for g_hat = g * w.
        x_hat, weight, rstd = ctx.saved_tensors
        g_hat = (grad * weight).float()
        prod = g_hat * x_hat  # (..., C), reused below for the gain's gradient
        dot = prod.mean(-1, keepdim=True)  # (..., 1)
        grad_w = torch.mul(grad, x_hat, out=prod).sum(tuple(range(grad.dim() - 1)))  # (C,)
        grad_x = g_hat.addcmul_(x_hat, dot, value=-1).mul_(rstd)
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), None


def _training_linear(self, x):
    if x.dtype == torch.float32 and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
        return LinearFunction.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)  # inference and autocast: torch's own kernels


def _training_rms_norm(self, x):
    if torch.is_grad_enabled():
        return RMSNormFunction.apply(x, self.weight, self.eps)
    return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def training_kernels(model):
    """Swap in the CPU training kernels, in place: every nn.Linear's products through LinearFunction (float32 with
    gradients, on an x86 CPU with oneDNN's AVX2/AVX-512 kernels), every RMSNorm's backward in closed form. A module
    whose class derives from RMSNorm (B-Trans's BayesianBiasNorm adds its offset in its own forward) keeps the plain
    norm. Parameters and state dict are untouched; eager only (train.py leaves a compiled model to inductor)."""
    for m in model.modules():
        if ONEDNN_CPU and isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(_training_linear, m)
        elif type(m).__name__ == "RMSNorm":
            m.forward = types.MethodType(_training_rms_norm, m)
    return model


@contextlib.contextmanager
def inference_linears(model, dtype=torch.float32, batch_size=None, min_weights=2**16):
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
    F.linear's time). Results equal F.linear's to float rounding (another summation order), not bit for bit. A weight is
    laid out at its module's first call and its plain copy released then unless another module shares it (a tied
    head): inside, the new copy is the weight, so memory stays that of the model. Inference only: no gradients flow
    through, and a called Linear's weight and bias must not be read or changed inside. On leaving, every module is
    as before, bit for bit (each layout is a permutation). On a GPU, for weights in neither float32 nor `dtype`, or
    without oneDNN, nothing changes.

    dtype: what the forwards inside run in. bfloat16 weights (sample.py --dtype=bfloat16) are packed as they are.
    float32 weights under bfloat16 (evaluate.py --dtype's autocast) get packed bfloat16 copies and their inputs cast
    to it, as autocast does for F.linear (faster than autocast's own products where the CPU has bfloat16
    instructions: BENCHMARKS.md); the float32 weights stay, so that leaving restores them bit for bit, and memory is
    1.5x the model's. float16 (oneDNN has no float16 inner product on CPUs without AVX512-FP16 or AMX-FP16), or
    bfloat16 where oneDNN lacks it, changes nothing: autocast's own kernels do the products."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= min_weights]
    supported = {torch.float32: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    if not (torch.backends.mkldnn.is_available() and linears and supported.get(dtype, False) and all(
            m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, dtype) for m in linears)):
        yield model
        return
    vector = batch_size == 1 and dtype == torch.float32 and torch.get_num_threads() == 1
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    released = []  # (module, its laid-out weight), to restore the plain weight from on leaving

    def first_call(m, x):  # lay the weight out, then call the product directly from the next call on
        w = m.weight.detach().to(dtype)
        if vector:  # (out, in) either way; column-major where out > in
            w = w.t().contiguous().t() if w.size(0) > w.size(1) else w
        else:  # (out, in), oneDNN's blocked layout
            w = torch.ops.mkldnn._reorder_linear_weight(w, None)
        # Nothing else reads the plain weight (a Linear never called, like Free's post_sampler, or a tied
        # embedding keeps it): release it
        if uses[id(m.weight)] == 1 and m.weight.dtype == dtype:
            m.weight.data = m.weight.data.new_empty(0)
            released.append((m, w))
        bias = None if m.bias is None else m.bias.detach().to(dtype)
        product = F.linear if vector else onednn_linear
        m.forward = lambda x: product(x if x.dtype == dtype else x.to(dtype), w, bias)
        return m.forward(x)

    for m in linears:
        m.forward = types.MethodType(first_call, m)
    try:
        yield model
    finally:
        for m in linears:
            del m.forward  # the class's forward again
        for m, w in released:
            m.weight.data = w.contiguous() if vector else w.to_dense()


def cpu_threads():
    """Threads for torch's CPU kernels. torch takes one per core, which on a machine shared with other work makes
    each thread wait for a core and the run several times slower (docs/training.md, Shared CPUs). Unless
    OMP_NUM_THREADS says otherwise: the cores not busy when the script starts, at least one."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    idle = cores - round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else cores
    threads = max(1, min(cores, idle))
    torch.set_num_threads(threads)
    return threads


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
