"""The README's five minutes, run as a user runs them: every `$ ` command of its
console blocks, in order, against a hub started by its first one, in a fresh home
directory; what each prints is what the README shows (times, the home directory and
progress lines aside). The README stays under 150 lines and opens with its two
commands.

    ATROPOS_WRITE_README=1 pytest tests/test_readme.py   # rewrite the outputs shown
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import REAL, ROOT
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until

README = ROOT / "README.md"
CONSOLE = re.compile(r"```console\n(.*?)```", re.DOTALL)
_CLOCK = re.compile(r"^\d\d:\d\d:\d\d ", re.MULTILINE)
_PROGRESS = re.compile(r"^\w+: [\d/]+ \(\d+/s, [\d.]+ s\)\n", re.MULTILINE)
_DEFAULT_ADDRESS = "127.0.0.1:8000"


def steps(text: str) -> list[tuple[str, str]]:
    """(command, output shown) of each `$ ` line of the README's console blocks."""
    found = []
    for block in CONSOLE.findall(text):
        for chunk in re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]:
            command, _, output = chunk.partition("\n")
            found.append((command, output))
    return found


def normal(output: str) -> str:
    return _CLOCK.sub("HH:MM:SS ", output)


def test_the_readme_is_short_and_opens_with_its_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 150
    first = re.search(r"```sh\n(.*?)```", text, re.DOTALL)
    assert first is not None
    install, tests = first[1].strip().splitlines()
    assert install.startswith("pip install -e . && atropos serve")
    assert tests.startswith("pip install -e '.[test]' && pytest")


@pytest.mark.process
def test_the_five_minutes_answer_what_the_readme_shows(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    for name in ("config.json.example", "compression.json.example"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copy(REAL / "tau-bench" / "gpt-4o-airline.json", tmp_path)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    text = README.read_text()
    (serve, _), *rest = steps(text)
    assert serve.startswith("atropos serve ")
    hub = HubProcess(tmp_path / "config.json.example",
                     *shlex.split(serve)[4:], env={"HOME": str(home),
                                                   "ATROPOS_TRACE_SERVER__PORT": "0"})
    hub.start(timeout=120)
    address = hub.url.removeprefix("http://")

    def as_shown(output: str) -> str:
        output = output.replace(str(home), "~").replace(address, _DEFAULT_ADDRESS)
        output = _PROGRESS.sub("", output)
        return output if output.endswith("\n") or not output else output + "\n"

    def settled() -> bool:
        stages = httpx.get(f"{hub.url}/v1/stats", timeout=30).json()["by_stage"]
        return not {"received", "accepted"} & set(stages)

    answers = []
    try:
        for command, _ in rest:
            wait_until(settled, timeout=120, what="the stages to take up every trace")
            run = command.replace("localhost:8000", address).replace(_DEFAULT_ADDRESS, address)
            done = subprocess.run(["bash", "-c", run], cwd=tmp_path, env=env, timeout=300,
                                  capture_output=True, text=True, check=False)
            assert done.returncode == 0, f"{command}\n{done.stderr}"
            printed = done.stdout + "".join(
                line + "\n" for line in done.stderr.splitlines() if " INFO " not in line)
            answers.append(as_shown(printed))
        served = as_shown("".join(line for line in hub.lines if "INFO atropos:" in line))
    finally:
        hub.stop()
    shown = [out for _, out in steps(text)]
    real = [served, *answers]
    if os.environ.get("ATROPOS_WRITE_README") == "1":
        README.write_text(_rewritten(text, real))
        return
    for (command, _), want, got in zip(steps(text), shown, real):
        assert normal(got) == normal(want), f"$ {command}"


def _rewritten(text: str, outputs: list[str]) -> str:
    """The README with each command's output replaced by `outputs`, in order."""
    answers = iter(outputs)

    def block(match: re.Match[str]) -> str:
        chunks = re.split(r"^\$ ", match[1], flags=re.MULTILINE)
        out = chunks[0]
        for chunk in chunks[1:]:
            command = chunk.partition("\n")[0]
            out += f"$ {command}\n{next(answers)}"
        return f"```console\n{out}```"

    return CONSOLE.sub(block, text)
