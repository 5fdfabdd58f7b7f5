"""Performance arithmetic: FLOPs per token, peak FLOP/s of a device, model FLOPs utilisation (MFU).

MFU = (tokens per second x FLOPs per token) / peak FLOP/s of the device. It says how much of the
hardware's arithmetic the training really uses; 30-50% is good for a GPT on modern GPUs.
"""
import ctypes
import os
import re
import sys
import time
from pathlib import Path

import torch

# Dense (no sparsity) peak FLOP/s of the 16-bit tensor cores, per device as torch sees it: bf16
# and fp16 run at the same rate on every part listed, except those in FP16_ONLY, which have no bf16
# units. fp32 training has no entry (its peak depends on TF32 and is measured). Vendor datasheets;
# an AMD MI250X shows up as two devices (GCDs), so its entry is half of the card's 383 TFLOP/s. An
# entry matches whole words of the name torch.cuda.get_device_name gives ("NVIDIA H100 NVL",
# "Tesla V100-SXM2-32GB"), and the most specific entry wins: "H100 NVL" over "H100", and "L4"
# never matches an L40. GeForce cards accumulate 16-bit products in fp32 (as PyTorch's matmuls
# do) at half their fp16-accumulate rate: their entries are the fp32-accumulate figures of
# NVIDIA's Ampere GA102 and Ada whitepapers (RTX 3090 71 of 142, RTX 4090 165 of 330 TFLOP/s).
# Workstation and data-centre cards accumulate in fp32 at the full rate.
PEAK_FLOPS = {
    "B200": 2250e12,  # HGX B200's datasheet, per GPU
    "H200": 989e12,
    "GH200": 989e12,
    "H100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,  # an H100 SXM with less NVLink bandwidth
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A40": 150e12,
    "A10": 125e12,
    "A30": 165e12,
    "RTX A6000": 154.8e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "T4": 65e12,
    "MI300X": 1307e12,
    "MI250X": 191.5e12,
    "MI250": 181e12,
    "MI210": 181e12,
}
FP16_ONLY = {"V100", "T4"}


def matmul_params(n_layer, n_embd, vocab_size):
    """Weights that take part in matrix multiplications, per token.

    Per block: attention qkv (3 d^2) + output projection (d^2) + MLP up (4 d^2) + down (4 d^2)
    = 12 d^2; plus the language-model head (V d). Position embeddings, biases and LayerNorms are
    look-ups or element-wise and left out.
    """
    return n_layer * 12 * n_embd**2 + vocab_size * n_embd


def flops_per_token(n_layer, n_embd, seq_len, vocab_size):
    """Training FLOPs per token (forward + backward), the PaLM paper's 6N + 12 L T d.

    6N: each weight does a multiply-add (2 FLOPs) in the forward pass and twice that in the
    backward pass (gradients for inputs and for weights). 12 L T d: attention's two T x T products
    (scores Q K^T and their weighted sum of V) cost 2 T d each per token and layer in the forward
    pass, tripled for the backward pass. The causal mask halves the useful work, but the usual
    convention (and flash attention's cost) counts the full square.
    """
    return 6 * matmul_params(n_layer, n_embd, vocab_size) + 12 * n_layer * seq_len * n_embd


def words(name):
    """A device name's words, lower case: "Tesla V100-SXM2-32GB" -> ["tesla", "v100", "sxm2", "32gb"]."""
    return re.findall(r"[a-z0-9]+", name.lower())


def table_peak_flops(device_name, dtype=torch.bfloat16):
    """Peak FLOP/s from the table for a device name and the dtype its matmuls run in, or None if
    it is not listed: the entry with the most words among those whose words appear in the name,
    in a row."""
    name = words(device_name)
    found = [entry for entry in PEAK_FLOPS
             if any(name[i:i + len(words(entry))] == words(entry) for i in range(len(name)))]
    if not found or dtype not in (torch.bfloat16, torch.float16):
        return None
    entry = max(found, key=lambda entry: len(words(entry)))
    if dtype == torch.bfloat16 and entry in FP16_ONLY:
        return None
    return PEAK_FLOPS[entry]


_measured = {}
#: The side of the square matmul that measures a device's peak: large enough for a GPU's tensor
#: cores to run at full rate (a 1024^3 product leaves a B200 mostly idle, overstating MFU 1.5-3x).
#: On a CPU 1024^3 runs at the vector units' peak in fp32; 16-bit products, emulated on most CPUs
#: (a 1024^3 one took 2 to 7 s on a core here), reach their rate at 512^3 already.
PEAK_SQUARE = {"cuda": 8192, "xpu": 8192}
CPU_SQUARE = {torch.float32: 1024, torch.bfloat16: 512, torch.float16: 512}


def measure_matmul_flops(device, dtype=torch.float32, shapes=(), seconds=0.03, repeats=3):
    """Achieved FLOP/s of matmuls on ``device``: the practical peak of a CPU (or an accelerator
    the table does not know). The best of ``repeats`` timed runs of each shape: a large square
    and the model's own (m, k, n) ``shapes``, so that a busy moment lowers no figure but its own.

    A CPU's peak is one thread's rate times the threads torch computes with. One thread needs
    one free core to measure, where all threads need all of them: `make book` installs with pip
    on one of two cores while the first run measures, and a peak measured on a shared core made
    the printed MFU 210%. Measured once per device, dtype and shapes in a process."""
    device = torch.device(device)
    square = (CPU_SQUARE.get(dtype, 512) if device.type == "cpu"
              else PEAK_SQUARE.get(device.type, 8192))
    shapes = ((square, square, square), *shapes)
    key = (str(device), dtype, shapes)
    if key not in _measured:
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)
        try:
            best = max(_best_rate(device, dtype, shape, seconds, repeats) for shape in shapes)
        finally:
            torch.set_num_threads(threads)
        _measured[key] = best * (threads if device.type == "cpu" else 1)
    return _measured[key]


def _best_rate(device, dtype, shape, seconds, repeats):
    """The highest FLOP/s of ``repeats`` runs of about ``seconds`` each of one (m, k, n) product.
    A product slower than all of them together (bf16 on a CPU without bf16 units: seconds for a
    1024^3 product) is timed once."""
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    flops = 2 * m * k * n
    first = _time_products(device, a, b, 1)  # also the warm-up: thread pools, kernels, caches
    if first > seconds * repeats:
        return flops / first
    calls = max(1, round(seconds / first))
    return max(flops * calls / _time_products(device, a, b, calls) for _ in range(repeats))


def _time_products(device, a, b, calls):
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        a @ b
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device):
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return "cpu"


def peak_flops(device, dtype=torch.float32, shapes=()):
    """(peak FLOP/s, where the number comes from) for a device computing in ``dtype``: the
    datasheet table for known accelerators in 16-bit, a measured matmul otherwise (CPUs, unknown
    GPUs, fp32, bf16 where the hardware emulates it), at a large square and the model's (m, k, n)
    ``shapes`` (model_matmul_shape)."""
    name = device_name(device)
    flops = table_peak_flops(name, dtype) if torch.device(device).type != "cpu" else None
    if flops is not None:
        return flops, f"datasheet {str(dtype).removeprefix('torch.')} peak of {name}"
    return measure_matmul_flops(device, dtype, tuple(shapes)), f"measured {str(dtype).removeprefix('torch.')} " \
                                                 f"matmul on {name}"


def model_matmul_shape(tokens, n_embd):
    """The (m, k, n) of a GPT block's largest product on ``tokens`` tokens, the MLP's widening
    layer. (The output head's is larger still, but measuring it would cost a CPU process a
    second, and on the course's CPUs it runs at half the square's rate.)"""
    return tokens, n_embd, 4 * n_embd


def mfu(tokens_per_second, flops_per_token_, peak):
    """Model FLOPs utilisation as a fraction (0.41 = 41%)."""
    return tokens_per_second * flops_per_token_ / peak


def keep_freed_cpu_memory():
    """Stop glibc from handing large freed buffers back to the operating system.

    A training step on a CPU allocates and frees the same big tensors (the logits alone are
    B x T x 50304 floats) every microbatch. glibc serves each from fresh pages that the kernel must
    zero again: 40% of a tiny-preset step went to page faults on a 2-core VM. Keeping the freed
    memory is what the jemalloc/tcmalloc advice of PyTorch's CPU performance guide achieves.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    largest_int = 2**31 - 1  # mallopt takes a C int: keep up to 2 GiB of freed memory
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, largest_int))


def cpu_peak_estimate(cores=None, cpuinfo=Path("/proc/cpuinfo")):
    """Theoretical fp32 peak FLOP/s of this CPU: cores x clock x FLOPs per cycle per core.

    FLOPs per cycle from the vector units /proc/cpuinfo reports: two AVX-512 FMA units do
    2 x 16 lanes x 2 (multiply + add) = 64; two AVX2 FMA units 32; plain SSE about 8. Some CPUs
    have one AVX-512 unit, so this is an upper estimate. None where /proc/cpuinfo is missing.
    """
    if not cpuinfo.exists():
        return None
    fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    if "cpu MHz" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8
    cores = cores or len(os.sched_getaffinity(0))
    return cores * float(fields["cpu MHz"]) * 1e6 * per_cycle
