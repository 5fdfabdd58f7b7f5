"""export-hf: a std, ddp, fsdp, tp or pp run becomes a Hugging Face GPT-2 directory whose logits, greedy
generations and token ids are the kit's; bad input gets a one-line error."""
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import kit_env
from coursekit import KIT_ROOT, data, hfexport, runs, stages
from coursekit.presets import GPT2_VOCAB, get_preset

pytestmark = pytest.mark.stages
# conftest's runs, trained once for the stage tests too: std in one process; ddp, fsdp, tp and
# pp on 2, whose checkpoints hold shards, slices and stages
STAGE_RUNS = {"std": "std_twenty_steps", "ddp": "ddp_ten_steps", "fsdp": "fsdp_ten_steps",
              "tp": "tp_ten_steps", "pp": "pp_ten_steps"}


def run_directory(request, stage):
    found = request.getfixturevalue(STAGE_RUNS[stage])
    return found[0] if isinstance(found, tuple) else found  # fsdp's, tp's and pp's: and stdout


@pytest.fixture(scope="module")
def std_run(std_twenty_steps):
    return std_twenty_steps


@pytest.fixture(scope="module", params=list(STAGE_RUNS))
def exported(request, tmp_path_factory):
    """(run directory, export directory) of a short run of each stage."""
    stage = request.param
    run_dir = run_directory(request, stage)
    out = tmp_path_factory.mktemp(f"{stage}-hf") / "model"
    hfexport.export(run_dir, out)
    return run_dir, out


def kit_model(run_dir):
    """The kit's own GPT with the run's newest weights, loaded without the exporter: safetensors
    through runs, or DCP shards into the model's own tensors without a process group."""
    std = stages.load("std")
    config = runs.read_json(run_dir / "config.json")
    model = std.GPT(std.GPTConfig(**config["model"]))
    if config["stage"] in hfexport.SHARDED_STAGES:
        with warnings.catch_warnings():  # "assuming ... a single process": just so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model.state_dict()},
                     checkpoint_id=runs.latest_checkpoint(run_dir), no_dist=True)
    else:
        model.load_state_dict(runs.load_checkpoint(run_dir)[1]["model"])
    return model.eval()


def hf_model(out):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(out).eval()


@torch.no_grad()
def test_logits_equal_the_kit_models(exported):
    run_dir, out = exported
    kit, hf = kit_model(run_dir), hf_model(out)
    assert hf.config.vocab_size == GPT2_VOCAB and hf.lm_head.weight.shape[0] == GPT2_VOCAB
    T = get_preset("tiny").seq_len
    idx = torch.randint(0, GPT2_VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    expected = kit(idx)[..., :GPT2_VOCAB]
    assert (hf(idx).logits - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_an_untied_export_computes_the_same_logits_with_a_head_of_its_own(std_run, tmp_path):
    hfexport.export(std_run, tmp_path / "tied")
    hfexport.export(std_run, tmp_path / "untied", untie=True)
    tied, untied = hf_model(tmp_path / "tied"), hf_model(tmp_path / "untied")
    assert not untied.config.tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    assert tied.lm_head.weight.data_ptr() == tied.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, GPT2_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(tied(idx).logits, untied(idx).logits)
    assert runs.read_json(tmp_path / "untied" / "kit_export.json")["untied"] is True


@torch.no_grad()
def test_greedy_generation_matches_the_kit_models(exported):
    run_dir, out = exported
    kit, hf = kit_model(run_dir), hf_model(out)
    prompt = torch.tensor([data.gpt2_encoding().encode_ordinary("The meaning of")])
    idx = prompt
    for _ in range(8):  # greedy decoding with the kit's model; generate() stops at end-of-text
        token = kit(idx)[:, -1, :GPT2_VOCAB].argmax(-1, keepdim=True)
        idx = torch.cat([idx, token], dim=1)
        if token.item() == data.EOT_TOKEN:
            break
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=8)
    assert generated.tolist() == idx.tolist() and generated.shape[1] > prompt.shape[1]


def test_tokenizer_gives_tiktokens_ids(exported):
    from transformers import AutoTokenizer
    _, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    encoding = data.gpt2_encoding()
    for text in ["Hello world", " leading space", "def f(x):\n    return x ** 2\n",
                 "naïve café – 123,456.78", "one<|endoftext|>two"]:
        assert tokenizer(text)["input_ids"] == encoding.encode(text, allowed_special="all"), text
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == data.EOT_TOKEN


def test_provenance_names_the_run_and_checkpoint(exported):
    run_dir, out = exported
    record = runs.read_json(out / "kit_export.json")
    config = runs.read_json(run_dir / "config.json")
    assert record["stage"] == config["stage"] and record["step"] == config["args"]["max_steps"]
    assert record["checkpoint"] == str(runs.latest_checkpoint(run_dir).resolve())
    assert not list(out.parent.glob(".model.*"))  # no temporary directory left behind


def export_hf(*args):
    return subprocess.run([sys.executable, "-m", "coursekit", "export-hf", *map(str, args)],
                          capture_output=True, text=True, cwd=KIT_ROOT, env=kit_env(), timeout=300)


def assert_one_line_error(result, *named):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in named:
        assert str(text) in lines[0]


def test_missing_run_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-run"
    assert_one_line_error(export_hf(missing, tmp_path / "out"), missing)


def test_run_without_a_checkpoint_is_named(std_run, tmp_path):
    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    (run_dir / "config.json").write_text((std_run / "config.json").read_text())
    assert_one_line_error(export_hf(run_dir, tmp_path / "out"), run_dir, "no checkpoint")


def test_unsupported_stage_names_the_supported_ones(tmp_path):
    run_dir = tmp_path / "lit-run"
    run_dir.mkdir()
    runs.write_json_atomic(run_dir / "config.json", {"stage": "lit"})
    assert_one_line_error(export_hf(run_dir, tmp_path / "out"), run_dir, "'lit'",
                          "std, ddp, fsdp, tp and pp")


def test_non_empty_out_needs_force_which_replaces_it(std_run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    assert_one_line_error(export_hf(std_run, out), out, "--force")
    assert (out / "notes.txt").exists()

    result = export_hf(std_run, out, "--force")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "notes.txt").exists()
    assert runs.read_json(out / "kit_export.json")["step"] == runs.load_checkpoint(std_run)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing left beside it


def test_out_dir_that_is_the_run_is_refused_even_with_force(std_run, tmp_path):
    run = tmp_path / "run"  # a copy: were it not refused, --force would empty the shared run
    shutil.copytree(std_run, run)
    assert_one_line_error(export_hf(run, run, "--force"), run, "run directory")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == \
        sorted(p.relative_to(std_run) for p in std_run.rglob("*"))
    assert runs.latest_checkpoint(std_run).is_dir()


def test_the_cli_imports_transformers_only_when_exporting():
    code = "import sys, coursekit.cli, coursekit.hfexport; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=KIT_ROOT, env=kit_env(), check=True)
    assert result.stdout.strip() == "False"
