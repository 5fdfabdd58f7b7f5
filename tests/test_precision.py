"""The precision a stage trains in: what each device's hardware computes fast, and the one-line
refusals. (fp16 with loss scaling really training: tests/test_stage_std.py; the peak FLOP/s of
each precision: tests/test_perf.py.)"""
import pytest
import torch

from coursekit import training

pytestmark = pytest.mark.unit

#: (device type, compute capability or AMD architecture as torch reports them, precision)
DEVICES = [
    ("cuda", (7, 0), "fp16"),    # V100: torch.cuda.is_bf16_supported() is True, by emulation
    ("cuda", (7, 5), "fp16"),    # T4, RTX 20xx
    ("cuda", (8, 0), "bf16"),    # A100
    ("cuda", (8, 6), "bf16"),    # A10, A40, RTX 30xx
    ("cuda", (8, 9), "bf16"),    # L4, L40, RTX 40xx
    ("cuda", (9, 0), "bf16"),    # H100, H200, GH200
    ("cuda", (10, 0), "bf16"),   # B200
    ("cuda", "gfx906:sramecc+:xnack-", "fp16"),  # MI50/MI60
    ("cuda", "gfx908:sramecc+:xnack-", "bf16"),  # MI100
    ("cuda", "gfx90a:sramecc+:xnack-", "bf16"),  # MI210/MI250X
    ("cuda", "gfx942:sramecc+:xnack-", "bf16"),  # MI300X
    ("cuda", "gfx1100", "bf16"),                 # RX 7900
    ("cuda", "gfx1030", "fp16"),                 # RX 6800
    ("xpu", None, "bf16"),
    ("cpu", None, "fp32"),
]


@pytest.mark.parametrize("device_type, hardware, precision", DEVICES)
def test_bf16_only_where_the_hardware_computes_in_it(device_type, hardware, precision):
    if isinstance(hardware, str):
        assert training.hardware_precision(device_type, amd_arch=hardware) == precision
    else:
        assert training.hardware_precision(device_type, capability=hardware) == precision


def test_this_machines_device_gets_its_hardware_precision():
    device = torch.device("cpu")
    assert training.prepare_device(device).name == training.device_precision(device) == "fp32"


@pytest.mark.parametrize("name, dtype, scaled, description", [
    ("bf16", torch.bfloat16, False, "bf16 autocast"),
    ("fp16", torch.float16, True, "fp16 autocast, loss scaling"),
    ("fp32", None, False, "fp32")])
def test_only_fp16_scales_the_loss(name, dtype, scaled, description):
    precision = training.prepare_device(torch.device("cpu"), name)
    assert (precision.dtype, precision.scaler.is_enabled(), precision.description) == \
        (dtype, scaled, description)
    with precision.autocast:
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == (dtype or torch.float32)


@pytest.mark.parametrize("name, factor", [("fp16", 2.0 ** 16), ("bf16", 1.0), ("fp32", 1.0)])
def test_a_pipelines_loss_fn_is_scaled_in_fp16_alone(name, factor):
    """A schedule runs backward on its loss_fn's loss: in fp16 that loss carries the scale."""
    precision = training.prepare_device(torch.device("cpu"), name)
    loss_fn = precision.scaled(lambda logits, targets: (logits - targets).square().mean())
    assert loss_fn(torch.full((2,), 3.0), torch.ones(2)).item() == 4.0 * factor


def test_forward_in_autocast_leaves_backward_outside_it():
    precision = training.prepare_device(torch.device("cpu"), "bf16")
    layer = torch.nn.Linear(4, 4)
    out = precision.in_autocast(layer.forward)(torch.ones(1, 4))
    assert out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    seen = []  # whether autocast is on while backward runs through the output's gradient
    out.register_hook(lambda grad: seen.append(torch.is_autocast_enabled("cpu")))
    out.float().sum().backward()
    assert seen == [False] and layer.weight.grad is not None


@pytest.mark.gpu
def test_the_loss_makes_no_fp32_copy_of_16_bit_logits():
    """The log-softmax reads bf16 logits and writes fp32 log-probabilities: 4 bytes a logit on
    top of the logits, where an fp32 copy first would take 8 (13 GB more for GPT-2 at B = 64)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from solutions import gpt
    logits = torch.randn(4, 1024, 50304, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50304, (4, 1024), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    gpt.cross_entropy(logits, targets)
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < 1.1 * logits.numel() * 4, grown / logits.numel()


@pytest.mark.gpu
def test_this_gpu_trains_in_the_format_its_hardware_computes_in():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda", 0)
    precision = training.prepare_device(device)
    if torch.version.hip:
        assert precision.name in ("bf16", "fp16")
    else:
        major, _ = torch.cuda.get_device_capability(device)
        assert precision.name == ("bf16" if major >= 8 else "fp16")
    with precision.autocast:
        product = torch.ones(64, 64, device=device) @ torch.ones(64, 64, device=device)
    assert product.dtype == precision.dtype


@pytest.mark.parametrize("device, cuda, flags, compiled", [
    ("cpu", False, [], False), ("cpu", False, ["--compile"], True),
    ("auto", False, [], False), ("auto", True, [], True), ("auto", True, ["--no-compile"], False),
    ("cpu", True, [], False),
])
def test_compile_is_on_by_default_only_on_gpus(builtin_data, tmp_path, monkeypatch, device, cuda,
                                               flags, compiled, own_compile_caches):
    """On a CPU the default is off (compiling costs more than it saves there); where CUDA runs
    the model (auto with a GPU in sight) it is on, and --no-compile turns it off. Here a GPU is
    in sight where torch.cuda.is_available() says so."""
    from coursekit import stages
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = stages.load("std").parse_args(["--preset", "tiny", "--device", device, "--data",
                                          str(builtin_data), "--out", str(tmp_path / "r"), *flags])
    assert args.compile is compiled
