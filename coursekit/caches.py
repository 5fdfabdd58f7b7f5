"""Folders whose files the kit's tools load as code, kept where no other user can write.

torch.compile's Inductor caches compiled graphs, as pickles, in /tmp/torchinductor_<user> unless
told otherwise, and loads them on the next compile. On a node shared between users, anyone can
create that folder first (its name is predictable), leave it open, and put their own pickle in
it: the next compile runs it as you. Triton keeps its compiled kernels next to them. So the kit
gives both caches a folder of the user's own (0700), under ~/.cache unless TORCHINDUCTOR_CACHE_DIR
names another, and checks before every use that it still is: it belongs to the user and no one
else may write in it.

The stages call use_private_compile_cache() before they compile; `make lab`, the OnDemand
session and the batch files export what `python -m coursekit compile-cache` prints, so that a
notebook's own torch.compile uses the same folder.
"""
import getpass
import os
import re
import shlex
import stat
import tempfile
from pathlib import Path

from coursekit import KitError

#: The compile caches' folder where the user names none: per user, kept between jobs and
#: sessions (a second compile of the same model loads its kernels instead of compiling them).
DEFAULT_COMPILE_CACHE = Path("~/.cache/coursekit/torch-compile")


def private_folder(path):
    """``path``, created 0700 if absent; a one-line error if it belongs to someone else or
    others may write in it (and so swap its files). One of the user's own that others may only
    read is taken: torch makes its default cache folder so (0755) when it compiles."""
    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise KitError(f"{path} is not a folder (a link or a file): the kit keeps caches it loads "
                       "code from in a folder of your own; remove it or name another")
    if info.st_uid != os.getuid():
        raise KitError(f"{path} belongs to user id {info.st_uid}, not to you: another user may "
                       "have created it to fill it with code; name a folder of your own")
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise KitError(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: others may write in "
                       f"it; run `chmod 700 {shlex.quote(str(path))}` (or name another folder)")
    return path


def torch_default_cache():
    """Where Inductor caches when told nothing (torch/_inductor/runtime/cache_dir_utils.py,
    default_cache_dir), worked out here without importing torch."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def named_inductor_cache(environ):
    """The Inductor cache the environment names, if a user named it. torch exports its own
    default there once anything asks for the cache folder, which importing parts of torch does:
    that value is the one to replace, not one a user chose."""
    named = environ.get("TORCHINDUCTOR_CACHE_DIR")
    return None if not named or os.path.abspath(named) == torch_default_cache() else named


def compile_cache_env(environ=os.environ):
    """{variable: folder} for Inductor's and Triton's caches: the folders the environment names,
    else the kit's default, each checked private (private_folder)."""
    inductor = private_folder(named_inductor_cache(environ) or DEFAULT_COMPILE_CACHE)
    triton = private_folder(environ.get("TRITON_CACHE_DIR") or inductor / "triton")
    return {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(triton)}


def use_private_compile_cache():
    """Point this process's compile caches at private folders (before anything compiles). Inductor
    keeps its precompiled C++ headers, which every CPU kernel's compile reads, in its default
    folder whatever TORCHINDUCTOR_CACHE_DIR says (codecache._HEADER_DIR, fixed when that module
    is imported, as it is by the first compile): so this process's temporary folder, where that
    default lies, becomes a private one too."""
    caches = compile_cache_env()
    os.environ.update(caches)
    tempfile.tempdir = str(private_folder(Path(caches["TORCHINDUCTOR_CACHE_DIR"]) / "tmp"))


def export_lines():
    """Shell lines that export the private compile caches (for eval in a shell or a job)."""
    return "\n".join(f"export {name}={shlex.quote(folder)}"
                     for name, folder in compile_cache_env().items())
