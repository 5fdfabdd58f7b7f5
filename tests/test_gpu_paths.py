"""What a GPU runs by default, run on CPU processes (issue 46): every GPT stage trains 2 steps
compiled under bf16 autocast, with an evaluation and an 8-token sample, and 2 steps under fp16
with loss scaling; std in one process, the others in 2. A CPU cannot prove Triton's kernels, but
it runs the same tracing (TorchDynamo), the same graphs (AOTAutograd, DDP's buckets, FSDP2's and
DTensor's), and the same recompiles: each compiled run states how many it allows, counted from
PyTorch's own log of them (TORCH_LOGS=recompiles), whose lines say why when there are more.

The runs are as short as the stages allow: 2 blocks, 2 x 16-token microbatches, 1 evaluation
microbatch. This CPU computes bf16 and fp16 matmuls slowly, and a compile is most of a run's
time: the compiled runs share one Inductor cache, so a graph or kernel compiled once (std's and
ddp's are the same) is compiled once. That cache is the kit's default, a private folder in the
runs' HOME; meanwhile a co-tenant holds the folder Inductor would use by default,
/tmp/torchinductor_<user>, open to all (issue 47, item 4): no run may write there."""
import getpass
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import ONE_THREAD, kit_env, run_stage, session_folder, torchrun
from coursekit import KIT_ROOT, presets, runs
from coursekit.watchdog import FIRST_STEP_S, StepWatch
from helpers import forkserver

SHORT = ["--preset", "tiny", "--n-layer", "2", "--max-steps", "2", "--eval-interval", "2",
         "--eval-steps", "1", "--micro-batch", "2", "--seq-len", "16", "--batch-tokens", "64",
         "--sample-tokens", "8", "--device", "cpu"]
#: Each stage's own flags on 2 processes (std runs in 1; lit starts its second process itself).
#: lit shares 3 evaluation microbatches out over its 2 ranks: they must get whole ones each.
STAGE_FLAGS = {"std": [], "ddp": [], "fsdp": [], "tp": ["--tp", "2"], "pp": [],
               "lit": ["--devices", "2", "--eval-steps", "3"]}
#: Recompiles each compiled run may make, on any one rank: the evaluation's forward, which runs
#: without gradients (torch.no_grad, or Lightning's inference mode), is a graph of its own, compiled
#: once. The sample is drawn eagerly (training.write_sample), and the evaluation's batches are the
#: training's shape (in lit too: whole microbatches on every rank).
ALLOWED_RECOMPILES = {"std": 1, "ddp": 1, "fsdp": 1, "tp": 1, "pp": 1, "lit": 1}
#: fp16 on 2 processes: std's 1-process fp16 run is tests/test_stage_std.py's. pp scales the loss
#: in its schedule's loss_fn, which runs on the last stage only, and unscales on every stage.
FP16_STAGES = ["ddp", "fsdp", "tp", "pp", "lit"]
RECOMPILE = re.compile(r"^(?:\[rank(\d+)\]:)?.*Recompiling function (.*)$", re.MULTILINE)


def run_env(extra=None):
    """The runs' environment: one thread, and ``extra`` (a variable set to None is left out)."""
    return {name: value for name, value in kit_env({**ONE_THREAD, **(extra or {})}).items()
            if value is not None}


def train(stage, data, out, *flags, env=None, server=None):
    """2 steps of ``stage`` into ``out`` with ``flags`` and ``env`` (run_env's ``extra``),
    forked from ``server`` (conftest's FORK_SERVER if None): the CompletedProcess (text)."""
    args = [*SHORT, *STAGE_FLAGS[stage], *flags, "--data", data, "--out", out]
    env = run_env(env)
    if stage in ("std", "lit"):
        result = run_stage(f"train_gpt2_{stage}.py", *args, env=env, server=server)
    else:
        result = torchrun(2, KIT_ROOT / "solutions" / f"train_gpt2_{stage}.py", *args, env=env,
                          server=server)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def assert_trained_and_sampled(run_dir):
    metrics = runs.read_metrics(run_dir)
    assert [record["step"] for record in metrics] == [1, 2]
    assert all(math.isfinite(record["loss"]) for record in metrics), metrics
    # an untrained model's loss, about ln(vocabulary): the true loss, not fp16's scaled one
    chance = math.log(presets.get_preset("tiny").vocab_size)
    assert all(abs(record[key] - chance) < 1 for record in metrics
               for key in ("loss", "val_loss") if key in record), metrics
    assert math.isfinite(metrics[-1]["val_loss"]), metrics
    assert (run_dir / "sample.txt").read_text().startswith("The")


def recompiles_per_rank(output):
    """{rank: [the functions compiled again, one entry per recompile]} from TORCH_LOGS output."""
    found = {}
    for rank, function in RECOMPILE.findall(output):
        found.setdefault(int(rank or 0), []).append(function)
    return found


@pytest.fixture(scope="module")
def compile_home(tmp_path_factory):
    """The compiled runs' HOME: its ~/.cache holds their one Inductor cache (coursekit.caches)."""
    return session_folder(tmp_path_factory, "compile-home")


@pytest.fixture(scope="module")
def compiled(compile_home):
    """What the compiled runs add to run_env: TorchDynamo's log of recompiles; one compile
    thread: no pool of compile workers (each a Python importing torch) beside every rank on the
    2 cores, the graphs and kernels the same; Inductor's CPU kernels in plain C++, not vectorised
    (GPUs run Triton's instead): the same graphs, lowering, recompiles and caches, and a third
    less of g++ (std's run: 44 CPU-seconds, 28 without vectors); the kit's default cache, in
    compile_home. TorchDynamo reads some when imported, so the runs are forked from a fork
    server of their own, started in this environment. (Not with Inductor imported: its codecache
    fixes its folder for C++ headers when imported, which a run sets first: coursekit.caches.)"""
    extra = {"TORCH_LOGS": "recompiles,torch._dynamo.backends.distributed",
             "TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "0",
             "HOME": str(compile_home), "TORCHINDUCTOR_CACHE_DIR": None,
             "TRITON_CACHE_DIR": None}
    server = forkserver.Server(lambda: run_env(extra))
    yield extra, server
    server.stop()


@pytest.fixture(scope="module")
def squatted_cache(cotenant):
    """/tmp/torchinductor_<user>, created first by a co-tenant, mode 0777, as a trap."""
    folder = Path("/tmp") / f"torchinductor_{getpass.getuser()}"
    shutil.rmtree(folder, ignore_errors=True)
    cotenant.run("mkdir", "-m", "777", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.stages
@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGE_FLAGS))
def test_compiled_bf16_trains_evaluates_and_samples_within_its_recompiles(
        stage, builtin_data, tmp_path, compile_home, compiled, squatted_cache):
    extra, server = compiled
    result = train(stage, builtin_data, tmp_path, "--precision", "bf16", "--compile", env=extra,
                   server=server)
    assert not any(squatted_cache.iterdir())  # the co-tenant's folder: nothing written there
    assert any((compile_home / ".cache" / "coursekit" / "torch-compile").iterdir())
    assert runs.read_json(tmp_path / "config.json")["precision"] == "bf16 autocast"
    assert_trained_and_sampled(tmp_path)
    output = result.stdout + result.stderr
    recompiles = recompiles_per_rank(output)
    assert max(map(len, recompiles.values()), default=0) <= ALLOWED_RECOMPILES[stage], \
        "\n".join(line for line in output.splitlines() if "__recompiles" in line)
    if stage in ("ddp", "lit"):  # compiled inside DDP's forward: the graph split at its buckets
        assert "DDPOptimizer used bucket cap" in output


@pytest.mark.stages
@pytest.mark.slow
@pytest.mark.parametrize("stage", FP16_STAGES)
def test_fp16_scales_the_loss_trains_evaluates_and_samples(stage, builtin_data, tmp_path):
    train(stage, builtin_data, tmp_path, "--precision", "fp16")
    assert runs.read_json(tmp_path / "config.json")["precision"] == \
        "fp16 autocast, loss scaling"
    assert_trained_and_sampled(tmp_path)


@pytest.mark.unit
def test_the_first_step_which_compiles_has_its_own_watchdog_allowance(tmp_path, monkeypatch):
    """A first step longer than KIT_WATCHDOG writes no stacks; a later one does."""
    monkeypatch.setenv("KIT_WATCHDOG", "0.2")
    watch = StepWatch(tmp_path, 0, torch.nn.Linear(1, 1))
    stacks = tmp_path / "ranks" / "0.stacks"
    time.sleep(1)  # the first step, compiling
    assert watch.allowed_s() == FIRST_STEP_S and not stacks.exists()
    watch.step_done(1, time.perf_counter() - 1)
    time.sleep(1)  # the second step, hung
    assert watch.allowed_s() == 0.2
    assert stacks.read_text().startswith("--- no step ended within 0.2 s after step 1 ---")
