"""Ray Train runs the ddp stage's training (solutions/ray_train_gpt2.py): 2 workers of a local Ray
take the same steps as the std stage at the same global batch, within the tolerance the ddp stage
is held to, and leave the stages' run directory."""
import pytest

from conftest import ONE_THREAD, TWENTY_STEPS, kit_env, run_stage
from coursekit import runs

pytestmark = pytest.mark.stages


def test_two_ray_train_workers_follow_std_at_the_same_global_batch(builtin_data, tmp_path,
                                                                    std_twenty_steps):
    result = run_stage("ray_train_gpt2.py", *TWENTY_STEPS, "--workers", "2", "--data",
                       builtin_data, "--out", tmp_path, env=kit_env(ONE_THREAD))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ray train: 2 workers, step 20, loss " in result.stdout
    assert result.stdout.count("step 20/20 ") == 1  # rank 0's line, forwarded once
    config = runs.read_json(tmp_path / "config.json")
    assert (config["stage"], config["world_size"], config["grad_accum"]) == ("ray", 2, 1)
    got, expected = runs.read_metrics(tmp_path), runs.read_metrics(std_twenty_steps)
    assert [r["step"] for r in got] == list(range(1, 21))
    for ray_step, std_step in zip(got, expected, strict=True):
        assert ray_step["loss"] == pytest.approx(std_step["loss"], abs=1e-4)
        assert ray_step.get("val_loss", 0) == pytest.approx(std_step.get("val_loss", 0), abs=1e-4)
    assert runs.load_checkpoint(tmp_path)[0] == 20
