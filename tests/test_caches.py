"""torch.compile's caches are their user's own (issue 47, item 4).

Inductor loads the graphs it cached, pickles, from /tmp/torchinductor_<user> unless told
otherwise; a co-tenant who creates that folder first fills it. The stages (and `make lab`, the
OnDemand session and the batch files, through `python -m coursekit compile-cache`) use a private
folder instead, and refuse one that another user made or may enter. tests/test_gpu_paths.py's
compiled runs show the squatted /tmp folder left untouched."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coursekit import KIT_ROOT
from solutions import train_gpt2_std

pytestmark = pytest.mark.unit


def test_a_compiling_stage_tells_inductor_to_use_a_private_folder(own_compile_caches,
                                                                   builtin_data):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
    train_gpt2_std.parse_args(["--preset", "tiny", "--device", "cpu", "--compile",
                               "--data", str(builtin_data)])
    private = own_compile_caches / ".cache" / "coursekit" / "torch-compile"
    assert Path(cache_dir()) == private and Path(triton_cache_dir(0)) == private / "triton"
    for folder in (private, private / "triton"):
        assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()


def compile_cache(folder):
    """`python -m coursekit compile-cache` with TORCHINDUCTOR_CACHE_DIR=folder."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder)}
    return subprocess.run([sys.executable, "-m", "coursekit", "compile-cache"], cwd=KIT_ROOT,
                          env=env, capture_output=True, text=True)


@pytest.mark.parametrize("mode", ["777", "700"])
def test_a_cache_folder_another_user_made_is_refused_in_one_line(cotenant, mode):
    """Open to all, or closed but theirs: either way they chose what is in it."""
    folder = Path("/tmp") / f"kit-shared-cache-{cotenant.name}-{mode}"
    cotenant.run("rm", "-rf", str(folder))
    cotenant.run("mkdir", "-m", mode, str(folder))
    try:
        result = compile_cache(folder)
    finally:
        cotenant.run("rm", "-rf", str(folder))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"error: {folder} belongs to user id {cotenant.uid}, not to you: "
                             "another user may have created it to fill it with code; name a "
                             "folder of your own\n")


def test_a_cache_folder_of_ones_own_that_others_may_write_is_refused_until_closed(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(0o777)
    refused = compile_cache(folder)
    assert refused.returncode == 2 and f"{folder} has mode 0777: others may write" in \
        refused.stderr
    folder.chmod(0o755)  # as torch makes its own: others may read, not write
    accepted = compile_cache(folder)
    assert accepted.returncode == 0
    assert accepted.stdout.splitlines() == [f"export TORCHINDUCTOR_CACHE_DIR={folder}",
                                            f"export TRITON_CACHE_DIR={folder}/triton"]


def test_batch_files_make_lab_and_the_ondemand_session_use_the_private_caches():
    checked = 'compile_caches="$(python -m coursekit compile-cache)"'
    assert checked in (KIT_ROOT / "ondemand" / "template" / "script.sh.erb").read_text()
    assert "$(BIN)/python -m coursekit lab" in (KIT_ROOT / "Makefile").read_text()
    for batch_file in (KIT_ROOT / "batchfiles").glob("*/batch-*.sh"):
        assert "compile_caches=$(python -m coursekit compile-cache)" in batch_file.read_text()
