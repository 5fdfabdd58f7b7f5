"""`make setup-site` (issue 48, item 3): the course environment on top of a site's PyTorch, which
it never replaces. The "site" here is a separate prefix with its own torch, whose version the pin
in requirements.txt does not match (as a site's CUDA or ROCm build never does), so that any
install of the pinned torch would show."""
import shutil
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT, trainee

pytestmark = pytest.mark.slow
#: The site's torch: the pinned build, installed in the site's prefix under a version of its own
SITE_VERSION = "2.13.0.post9+site"


def site_with_torch(prefix):
    """A Python prefix whose torch pip sees at SITE_VERSION, as a site's module provides it."""
    subprocess.run([sys.executable, "-m", "venv", str(prefix)], check=True)
    pinned = next(line for line in (KIT_ROOT / "requirements.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    subprocess.run([str(prefix / "bin" / "python"), "-m", "pip", "install", "--quiet", pinned],
                   check=True, capture_output=True, timeout=900)
    info = next(prefix.glob("lib/python*/site-packages/torch-*.dist-info"))
    metadata = info / "METADATA"
    lines = metadata.read_text().splitlines(keepends=True)
    metadata.write_text("".join(f"Version: {SITE_VERSION}\n" if line.startswith("Version: ")
                                else line for line in lines))
    info.rename(info.with_name(f"torch-{SITE_VERSION}.dist-info"))
    return prefix / "bin" / "python"


def kit_copy(folder):
    """The checkout's tracked files, as they are in the working tree (a fresh clone's)."""
    for path in trainee.tracked_files(KIT_ROOT):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(KIT_ROOT / path, folder / path)
    return folder


def make(kit, *args):
    return subprocess.run(["make", "--no-print-directory", *args], cwd=kit, capture_output=True,
                          text=True, timeout=1800)


def test_setup_site_builds_on_the_sites_torch_and_never_installs_one(tmp_path):
    site_python = site_with_torch(tmp_path / "site")
    kit = kit_copy(tmp_path / "kit")
    built = make(kit, "setup-site", f"PYTHON={site_python}")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    site_packages = next((tmp_path / "site").glob("lib/python*/site-packages"))
    assert built.stdout.strip().splitlines()[-1] == (
        f"site torch 2.13.0+cpu (CPU only) from {site_packages / 'torch'}; it sees no GPU here "
        "(a login node?)")
    assert not list(kit.glob(".venv/lib/python*/site-packages/torch"))  # no torch of its own
    venv_python = kit / ".venv" / "bin" / "python"
    imported = subprocess.run([str(venv_python), "-c", "import torch, coursekit, lightning, "
                               "accelerate; print(torch.__file__)"],
                              capture_output=True, text=True, check=True)
    assert imported.stdout.startswith(str(site_packages))
    # later targets find the environment done, and their installs would keep the site's torch
    assert make(kit, "--question", "setup").returncode == 0
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
