"""The std stage as trainees run it: a real process on the builtin corpus."""
import math
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ONE_THREAD, QUARTER_STEP, TWENTY_STEPS, kit_env, run_python, run_stage,
                      stage_command, std_stdout)
from coursekit import runs, stages, training
from helpers import interrupt

pytestmark = pytest.mark.stages
SCRIPT = "train_gpt2_std.py"
STEP_LINE = re.compile(r"step (\d+)/(\d+) \| loss (\d+\.\d+) \| lr (\S+) \| grad_norm (\S+) \| "
                       r"(\S+) ms \| ([\d,]+) tok/s \| mfu (\S+)%")
LN_VOCAB = math.log(50304)
std = stages.load("std")


def test_tiny_loss_falls_below_60_percent_of_ln_vocab(base_run):
    out = base_run
    metrics = runs.read_metrics(out)
    assert [r["step"] for r in metrics] == list(range(1, 301))
    assert abs(metrics[0]["loss"] - LN_VOCAB) < 0.3  # an untrained model guesses uniformly
    final_val = metrics[-1]["val_loss"]
    assert final_val <= 0.6 * LN_VOCAB
    assert sum(r["loss"] for r in metrics[-20:]) / 20 <= 0.6 * LN_VOCAB


def test_the_mfu_of_every_step_is_a_fraction_of_the_measured_peak(base_run):
    """The run `make` trains while pip installs on the other core: a peak measured on a shared
    core made 151 of its steps print an MFU above 100%, up to 210%."""
    mfus = [record["mfu"] for record in runs.read_metrics(base_run)]
    above = [f"step {step}: {mfu:.0%}" for step, mfu in enumerate(mfus, 1) if not 0 < mfu <= 1]
    assert not above, f"{len(above)} of {len(mfus)} steps: {', '.join(above[:5])}"


def test_every_step_prints_one_parseable_line_matching_metrics(std_twenty_steps):
    out, stdout = std_twenty_steps, std_stdout(std_twenty_steps)
    lines = [STEP_LINE.match(line) for line in stdout.splitlines() if line.startswith("step ")]
    metrics = runs.read_metrics(out)
    assert len(lines) == len(metrics) == 20
    for match, record in zip(lines, metrics, strict=True):
        assert int(match[1]) == record["step"] and match[2] == "20"
        assert float(match[3]) == pytest.approx(record["loss"], abs=5e-5)
        assert float(match[8]) / 100 == pytest.approx(record["mfu"], abs=5e-4)
        assert record["tok_per_s"] > 0 and record["ms"] > 0


def test_terminology_identity_is_printed_and_recorded(std_twenty_steps):
    out, stdout = std_twenty_steps, std_stdout(std_twenty_steps)
    config = runs.read_json(out / "config.json")
    args = config["args"]
    assert args["micro_batch"] * config["grad_accum"] * args["seq_len"] == args["batch_tokens"]
    minibatch = args["micro_batch"] * config["grad_accum"]
    assert f"minibatch = {minibatch} samples = {args['batch_tokens']:,} tokens per step" in stdout
    assert (f"{args['max_steps']:,} steps x {args['batch_tokens']:,} tokens = "
            f"{args['max_steps'] * args['batch_tokens']:,} tokens") in stdout
    assert "microbatch = 4 samples | grad_accum = 2" in stdout


def test_the_full_run_ends_with_a_sample_from_the_prompt(base_run):
    assert (base_run / "sample.txt").read_text().startswith("The")


def test_checkpoint_is_safetensors_and_json_and_reproduces_the_model(base_run, builtin_data):
    out = base_run
    ckpt = runs.latest_checkpoint(out)
    assert ckpt.name == "step_00000300"
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]
    tensors = load_file(ckpt / "tensors.safetensors")  # no pickle: cannot run code
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())

    config = runs.read_json(out / "config.json")
    device = torch.device(config["device"])  # where it trained, with the precision it used there
    model = std.GPT(std.GPTConfig(**config["model"])).to(device)
    step, state = runs.load_checkpoint(out)
    model.load_state_dict(state["model"], strict=True)
    args = config["args"]
    val_loader = std.TokenShardLoader(builtin_data, "val", args["micro_batch"], args["seq_len"])
    val_loss = std.evaluate(model, val_loader, args["eval_steps"], device,
                            training.prepare_device(device))
    assert val_loss == pytest.approx(runs.read_metrics(out)[-1]["val_loss"], abs=1e-6)


# --- resume: interrupted runs continue exactly ------------------------------------------------
EXACT = ("step", "lr", "epoch")
REPORTED = ("loss", "grad_norm", "val_loss")
# Two identical multi-threaded CPU runs were seen to drift apart (1e-6 after a few steps, 1e-4 by
# step 11) when the machine was busy, while single-threaded runs agree bit for bit. The resume
# runs, and their reference (conftest's std_twenty_steps), use one thread so that any difference
# is the resume's fault.


@pytest.fixture(scope="module")
def reference_metrics(std_twenty_steps):
    return runs.read_metrics(std_twenty_steps)


def assert_same_run(metrics, reference):
    assert [{k: r.get(k) for k in EXACT} for r in metrics] == [{k: r.get(k) for k in EXACT} for r in reference]
    for got, expected in zip(metrics, reference, strict=True):
        for key in REPORTED:
            if expected.get(key) is None:  # validation runs on some steps only
                assert got.get(key) is None
            else:
                assert got.get(key) == expected[key], (got["step"], key)


def interrupt_at(step, how, command):
    """Start a run and deliver ``how`` as soon as it has printed the line of ``step``: long
    before the run could end (20 steps) or reach its next checkpoint."""
    process = interrupt.start(command, kit_env(ONE_THREAD))
    lines = interrupt.read_until(process, f"step {step}/")
    process.send_signal(how)
    return interrupt.finish(process, lines)


def test_both_signals_slurm_sends_before_a_stop_are_caught_alike():
    """SIGTERM (scontrol requeue, pre-emption) and SIGUSR1 (--signal) reach one handler: the run
    below stops on SIGUSR1, and the Slurm requeue test stops a real job with SIGTERM."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = training.StopSignal()
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == stop.handle
        # a process that stops because another one was signalled says so (not "None received")
        assert stop.stopped_line(7) == ("a stop signal to another process: checkpoint saved at "
                                        "step 7; rerun with --resume to continue")
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM"
        assert stop.stopped_line(7).startswith("SIGTERM received: checkpoint saved at step 7;")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# SIGKILL: no chance to save, so the run falls back to its checkpoint at step 10, two steps
# before the kill; the pre-emption signal is caught at step 5.
@pytest.mark.parametrize("how, ckpt_interval, at", [(signal.SIGUSR1, 1000, 5),
                                                    (signal.SIGKILL, 10, 12)],
                         ids=["SIGUSR1", "SIGKILL"])
def test_resume_after_interruption_is_identical(builtin_data, tmp_path, std_twenty_steps,
                                                reference_metrics, how, ckpt_interval, at):
    command = stage_command(SCRIPT, *TWENTY_STEPS, "--data", builtin_data, "--out", tmp_path,
                            "--ckpt-interval", ckpt_interval)
    returncode, output = interrupt_at(at, how, command)
    stopped_at = runs.read_metrics(tmp_path)[-1]["step"]
    if how == signal.SIGKILL:
        # the step line is printed before its metrics record is appended: a kill right after the
        # line can beat that write, never the one of the step before
        assert stopped_at >= at - 1
        assert returncode == -signal.SIGKILL and runs.load_checkpoint(tmp_path)[0] == 10
    else:  # the Slurm pre-emption signals: checkpoint, say so, exit 0 for the requeue
        assert stopped_at >= at
        assert returncode == 0, output[-3000:]
        assert f"{how.name} received: checkpoint saved at step {stopped_at}" in output
        assert stopped_at < 20 and runs.load_checkpoint(tmp_path)[0] == stopped_at

    resumed = run_python(command + ["--resume"], kit_env(ONE_THREAD), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert_same_run(runs.read_metrics(tmp_path), reference_metrics)
    final, expected = runs.load_checkpoint(tmp_path), runs.load_checkpoint(std_twenty_steps)
    assert final[0] == expected[0] == 20
    for part in ("model", "optimizer", "train_loader"):
        assert_identical(final[1][part], expected[1][part])


def assert_identical(got, expected):
    """Nested state (tensors, numbers, dicts, lists) equal bit for bit."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_identical(got[key], expected[key])
    elif isinstance(expected, list):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_identical(a, b)
    else:
        assert got == expected


@pytest.mark.slow
def test_compile_gives_the_same_first_loss(builtin_data, tmp_path, reference_metrics):
    """Compiled from nothing, as on CI's fresh machine (a HOME of its own: no kernels cached by
    an earlier run), Inductor's CPU kernels in plain C++ (test_gpu_paths.py says why)."""
    own_cold_cache = kit_env({"HOME": str(tmp_path), "TORCHINDUCTOR_VEC_ISA_OK": "0"})
    result = run_stage(SCRIPT, "--preset", "tiny", *QUARTER_STEP, "--max-steps", "1",
                       "--sample-tokens", "0", "--device", "cpu", "--compile", "--data",
                       builtin_data, "--out", tmp_path / "run", env=own_cold_cache)
    assert result.returncode == 0, result.stderr
    assert "compile on" in result.stdout
    assert result.stdout.count("compiled the model in this step") == 1  # the first step's time
    assert runs.read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(
        reference_metrics[0]["loss"], abs=1e-4)


# --- the model and optimiser flags: one step each, compared with a run at the defaults ----------
ONE_STEP = ["--preset", "tiny", "--max-steps", "1", "--sample-tokens", "0", "--device", "cpu"]
FLAG_RUNS = {"plain": ["--weight-decay", "0"],
             "decayed": ["--weight-decay", "0.5"],
             "reseeded": ["--weight-decay", "0", "--seed", "7"],
             "shallow": ["--n-layer", "1"],
             "fp16": ["--n-layer", "1", "--precision", "fp16"]}


@pytest.fixture(scope="module")
def flag_runs(builtin_data, tmp_path_factory):
    """{name: (first loss, model state after the step, config.json)} of one-step runs, in one
    thread so that runs that should agree do so bit for bit."""
    found = {}
    for name, flags in FLAG_RUNS.items():
        out = tmp_path_factory.mktemp(name)
        result = run_stage(SCRIPT, *ONE_STEP, *flags, "--data", builtin_data, "--out", out,
                           env=kit_env(ONE_THREAD))
        assert result.returncode == 0, result.stderr[-3000:]
        found[name] = (runs.read_metrics(out)[0], runs.load_checkpoint(out)[1]["model"],
                       runs.read_json(out / "config.json"))
    return found


def initial_model(config, seed):
    """The weights the script starts from: its GPT built after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return std.GPT(std.GPTConfig(**config["model"])).state_dict()


def test_seed_sets_the_initial_weights(flag_runs):
    (plain, plain_model, config), (reseeded, reseeded_model, _) = \
        flag_runs["plain"], flag_runs["reseeded"]
    assert reseeded["loss"] != plain["loss"]
    # weights one step away from seed 7's initial ones, far from seed 1337's (Adam moves each
    # weight by at most about lr in a step)
    lr = plain["lr"]
    for name, start in initial_model(config, 7).items():
        assert (reseeded_model[name] - start).abs().max() <= 1.01 * lr, name
    position_table = "transformer.wpe.weight"
    assert (reseeded_model[position_table] - plain_model[position_table]).abs().max() > 10 * lr


def test_same_seed_gives_the_same_first_step(flag_runs):
    """The decayed run differs from the plain one only by its weight decay: same first loss,
    gradients and so the same update of every parameter that does not decay."""
    (plain, plain_model, _), (decayed, decayed_model, _) = flag_runs["plain"], flag_runs["decayed"]
    assert decayed["loss"] == plain["loss"] and decayed["grad_norm"] == plain["grad_norm"]
    for name, tensor in plain_model.items():
        if tensor.dim() < 2:
            assert torch.equal(decayed_model[name], tensor), name


def test_weight_decay_shrinks_the_matrices(flag_runs):
    """AdamW's decoupled decay: p <- p - lr * wd * p before the Adam update, matrices only. With
    the same gradients, plain - decayed = lr * 0.5 * (initial weights) for every matrix."""
    (plain, plain_model, config), (_, decayed_model, decayed_config) = \
        flag_runs["plain"], flag_runs["decayed"]
    assert (config["args"]["weight_decay"], decayed_config["args"]["weight_decay"]) == (0.0, 0.5)
    for name, start in initial_model(config, 1337).items():
        if start.dim() >= 2:
            shrink = plain_model[name] - decayed_model[name]
            torch.testing.assert_close(shrink, plain["lr"] * 0.5 * start, rtol=0, atol=2e-8,
                                       msg=name)


def test_fp16_scales_the_loss_and_takes_the_fp32_step(flag_runs):
    """fp16 autocast with loss scaling (GPUs without bf16), here on the CPU: the loss and the
    (unscaled) gradient norm of the fp32 run, and an optimiser step that was taken, not skipped
    as an overflow would have it."""
    (fp32, fp32_model, _), (fp16, fp16_model, config) = flag_runs["shallow"], flag_runs["fp16"]
    assert config["precision"] == "fp16 autocast, loss scaling"
    assert fp16["loss"] == pytest.approx(fp32["loss"], abs=1e-2)
    assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.02)
    start = initial_model(config, 1337)
    for name, tensor in fp16_model.items():
        assert not torch.equal(tensor, start[name]), name  # the step was taken
        torch.testing.assert_close(tensor, fp32_model[name], rtol=0, atol=2 * fp32["lr"], msg=name)


def test_n_layer_sets_the_depth(flag_runs):
    (_, _, plain_config), (_, shallow_model, config) = \
        flag_runs["plain"], flag_runs["shallow"]
    assert config["model"]["n_layer"] == 1 and plain_config["model"]["n_layer"] == 4
    expected = sum(p.numel() for p in std.GPT(std.GPTConfig(**config["model"])).parameters())
    assert config["parameters"] == expected < plain_config["parameters"]
    blocks = {name.split(".")[2] for name in shallow_model if name.startswith("transformer.h.")}
    assert blocks == {"0"}


# --- bad input: one line naming the value and what is allowed ---------------------------------
BAD_ARGUMENTS = [
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from 'tiny', 'small', 'gpt2-124m')"),
    (["--max-steps", "0"], "argument --max-steps: expected a positive integer, got 0"),
    (["--max-steps", "ten"], "argument --max-steps: expected a positive integer, got 'ten'"),
    (["--micro-batch", "-4"], "argument --micro-batch: expected a positive integer, got -4"),
    (["--seq-len", "0"], "argument --seq-len: expected a positive integer, got 0"),
    (["--lr", "0"], "argument --lr: expected a positive number, got 0"),
    (["--lr=-1e-3"], "argument --lr: expected a positive number, got -1e-3"),
    (["--batch-tokens", "1000"], "--batch-tokens 1000 is not a multiple of micro-batch x seq-len = 4 x 128 = 512"),
    (["--seq-len", "2048"], "--seq-len 2048 is longer than the tiny model's context of 128 tokens"),
    (["--warmup-steps", "500"], "--warmup-steps 500 must be between 0 and --max-steps (300)"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--micro-batch", "400", "--batch-tokens", "51200"], "fewer than one microbatch needs (51,201)"),
    (["--sample-tokens", "-1"], "--sample-tokens -1 must be between 0 and 4096"),
]


def parse_error(capsys, *args):
    """(exit status, stderr) of the script's own argument parsing, in this process: the first
    thing main() does, before any tensor or file is made."""
    with pytest.raises(SystemExit) as stopped:
        std.parse_args(list(map(str, args)))
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line(builtin_data, tmp_path, capsys, args, message):
    status, stderr = parse_error(capsys, "--preset", "tiny", "--data", builtin_data,
                                 "--out", tmp_path / "r", *args)
    assert status == 2
    assert message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_a_bad_argument_stops_the_script_with_one_line(builtin_data, tmp_path):
    """The same as a whole process: exit status 2 and nothing on stderr but the one line."""
    result = run_stage(SCRIPT, "--preset", "tiny", "--data", builtin_data, "--out", tmp_path / "r",
                       "--batch-tokens", "1000")
    assert result.returncode == 2
    assert result.stderr.startswith("train_gpt2_std.py: error: --batch-tokens 1000 is not")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_missing_data_says_how_to_prepare_it(tmp_path, capsys):
    status, stderr = parse_error(capsys, "--preset", "tiny", "--data", tmp_path / "nodata",
                                 "--out", tmp_path / "r")
    assert status == 2 and len(stderr.strip().splitlines()) == 1
    prepare = f"python -m coursekit data prepare --source builtin --out {tmp_path / 'nodata'}"
    assert prepare in stderr


def test_existing_run_is_not_overwritten_without_resume(std_twenty_steps, builtin_data):
    out = std_twenty_steps
    before = (out / "metrics.jsonl").read_bytes()
    result = run_stage(SCRIPT, "--preset", "tiny", "--data", builtin_data, "--out", out)
    assert result.returncode == 2 and "already holds a checkpoint: pass --resume" in result.stderr
    assert (out / "metrics.jsonl").read_bytes() == before


def test_out_that_is_a_file_is_refused(builtin_data, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    status, stderr = parse_error(capsys, "--preset", "tiny", "--data", builtin_data,
                                 "--out", tmp_path / "file")
    assert status == 2 and "is a file, not a run directory" in stderr
