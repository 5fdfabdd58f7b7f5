"""Your class, in one place: its course id and nbgrader exchange, read from course.toml.

    python -m coursekit exchange create PATH --group GROUP    the exchange, once, on project space

nbgrader's exchange is a folder that the instructor and every trainee reach: the instructor
releases an assignment into it, trainees (other Unix users) fetch it and submit into it, and the
instructor collects, then releases feedback. nbgrader sets its modes itself: the exchange folder
is writable by everyone (0777), submissions go to an `inbound` folder that nobody but the
instructor can list (0733, each submission named with a random string), and feedback to a folder
that nobody can list (0711, each file named by a hash of the submission and its secret). What
keeps other users of a cluster out is the folder above it: owned by the instructor, of the
course's Unix group, and closed to others (2750). `create` makes both and checks that gate, and
adds the sticky bit to the exchange, so that only its owner can rename or remove what is in it.

The instructor's nbgrader_config.py and the trainee kit's both read course.toml (`configure`),
so trainees fetch and submit where the instructor releases and collects.
"""
import grp
import os
import re
import stat
import tomllib
from pathlib import Path

from coursekit import KitError

SETTINGS_FILE = "course.toml"
COURSE_ID = re.compile(r"[A-Za-z0-9_-]+")
#: The gate above the exchange: owner rwx, the course's group r-x (set-group-ID, so that what is
#: made inside belongs to the group), others nothing.
GATE_MODE = 0o2750
#: nbgrader's own mode for the exchange folder (ExchangeReleaseAssignment.ensure_root compares the
#: 0777 bits), and the sticky bit: a member of the group could otherwise rename the course's
#: folder, which the instructor owns, and put one of their own in its place for the others to
#: fetch from.
EXCHANGE_MODE = 0o1777


def settings(root):
    """(course id, exchange folder) from root/course.toml; (None, None) where the class has no
    exchange (both empty, or no such file). A half-set or malformed file is a KitError naming
    what is wrong."""
    path = Path(root) / SETTINGS_FILE
    if not path.exists():
        return None, None
    try:
        found = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise KitError(f"{path}: {error}") from None
    course_id, exchange = found.get("id", ""), found.get("exchange", "")
    if not course_id and not exchange:
        return None, None
    if not COURSE_ID.fullmatch(str(course_id)):
        raise KitError(f"{path}: id {course_id!r} is not a course id: use letters, digits, "
                       "'-' and '_'")
    if not exchange or not Path(exchange).is_absolute():
        raise KitError(f"{path}: exchange {exchange!r} is not an absolute path: set it to the "
                       "folder that `python -m coursekit exchange create` made")
    return course_id, Path(exchange)


def configure(c, root):
    """Point nbgrader's config ``c`` at the class's exchange (from course.toml in ``root``). A bad
    course.toml stops nbgrader with a one-line error (SystemExit passes through its config
    loader, which would only log an exception and go on without the exchange)."""
    try:
        course_id, exchange = settings(root)
    except KitError as error:
        raise SystemExit(f"error: {error}") from None
    if course_id:
        c.CourseDirectory.course_id = course_id
        c.Exchange.root = str(exchange)


def create_exchange(path, group):
    """Make the exchange ``path`` (which must not exist) inside a gate folder (its parent) that
    belongs to ``group``, which may enter it but not write in it, and is closed to others: the
    parent is made if missing, and an existing one must already be so. A member of the group who
    could write in the gate (a project folder every trainee writes in, mode 2770) could rename the
    exchange and put one of their own in its place. Returns (exchange, the gate's mode)."""
    path = Path(path).absolute()
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise KitError(f"--group {group!r} is not a Unix group here: use the course's group, "
                       "of which the instructor and every trainee are members") from None
    if path.exists():
        raise KitError(f"{path} exists: the exchange is made once, in a new folder")
    gate = path.parent
    if gate.is_dir():
        status = gate.stat()
        mode = stat.S_IMODE(status.st_mode)
        if status.st_gid != gid or not mode & 0o010 or mode & 0o027:
            raise KitError(f"{gate} (group {group_name(status.st_gid)}, mode {mode:o}) "
                           f"must be of group {group}, which must reach it but not write in it, "
                           f"and closed to others: chgrp {group} {gate} && chmod {GATE_MODE:o} "
                           f"{gate}")
    try:
        if not gate.exists():
            made(gate, gid, GATE_MODE)
        made(path, gid, EXCHANGE_MODE)
    except OSError as error:
        raise KitError(f"cannot make {error.filename}: {error.strerror}") from None
    return path, stat.S_IMODE(gate.stat().st_mode)


def made(folder, gid, mode):
    """``folder``, made (with its parents), given to the group ``gid`` and the mode ``mode``."""
    folder.mkdir(parents=True)
    os.chown(folder, -1, gid)
    folder.chmod(mode)


def group_name(gid):
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
