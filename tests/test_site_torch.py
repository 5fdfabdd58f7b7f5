"""`make setup-site` (issue 48, item 3): the course environment on top of a site's PyTorch, which
it never replaces. The "site" here is what many a centre's PyTorch module is: a folder of packages
that the module puts on PYTHONPATH for the system's python3, holding torch (the pinned build)
under a version of its own, which the pin in requirements.txt does not match (as a site's CUDA or
ROCm build never does), so that any install of the pinned torch would show."""
import os
import shutil
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT, trainee

pytestmark = pytest.mark.slow
#: The site's torch: the pinned build, installed in the site's folder under a version of its own
SITE_VERSION = "2.13.0.post9+site"


def site_module(folder):
    """The site's packages: torch and what it needs, in ``folder``, as `module load` would put
    them on PYTHONPATH; its torch is at SITE_VERSION to pip."""
    pinned = next(line for line in (KIT_ROOT / "requirements.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target",
                    str(folder), pinned], check=True, capture_output=True, timeout=900)
    info = next(folder.glob("torch-*.dist-info"))
    metadata = info / "METADATA"
    lines = metadata.read_text().splitlines(keepends=True)
    metadata.write_text("".join(f"Version: {SITE_VERSION}\n" if line.startswith("Version: ")
                                else line for line in lines))
    info.rename(info.with_name(f"torch-{SITE_VERSION}.dist-info"))
    return {**os.environ, "PYTHONPATH": str(folder)}


def kit_copy(folder):
    """The checkout's tracked files, as they are in the working tree (a fresh clone's)."""
    for path in trainee.tracked_files(KIT_ROOT):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(KIT_ROOT / path, folder / path)
    return folder


def make(kit, *args, env=None):
    """`make` in ``kit``, as a trainee runs it: not as a child of the suite's own `make test`,
    whose jobserver variables would make it warn first."""
    env = {name: value for name, value in (env or os.environ).items()
           if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=kit, capture_output=True,
                          text=True, timeout=1800, env=env)


def system_python():
    """The python3 the kit's own environment was made from (a venv's base): no packages of
    the kit's."""
    return getattr(sys, "_base_executable", sys.executable)


def test_setup_site_builds_on_the_sites_torch_and_never_installs_one(tmp_path):
    site = tmp_path / "site-packages"
    module_loaded = site_module(site)
    kit = kit_copy(tmp_path / "kit")
    built = make(kit, "setup-site", f"PYTHON={system_python()}", env=module_loaded)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert built.stdout.strip().splitlines()[-1] == (
        f"site torch 2.13.0+cpu (CPU only) from {site / 'torch'}; it sees no GPU here (a login "
        "node?)")
    assert not list(kit.glob(".venv/lib/python*/site-packages/torch"))  # no torch of its own
    imported = subprocess.run([str(kit / ".venv" / "bin" / "python"), "-c", "import torch, "
                               "coursekit, lightning, accelerate; print(torch.__file__)"],
                              capture_output=True, text=True, env=module_loaded)
    assert imported.stdout.startswith(str(site / "torch")), imported.stderr[-3000:]
    # later targets find the environment done, and their installs would keep the site's torch
    assert make(kit, "--question", "setup", env=module_loaded).returncode == 0
    assert (kit / ".venv" / ".site-torch").read_text() == f"torch=={SITE_VERSION}\n"


def test_setup_site_without_a_torch_stops_in_one_line(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    kit = kit_copy(tmp_path / "kit")
    refused = make(kit, "setup-site", f"PYTHON={bare / 'bin' / 'python'}")
    assert refused.returncode != 0 and not (kit / ".venv").exists()
    assert refused.stderr.splitlines()[0] == (
        f"error: {bare / 'bin' / 'python'} has no torch: load the site's PyTorch module (or "
        "activate its conda env) first, or give PYTHON=<its python>")


def test_setup_site_leaves_an_existing_environment_alone(tmp_path):
    kit = kit_copy(tmp_path / "kit")
    (kit / ".venv").mkdir()
    (kit / ".venv" / "marker").write_text("mine")
    refused = make(kit, "setup-site")
    assert refused.returncode != 0 and (kit / ".venv" / "marker").read_text() == "mine"
    assert refused.stderr.startswith("error: .venv exists: remove it")
