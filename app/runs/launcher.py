"""Runs one command of a training run and records how it ended.

    python -I launcher.py EXIT_FILE [--user NAME] -- COMMAND [ARGS...]

A process's exit status reaches only its parent, and a restarted hub is not the
parent of the runs it re-attaches to. So the hub starts every command under this
launcher, which waits for it and writes its return code to EXIT_FILE (`-N`: killed by
signal N); any later hub reads the file. Standard library only, run by path: it must
not depend on how the hub was installed.

The hub stops a process by signalling its whole process group (the launcher leads
it). The launcher keeps running through SIGTERM and SIGINT so that it can record the
code of a command that handles them; SIGKILL ends both, and leaves no file.

`--user NAME` (runs.user, the launcher runs as root): the command runs as that user,
with its groups and its HOME, USER and LOGNAME, so that it cannot read the hub's
/proc/PID/environ; the launcher stays root to write EXIT_FILE where the hub keeps it.
"""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import sys
from typing import Any


def main(argv: list[str]) -> int:
    user = None
    if len(argv) > 3 and argv[1] == "--user":
        user = argv[2]
        argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: launcher.py EXIT_FILE [--user NAME] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the command too.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        proc = subprocess.Popen(command, **(_as_user(user) if user else {}))
    except OSError as exc:
        # As a shell reports it: 127 not found, 126 found but not runnable.
        print(f"cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
    else:
        code = proc.wait()
    _record(exit_file, code)
    return code if code >= 0 else 128 - code


def _as_user(name: str) -> dict[str, Any]:
    """Popen's arguments that run a command as user `name`, as a login would."""
    account = pwd.getpwnam(name)
    env = {**os.environ, "HOME": account.pw_dir, "USER": name, "LOGNAME": name}
    groups = os.getgrouplist(name, account.pw_gid)
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": groups, "env": env}


def _record(path: str, code: int) -> None:
    # Written whole, then renamed: a reader never sees half a number.
    partial = f"{path}.partial"
    # The mode and group of the log the hub made (its stdout), which app/files.py
    # chose; private when that is not a file.
    log = os.fstat(sys.stdout.fileno())
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if stat.S_ISREG(log.st_mode):
        os.fchmod(fd, stat.S_IMODE(log.st_mode))
        os.fchown(fd, -1, log.st_gid)
    with os.fdopen(fd, "w") as f:
        f.write(f"{code}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
