"""`atropos doctor --tinker tinker.json`: the seed documents' troubleshooting as one
command. In order:

1. key     the variable tinker.api_key_env names is set (a warning for whitespace
           around it, which the hub strips but other tools may not)
2. url     the exact URL the hub will call, and why it has that shape
3. proxy   the proxy variables in effect, and whether the proxy that applies answers
4. chat    one minimal chat completion with tinker.model_id
(5. sdk    with tinker.backend `tinker`: the SDK is installed)

Each failure gets one actionable line naming the variable, URL or model involved.
Exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TextIO
from urllib.parse import urlsplit

import httpx

from app.cli.options import Commands, command
from app.config import TinkerConfig, load_tinker
from app.llm import LLMError, api_url, chat, chat_url, proxy_var, shown

PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY")
_PROXY_CONNECT_SECONDS = 3.0
_CHAT_TIMEOUT_SECONDS = 20.0


class _Report:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.failed = False

    def ok(self, check: str, text: str) -> None:
        self._line("ok  ", check, text)

    def warn(self, check: str, text: str) -> None:
        self._line("warn", check, text)

    def fail(self, check: str, text: str) -> None:
        self.failed = True
        self._line("FAIL", check, text)

    def _line(self, mark: str, check: str, text: str) -> None:
        print(f"{mark} {check:<6} {text}", file=self.out, flush=True)


async def diagnose(tinker: TinkerConfig, out: TextIO) -> int:
    """Run the checks, print one line each; 0 when all pass, else 1."""
    report = _Report(out)
    key_ok = _check_key(tinker, report)
    url = chat_url(tinker.base_url)
    _check_url(tinker, url, report)
    proxy_ok = await _check_proxy(url, report)
    if key_ok and proxy_ok:
        await _check_chat(tinker, report)
    else:
        report.fail("chat", "not tried: fix the failures above first")
    if tinker.backend == "tinker":
        _check_sdk(report)
    return 1 if report.failed else 0


def _check_key(tinker: TinkerConfig, report: _Report) -> bool:
    var = tinker.api_key_env
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        state = "not set" if raw is None else "empty"
        report.fail("key", f"the environment variable {var} (named by tinker.api_key_env) is "
                           f"{state}: export {var}=<your key for {shown(tinker.base_url.strip())}>")
        return False
    if raw != raw.strip():
        report.warn("key", f"{var} has whitespace around it (a pasted newline?); the hub strips "
                           f"it, other tools may not: export {var} again without it")
    report.ok("key", f"{var} is set ({len(raw.strip())} characters; the value is never shown)")
    return True


def _check_url(tinker: TinkerConfig, url: str, report: _Report) -> None:
    base = tinker.base_url.strip().rstrip("/")
    if url == base:
        why = "tinker.base_url is the full chat completions URL"
    elif url == f"{base}/chat/completions":
        why = "tinker.base_url ends at a version, so /chat/completions is appended"
    else:
        why = "tinker.base_url ends at the provider root, so /v1/chat/completions is appended"
    report.ok("url", f"POST {shown(url)} ({why}), model {tinker.model_id}")
    if tinker.backend == "openai":
        report.ok("url", f"training: POST {shown(api_url(base, 'files'))} and "
                         f"{shown(api_url(base, 'fine_tuning/jobs'))}")


async def _check_proxy(url: str, report: _Report) -> bool:
    present = [f"{v}={shown(os.environ[v]) if 'PROXY' in v and v != 'NO_PROXY' else os.environ[v]}"
               for name in PROXY_VARS for v in (name, name.lower()) if os.environ.get(v)]
    var = proxy_var(url)
    host = urlsplit(url).hostname or ""
    if var is None:
        settings = f" (set: {', '.join(present)})" if present else ""
        report.ok("proxy", f"none applies to {host}: a direct connection{settings}")
        return True
    proxy = os.environ[var]
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = parts.port or (443 if parts.scheme == "https" else 1080 if "socks" in parts.scheme
                          else 80)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, port), _PROXY_CONNECT_SECONDS
        )
    except (OSError, TimeoutError) as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        report.fail("proxy", f"the proxy named by {var} ({shown(proxy)}) does not answer "
                             f"({reason}): fix or unset {var}, or add {host} to NO_PROXY")
        return False
    writer.close()
    report.ok("proxy", f"requests to {host} go through {var}={shown(proxy)}, which answers")
    return True


async def _check_chat(tinker: TinkerConfig, report: _Report) -> None:
    # One try, bounded: the doctor diagnoses, it does not wait out an outage.
    once = tinker.model_copy(
        update={"retry": tinker.retry.model_copy(update={"max_attempts": 1}),
                "timeout_seconds": min(tinker.timeout_seconds, _CHAT_TIMEOUT_SECONDS)}
    )
    async with httpx.AsyncClient() as http:
        try:
            result = await chat(http, once, [{"role": "user", "content": "Say OK."}],
                                max_tokens=8, temperature=0)
        except LLMError as exc:
            report.fail("chat", str(exc))
            return
    report.ok("chat", f"model {tinker.model_id} answered at {result.url}: Model request "
                      f"completed: status={result.status}, tokens={result.total_tokens}")


def _check_sdk(report: _Report) -> None:
    try:
        import tinker  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        report.fail("sdk", "tinker.backend is 'tinker' but the tinker SDK is not installed: "
                           "pip install 'atropos-hub[tinker]'")
        return
    report.ok("sdk", "the tinker SDK is installed")


# --- the command ----------------------------------------------------------------


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    doctor = command(commands, "doctor", _doctor, config=None,
                     example="atropos doctor --tinker tinker.json")
    doctor.add_argument("--tinker", required=True, help="tinker.json")


async def _doctor(args: argparse.Namespace) -> int:
    return await diagnose(load_tinker(args.tinker).tinker, sys.stdout)
