"""FLOPs per token against PyTorch's own FLOP counter; peak tables; MFU arithmetic."""
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from coursekit import perf, presets, training
from solutions import gpt

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n_layer, n_embd, seq_len, vocab", [(2, 32, 64, 512), (3, 48, 16, 1000)])
def test_flops_per_token_matches_pytorchs_flop_counter(n_layer, n_embd, seq_len, vocab):
    model = gpt.GPT(gpt.GPTConfig(vocab_size=vocab, block_size=seq_len, n_layer=n_layer,
                                  n_head=4, n_embd=n_embd))
    x = torch.randint(0, vocab, (2, seq_len))
    # the math attention backend is made of matmuls the counter sees (fused kernels are opaque)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        gpt.cross_entropy(model(x), x).backward()
    assert counter.get_total_flops() / x.numel() == perf.flops_per_token(n_layer, n_embd, seq_len, vocab)


def test_gpt2_124m_flops_per_token():
    # 6 x 124M-ish matmul weights plus attention: the figure quoted for GPT-2 small (~0.85 GFLOP)
    assert perf.flops_per_token(12, 768, 1024, 50304) == pytest.approx(8.5e8, rel=0.02)


# Names as torch.cuda.get_device_name gives them, and each one's dense fp16 datasheet peak
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12, "NVIDIA GH200 480GB": 989e12, "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
    "NVIDIA L4": 121e12, "NVIDIA A40": 150e12, "NVIDIA A10": 125e12,
    "Tesla V100-SXM2-32GB": 125e12, "Tesla T4": 65e12, "NVIDIA GeForce RTX 4090": 165e12,
    "NVIDIA GeForce RTX 3090": 71e12, "NVIDIA B200": 2250e12, "NVIDIA H800": 989e12,
    "NVIDIA A30": 165e12, "NVIDIA RTX A6000": 154.8e12, "NVIDIA A10G": None,
    "AMD Instinct MI250X": 191.5e12, "AMD Instinct MI300X": 1307e12, "AMD Instinct MI210": 181e12,
}


@pytest.mark.parametrize("name, peak", DEVICE_NAMES.items())
def test_peak_table_matches_the_devices_own_names(name, peak):
    """Whole words, the most specific entry: an L40 is not an L4, an H100 NVL not an SXM H100,
    a GH200 not an H200 (even where their numbers agree)."""
    assert perf.table_peak_flops(name, torch.float16) == peak


@pytest.mark.parametrize("name, dtype, peak", [
    ("Tesla V100-SXM2-32GB", torch.float16, 125e12), ("Tesla T4", torch.float16, 65e12),
    ("Tesla V100-SXM2-32GB", torch.bfloat16, None),  # emulated: measured, not the datasheet's
    ("Tesla T4", torch.bfloat16, None),
    ("NVIDIA A100-SXM4-40GB", torch.float16, 312e12),  # as fast as bf16
    ("NVIDIA A100-SXM4-40GB", torch.float32, None),    # fp32 (TF32) is measured
])
def test_the_table_gives_the_peak_of_the_precision_the_matmuls_run_in(name, dtype, peak):
    assert perf.table_peak_flops(name, dtype) == peak


def test_a_device_not_in_the_table_has_no_table_peak():
    assert perf.table_peak_flops("Mystery Accelerator") is None
    assert perf.table_peak_flops("NVIDIA L4000") is None  # a word that only starts like one
    assert perf.table_peak_flops("NVIDIA H1000") is None


def test_cpu_peak_is_measured():
    flops, source = perf.peak_flops("cpu")
    assert 1e8 < flops < 1e14 and source.startswith("measured")


def test_mfu_arithmetic():
    # 100k tokens/s x 850 MFLOP/token = 85 TFLOP/s of 312 -> 27%
    assert perf.mfu(100_000, 8.5e8, 312e12) == pytest.approx(0.2724, abs=1e-4)


@pytest.mark.parametrize("flags, per_cycle", [("fpu sse2 avx avx2 fma avx512f", 64),
                                              ("fpu sse2 avx avx2 fma", 32), ("fpu sse2", 8)])
def test_cpu_peak_estimate_is_cores_times_clock_times_flops_per_cycle(tmp_path, flags, per_cycle):
    """Against the arithmetic done by hand for a 2.5 GHz CPU's /proc/cpuinfo."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\ncpu MHz\t\t: 2500.000\nflags\t\t: {flags}\n")
    assert perf.cpu_peak_estimate(4, cpuinfo) == 4 * 2.5e9 * per_cycle


def test_cpu_peak_estimate_bounds_the_measured_matmul():
    estimate = perf.cpu_peak_estimate()
    measured = perf.measure_matmul_flops("cpu")
    # An upper bound; the lower one only catches a unit slip (x1000): on a machine shared with
    # other jobs the matmul gets a small share of the cores (7% was seen under a load of 11).
    assert estimate is not None and 0.01 * estimate < measured < 1.2 * estimate


@pytest.mark.parametrize("precision, measured", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_a_device_the_table_does_not_know_is_measured_in_the_precision_it_trains_in(precision,
                                                                                    measured):
    """The run's peak (and so its MFU) for a device without a datasheet entry, here the CPU."""
    tiny = presets.get_preset("tiny")
    args = SimpleNamespace(stage="std", seq_len=tiny.seq_len, micro_batch=tiny.micro_batch)
    config = gpt.GPTConfig(vocab_size=tiny.vocab_size, block_size=tiny.seq_len,
                           n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=tiny.n_embd)
    cpu = torch.device("cpu")
    run = training.run_config(args, tiny, config, 1, cpu, training.prepare_device(cpu, precision))
    assert run["peak_source"] == f"measured {measured} matmul on cpu"
    model_shape = (tiny.micro_batch * tiny.seq_len, tiny.n_embd, 4 * tiny.n_embd)
    assert run["peak_flops"] == perf.measure_matmul_flops("cpu", getattr(torch, measured),
                                                          (model_shape,))
