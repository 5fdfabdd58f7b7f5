import json
import subprocess
import sys

import pytest

from coursekit import envcheck, instruct

pytestmark = pytest.mark.unit


def test_collect_reports_what_the_kernel_sees(builtin_data):
    info = envcheck.collect(root=builtin_data.parent.parent)
    assert info["devices"][-1][0] == "cpu"
    assert info["cpu_cores"] >= 1 and info["torch"]
    assert set(info["slurm_commands"]) == set(envcheck.SLURM_COMMANDS)
    assert info["tokenizer_offline"] is True


def test_prepared_data_is_found(builtin_data, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "builtin").symlink_to(builtin_data)
    found = envcheck.prepared_data(tmp_path)
    assert list(found) == [str(tmp_path / "data" / "builtin")]
    assert "prepared data     " + str(tmp_path / "data" / "builtin") in envcheck.report(
        {**envcheck.collect(tmp_path)})


def test_an_instruction_set_is_reported_in_examples(tmp_path):
    instruct.prepare(tmp_path / "data" / "instruct")
    report = envcheck.report(envcheck.collect(tmp_path))
    assert f"{tmp_path / 'data' / 'instruct'}: kit-tasks, train 2,000 examples, val 200 examples" \
        in report


def test_cli_report_and_json():
    text = subprocess.run([sys.executable, "-m", "coursekit", "envcheck"], capture_output=True,
                          text=True, check=True).stdout
    for label in ("torch", "cpu cores", "device", "slurm commands", "prepared data", "gpt-2 tokenizer"):
        assert label in text
    info = json.loads(subprocess.run([sys.executable, "-m", "coursekit", "envcheck", "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["cpu_cores"] >= 1
