"""The lora stage: the kit's GPT, pretrained and exported, fine-tuned on the offline instruction
tasks with PEFT, launched by Accelerate with every config in solutions/accelerate/: the single
process's reference run by `accelerate launch` itself, the others' processes forked from the
lora fork server with what Accelerate's launcher would give them (accelerate_environment). Lesson
05 and the lora stage's Slurm jobs run `accelerate launch` too."""
import contextlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import LORA_FORK_SERVER, forked_torchrun, free_port, kit_env
from coursekit import KIT_ROOT, instruct, runs, stages

pytestmark = pytest.mark.stages
SCRIPT = KIT_ROOT / "solutions" / "finetune_lora.py"
CONFIGS = KIT_ROOT / "solutions" / "accelerate"
ACCELERATE = str(KIT_ROOT / ".venv" / "bin" / "accelerate") if (KIT_ROOT / ".venv").exists() \
    else shutil.which("accelerate")
# no dropout: one process and two draw different dropout masks for the same examples
SHORT = ["--max-steps", 4, "--eval-interval", 2, "--eval-examples", 8, "--ckpt-interval", 2,
         "--lora-dropout", 0]


@pytest.fixture(scope="module")
def base_model(base_run):
    """The tiny GPT the std stage pretrains for 300 steps (conftest's base_run), exported untied."""
    return KIT_ROOT / "models" / "kit-tiny"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    out = tmp_path_factory.mktemp("instruct")
    instruct.prepare(out)
    return out


def accelerate_launch(config, out, base_model, tasks, *args):
    """`accelerate launch` the stage with one of the kit's configs; returns the CompletedProcess."""
    command = [ACCELERATE, "launch", "--config_file", CONFIGS / f"{config}.yaml",
               "--main_process_port", free_port(), SCRIPT, "--model", base_model, "--data", tasks,
               "--out", out, *args]
    return subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=900,
                          env=kit_env(), cwd=KIT_ROOT)


def launch(config, out, base_model, tasks, *args):
    """The stage's processes as `accelerate launch` with one of the kit's configs starts them,
    forked (one, or torchrun's workers); the real launch should the server refuse them. Returns
    the CompletedProcess."""
    processes, env = accelerate_environment(config)
    command = [sys.executable, str(SCRIPT), *map(str, ["--model", base_model, "--data", tasks,
                                                       "--out", out, *args])]
    with contextlib.chdir(KIT_ROOT):
        result = (LORA_FORK_SERVER.run(command, env, KIT_ROOT, 900) if processes == 1 else
                  forked_torchrun(processes, command, env, server=LORA_FORK_SERVER))
    return result or accelerate_launch(config, out, base_model, tasks, *args)


def accelerate_environment(config):
    """(processes, environment) that `accelerate launch --config_file <config>` gives the script
    here, from Accelerate's own launcher: launch_command (accelerate/commands/launch.py) picks
    the function that makes the environment as below, then runs the script in it, or has
    torchrun run it (which adds each worker's rank)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import (prepare_deepspeed_cmd_env, prepare_multi_gpu_env,
                                  prepare_simple_launcher_cmd_env)
    parsed = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{config}.yaml"),
                                                 str(SCRIPT)])
    args, defaults, mixed_precision_from_config = _validate_launch_command(parsed)
    with contextlib.chdir(KIT_ROOT):  # DeepSpeed's launch puts the working folder on PYTHONPATH
        if args.use_deepspeed and not args.cpu:
            args.deepspeed_fields_from_accelerate_config = ",".join(
                [*defaults.deepspeed_config,
                 *(["mixed_precision"] if mixed_precision_from_config else [])])
            env = prepare_deepspeed_cmd_env(args)[1]
        elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
            env = prepare_multi_gpu_env(args)
        else:
            env = prepare_simple_launcher_cmd_env(args)[1]
    return args.num_processes, {**kit_env(), **env}


def losses(run_dir):
    """Training and validation losses, step by step."""
    return [(r["loss"], r.get("val_loss", 0.0)) for r in runs.read_metrics(run_dir)]


@pytest.fixture(scope="module")
def single_run(base_model, tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    result = accelerate_launch("single", out, base_model, tasks, *SHORT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out


@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero2", "zero3"])
def test_two_processes_train_like_one_and_save(config, single_run, base_model, tasks, tmp_path):
    """Every multi-process config completes on 2 CPU processes, takes the same steps as one
    process (the minibatch of 32 is 16 per process instead of 2 micro-batches of 16), saves the
    adapter, the merged model and its checkpoints."""
    out = tmp_path / "run"
    result = launch(config, out, base_model, tasks, *SHORT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "on 2 process(es)" in result.stdout
    for got, expected in zip(losses(out), losses(single_run), strict=True):
        assert got == pytest.approx(expected, abs=1e-4)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "model" / "model.safetensors").is_file()
    assert runs.read_json(out / "ckpt" / "latest.json")["step"] == 4


def test_run_directory_keeps_the_contract(single_run):
    records = runs.read_metrics(single_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "ms", "tok_per_s", "mfu"} <= set(records[0])
    assert "val_loss" in records[1] and "exact_match" in records[3]
    config = runs.read_json(single_run / "config.json")
    assert 0 < config["trainable_fraction"] < 0.2
    evaluations = runs.read_json(single_run / "eval.json")
    assert set(evaluations) == {"before", "after"}
    assert evaluations["after"]["val_loss"] < evaluations["before"]["val_loss"]
    predictions = (single_run / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 8 and {"answer", "reference"} <= set(json.loads(predictions[0]))


# The tiny preset's whole recipe (250 steps) teaches the model the tasks: lesson 05 runs it and
# checks that exact match rises by 30 points and the validation loss falls by a quarter.


def test_merged_model_equals_base_plus_adapter(single_run, base_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_model)
    adapted = PeftModel.from_pretrained(base, single_run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(single_run / "model").eval()
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = adapted(idx).logits, merged(idx).logits
        plain = AutoModelForCausalLM.from_pretrained(base_model)(idx).logits
    # float32 sums in another order: logits of up to ~20 agree to 1e-5 relative
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got.softmax(-1) - expected.softmax(-1)).abs().max() <= 1e-5
    assert (plain - expected).abs().max() > 1e-2  # the adapter changed the model


def test_resume_continues_exactly(single_run, base_model, tasks, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(single_run / "ckpt" / "step_00000002", out / "ckpt" / "step_00000002")
    runs.write_json_atomic(out / "ckpt" / "latest.json", {"dir": "step_00000002", "step": 2})
    result = launch("single", out, base_model, tasks, *SHORT, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    assert [r["step"] for r in runs.read_metrics(out)] == [3, 4]
    assert losses(out) == losses(single_run)[2:]  # bit for bit: the same work in the same order


def test_batched_greedy_answers_equal_one_at_a_time(base_model, tasks):
    """Evaluation generates with left padding in batches; positions must not shift the answers."""
    from accelerate import Accelerator
    finetune_lora = stages.load_script(KIT_ROOT / "solutions" / "finetune_lora.py")
    model, tokenizer = finetune_lora.load_pretrained(str(base_model))
    examples = [json.loads(line) for line in (tasks / "val.jsonl").read_text().splitlines()[:6]]
    accelerator = Accelerator(cpu=True)
    batched = finetune_lora.greedy_answers(accelerator, model, tokenizer, examples, 6, 6)
    single = [finetune_lora.greedy_answers(accelerator, model, tokenizer, [e], 6, 1)[0]
              for e in examples]
    assert batched == single


@pytest.fixture(scope="module")
def full_run(base_model, tasks, tmp_path_factory):
    """--method full: one step that trains every weight of the base model."""
    out = tmp_path_factory.mktemp("full") / "run"
    result = launch("single", out, base_model, tasks, "--method", "full", "--max-steps", 1,
                    "--eval-examples", 8, "--lora-dropout", 0)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result.stdout


def test_full_fine_tuning_trains_every_weight(full_run, base_model):
    """Nothing frozen: every parameter counts as trainable, and every weight of the saved model
    moved away from the base model's (a weight left out of the optimiser would not move)."""
    from safetensors.torch import load_file
    out, stdout = full_run
    config = runs.read_json(out / "config.json")
    assert config["trainable"] == config["parameters"] > 0 and config["trainable_fraction"] == 1.0
    assert f"full: {config['parameters']:,} trainable (100.00%)" in stdout
    assert not (out / "adapter").exists()  # no LoRA adapters, the whole model instead
    base = load_file(base_model / "model.safetensors")
    tuned = load_file(out / "model" / "model.safetensors")
    assert base.keys() <= tuned.keys()
    unchanged = [name for name, weight in base.items() if torch.equal(tuned[name], weight)]
    assert unchanged == []


BAD_INPUT = [
    (["--model", "/nonexistent/model"], "cannot load --model /nonexistent/model"),
    (["--batch-size", "24", "--micro-batch", "16"], "--batch-size 24 is not a multiple"),
    (["--lora-dropout", "1.5"], "--lora-dropout 1.5"),
    (["--data", "/nonexistent/tasks"], "--data /nonexistent/tasks"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=["model", "batch", "dropout", "data"])
def test_bad_input_gets_one_line(args, message, base_model, tasks, tmp_path, monkeypatch, capsys):
    """The script's own argument checks, in this process (the first thing main() does), as one
    process of a launch would run them."""
    finetune_lora = stages.load_script(KIT_ROOT / "solutions" / "finetune_lora.py")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stopped:
        finetune_lora.parse_args(list(map(str, ["--model", base_model, "--data", tasks,
                                                "--out", tmp_path / "run", *args])))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2
    assert len(lines) == 1 and message in lines[0], lines


def test_bad_input_stops_the_script_with_one_line(base_model, tasks, tmp_path):
    """The same as a whole process: a failed status and nothing on stderr but the one line."""
    command = [sys.executable, SCRIPT, "--model", "/nonexistent/model", "--data", tasks,
               "--out", tmp_path / "run"]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True,
                            env=kit_env(), cwd=KIT_ROOT, timeout=300)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot load --model /nonexistent/model" in lines[0], lines
