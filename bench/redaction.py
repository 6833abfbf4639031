"""What redaction costs on the ingest hot path: Preparer.row on a 5 KB trace with
privacy.redact_secrets on and off (with and without secrets in it), and
Redactor.redact alone on a 5 KB and a 1 MB trace, against the same patterns run with
Python's `re` (what detect-secrets-style scanners use), line by line.

    python bench/redaction.py [--repeat N]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import EnvironmentConfig, LimitsConfig, PrivacyConfig  # noqa: E402
from app.evaluation.environment import Environment  # noqa: E402
from app.evaluation.redaction import _SECRETS, Redactor  # noqa: E402
from app.ingest.ingestor import Preparer  # noqa: E402
from app.tokens import encoding  # noqa: E402

SECRET_LINE = "OPENAI_API_KEY=sk-proj-Fake0penAIkey1234567890abcdefGHIJ"


def trace(size: int, secret: bool) -> dict[str, Any]:
    """A native trace of about `size` bytes: shell steps with ordinary output."""
    steps: list[dict[str, Any]] = []
    i = 0
    while sum(len(str(s)) for s in steps) < size:
        out = " ".join(f"compiling src/pkg_{i}/module_{j}.py ok" for j in range(8))
        if secret and i == 3:
            out += "\n" + SECRET_LINE
        steps += [
            {"type": "action", "tool": "terminal", "call_id": f"c{i}",
             "arguments": {"command": f"make target_{i}"}},
            {"type": "observation", "call_id": f"c{i}", "content": out, "exit_code": 0},
        ]
        i += 1
    steps.append({"type": "final", "content": "The build passes."})
    return {"task": "Fix the build", "steps": steps, "outcome": {"status": "success"}}


def per_call(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6  # microseconds


def python_re_lines(value: dict[str, Any]) -> Callable[[], Any]:
    """The same patterns compiled with `re`, run on every line of every string."""
    patterns = [re.compile(kind.pattern) for kind in _SECRETS]

    def strings(v: Any) -> Any:
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            for item in v.values():
                yield from strings(item)
        elif isinstance(v, list):
            for item in v:
                yield from strings(item)

    def scan() -> int:
        return sum(
            1 for s in strings(value) for line in s.splitlines() for p in patterns
            if p.search(line)
        )

    return scan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    encoding()
    environment = Environment.from_config(EnvironmentConfig())
    on = Preparer(environment, LimitsConfig(), Redactor(PrivacyConfig()))
    off = Preparer(environment, LimitsConfig(), Redactor(PrivacyConfig(redact_secrets=False)))
    redactor = Redactor(PrivacyConfig())
    print(f"# python bench/redaction.py --repeat {args.repeat}")
    print("Preparer.row, 5 KB native trace (microseconds per trace):")
    for secret in (False, True):
        item = trace(5_000, secret)
        # Interleaved rounds, best of each: the machine's load changes between rounds.
        t_off = t_on = float("inf")
        for _ in range(5):
            t_off = min(t_off, per_call(lambda item=item: off.row(item), args.repeat // 5))
            t_on = min(t_on, per_call(lambda item=item: on.row(item), args.repeat // 5))
        print(f"  secrets in it: {secret!s:5}  redaction off {t_off:8.1f}  on {t_on:8.1f}  "
              f"cost {t_on - t_off:+7.1f} ({(t_on - t_off) / t_off:+.1%})")
    print("Redactor.redact alone (microseconds per trace):")
    for size, repeat in ((5_000, args.repeat), (1_000_000, max(args.repeat // 100, 3))):
        for secret in (False, True):
            item = trace(size, secret)
            t_re2 = per_call(lambda item=item: redactor.redact(item), repeat)
            t_re = per_call(python_re_lines(item), repeat)
            print(f"  {size // 1000:5d} KB  secrets in it: {secret!s:5}  RE2 pre-check+rewrite "
                  f"{t_re2:10.1f}   python re, line by line {t_re:10.1f}")


if __name__ == "__main__":
    main()
