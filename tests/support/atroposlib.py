"""atroposlib from PyPI, installed where the upstream tests and bench/atropos.py can
use it: `pip install --no-deps --target DIR atroposlib==0.4.0`.

Its API server (fastapi, pydantic, uvicorn: the hub's own dependencies) and its API
tests (requests, pytest) need nothing more. Its example trainer (`example_trainer`, a
package of the same wheel) and its `BaseEnv` need what `install_trainer_and_env` adds:
torch and transformers come from the test extra; the rest (wandb, ...) from PyPI into
the target, never into the hub's environment."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

VERSION = "0.4.0"
REQUIREMENT = f"atroposlib=={VERSION}"
_NETWORK_ERRORS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeout",
    "Read timed out",
    "ProxyError",
    "Connection refused",
)


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index."""


def installed_for_tests(install: Callable[[Path], Path], name: str,
                        tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`install` into the test session's directory `name`, once for all its xdist workers
    (each would otherwise run pip for the same files): the first takes a lock and
    installs, the others wait on it and find the directory made. A test that needs it
    is skipped when the package index is unreachable, unless CI is set (there it must be
    reachable)."""
    import pytest  # only tests call this; bench/atropos.py imports this module too

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    target, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if made.exists():
            return target
        shutil.rmtree(target, ignore_errors=True)  # what a failed install left
        try:
            install(target)
        except RegistryUnreachable as exc:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"the package index is unreachable (and CI is unset): {exc}")
        made.touch()
    return target


def install_atroposlib(target: Path) -> Path:
    """Install atroposlib (and requests, if this interpreter lacks it) into target;
    returns target, to put on PYTHONPATH."""
    packages = [REQUIREMENT]
    _pip(target, "--no-deps", *packages)
    if importlib.util.find_spec("requests") is None:
        _pip(target, "requests")
    return target


def install_server_classes(target: Path) -> Path:
    """atroposlib with what its model server classes (envs/server_handling, e.g.
    OpenAIServer) import besides the hub's dependencies: aiohttp, tenacity, pydantic-cli
    (without its own dependencies: it would bring another pydantic)."""
    install_atroposlib(target)
    _pip(target, "aiohttp")
    _pip(target, "--no-deps", "tenacity", "pydantic-cli")
    return target


def install_trainer_and_env(target: Path) -> Path:
    """atroposlib with what its example trainer (`example_trainer.api`, `.data`: its
    package imports every trainer, and so wandb) and `atroposlib.envs.base.BaseEnv`
    import besides the hub's dependencies and the test extra's torch and transformers:
    the server classes', wandb (with its own dependencies, which stay in the target),
    jsonlines and markdown."""
    install_server_classes(target)
    _pip(target, "wandb", "jsonlines", "markdown")
    return target


def _pip(target: Path, *args: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
            str(target),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode == 0:
        return
    output = result.stdout + result.stderr
    if any(marker in output for marker in _NETWORK_ERRORS):
        raise RegistryUnreachable(output.strip()[-2000:])
    raise RuntimeError(f"pip install {' '.join(args)} failed:\n{output}")


def start_run_api(atroposlib: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """atroposlib's own server (`run-api`) on 127.0.0.1:port, logging to
    workdir/run-api.log."""
    with open(workdir / "run-api.log", "wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1",
             "--port", str(port)],
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": str(atroposlib)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
