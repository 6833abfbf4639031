"""Files the hub creates (the database and its WAL and SHM, batch files, run and
trainer logs, exports) are private to its user: 0600, directories 0700. With
`trace_server.file_group` they are the group's to read too: 0640 (0750), owned by that
group. Whatever the umask.

Every such file is created here, with its mode given to open(2), so that no file
exists for a moment with a wider one. SQLite gives the WAL and SHM files the mode
(and, for root, the owner) of the database file, which the hub creates before SQLite
opens it.

The group is a setting of the process, like the umask it stands in for: `use_group`
sets it once, when the hub opens its database (app/hub.py).
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from app.errors import ConfigError

log = logging.getLogger("atropos.files")

PRIVATE = 0o600
GROUP_READABLE = 0o640

_gid: int | None = None


def use_group(name: str | None) -> None:
    """Files created from now on are readable by group `name` (None: by no one else)."""
    global _gid
    if name is None:
        _gid = None
        return
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"config.json: trace_server.file_group: no group {name!r}") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(
            f"config.json: trace_server.file_group: this user is not in group {name!r}, "
            "so it cannot give its files to it"
        )
    _gid = gid


def file_mode() -> int:
    return PRIVATE if _gid is None else GROUP_READABLE


def dir_mode() -> int:
    return 0o700 if _gid is None else 0o750


def make_dir(path: str | Path) -> Path:
    """`path` and its missing parents, created with dir_mode()."""
    path = Path(path)
    missing = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(mode=dir_mode(), parents=True, exist_ok=True)
    for created in missing:
        _own(created)
        # mkdir's mode passes through the umask; the parents get it too.
        os.chmod(created, dir_mode())
    return path


def create(path: str | Path, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """A file descriptor on `path`, which is created with file_mode() if it does not
    exist. `flags` say how it is opened: O_EXCL refuses an existing file, O_TRUNC
    empties one."""
    flags |= os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, file_mode())
    except FileExistsError:
        if flags & os.O_EXCL:
            raise
        return os.open(path, flags)
    try:
        # The mode open(2) gave passed through the umask; this one does not.
        os.fchmod(fd, file_mode())
        if _gid is not None:
            os.fchown(fd, -1, _gid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_missing(path: str | Path) -> None:
    """`path`, empty, with file_mode(), unless it exists: an existing file is never
    opened (closing a descriptor of a SQLite database drops every lock this process
    holds on it, its open connections' included)."""
    try:
        os.close(create(path, os.O_RDONLY | os.O_EXCL))
    except FileExistsError:
        pass


def open_new(path: str | Path, mode: str = "ab", **kwargs: Any) -> IO[Any]:
    """open(path, mode) for writing ("a", "w", "x", binary or text), creating the file
    as `create` does."""
    flags = {"a": os.O_APPEND, "w": os.O_TRUNC, "x": os.O_EXCL}[mode[0]]
    return os.fdopen(create(path, os.O_WRONLY | flags), mode.replace("x", "w"), **kwargs)


def temporary(directory: str | Path, name: str) -> tuple[Path, IO[bytes]]:
    """A new file in `directory` under a random name starting `.{name}.`, opened for
    writing: created exclusively (O_EXCL) and never through a symlink (O_NOFOLLOW),
    so that nobody can plant a file or link at the name beforehand."""
    path = Path(directory) / f".{name}.{secrets.token_hex(8)}.tmp"
    fd = create(path, os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW)
    return path, os.fdopen(fd, "wb")


@contextlib.contextmanager
def replaced(path: Path) -> Iterator[IO[bytes]]:
    """`path`, written under a `temporary` name beside it and renamed into place once
    complete and fsynced, so that a reader never sees half of it; the temporary file is
    removed if writing fails (a full disk leaves no partial copy per attempt)."""
    tmp, f = temporary(path.parent, path.name)
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# A `temporary` name: what a writer that died (kill -9, a power cut) left behind.
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")


def sweep_temporaries(directory: str | Path, older_than: float) -> int:
    """Delete the `temporary` files in `directory` not written to for `older_than`
    seconds (younger ones may be another process's write in progress); returns how
    many."""
    swept = 0
    cutoff = time.time() - older_than
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not _TEMPORARY.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                swept += 1
        except FileNotFoundError:
            continue  # another process swept it first
    if swept:
        log.info("%d unfinished temporary files deleted from %s", swept, directory)
    return swept


def _own(path: Path) -> None:
    if _gid is not None:
        os.chown(path, -1, _gid)
