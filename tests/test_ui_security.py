"""The dashboard under attack, replayed as a reviewer found each hole: a real hub
(`atropos serve`, uvicorn on 127.0.0.1) with auth on, a real chromium (Playwright),
and, as the attacker, a second HTTP server on another port of 127.0.0.1: cookies are
scoped by host, not port, so its pages are same-site with the hub, receive the hub's
cookies and may set cookies for it."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.waiting import wait_until

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("no /usr/bin/chromium (apt-get install -y chromium)", allow_module_level=True)

from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright  # noqa: E402

pytestmark = pytest.mark.process

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
AUTH = {"enabled": True, "key_cache_seconds": 0}


# --- the attacker's server -----------------------------------------------------------


class Attacker:
    """An HTTP server on 127.0.0.1 (another port than the hub's): it serves the pages it
    is given, answers /bounce with a 307 to `bounce_to`, and records every Cookie header
    a browser sent it."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
        self.cookies: list[str] = []
        self.bounce_to = ""
        attacker = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                attacker.cookies.append(self.headers.get("Cookie", ""))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                path = self.path.split("?")[0]
                if path == "/bounce":
                    # 307 keeps the method and the body: the browser posts the form on
                    # to the hub, with Origin: null (a cross-origin redirect).
                    self.send_response(307)
                    self.send_header("Location", attacker.bounce_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body, headers = attacker.pages.get(path, ("not here", []))
                self.send_response(200 if path in attacker.pages else 404)
                self.send_header("Content-Type", "text/html")
                for name, value in headers:
                    self.send_header(name, value)
                data = body.encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    server = Attacker()
    yield server
    server.close()


# --- the hub and the browser ---------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubProcess]:
    directory = tmp_path_factory.mktemp("ui-security")
    config = write_config(directory, {"db_path": str(directory / "traces.db")}, auth=AUTH)
    hub = HubProcess(config, "--no-workers").start()
    yield hub
    hub.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context()
    yield context
    context.close()


def new_key(hub: HubProcess, scope: str, name: str) -> str:
    made = run_cli("keys", "create", "--config", str(hub.config), "--scope", scope,
                   "--name", name)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def db_path(hub: HubProcess) -> str:
    return str(json.loads(hub.config.read_text())["trace_server"]["db_path"])


def sign_in(page: Page, hub: HubProcess, key: str) -> None:
    page.goto(f"{hub.url}/ui/login")
    page.fill("input[name=key]", key)
    page.locator("form.login button").click()
    page.wait_for_url(re.compile(r"/ui$"))


def a_trace(hub: HubProcess, admin: str) -> str:
    with hub.client() as client:
        r = client.post("/v1/traces", json=native_trace(), headers=bearer(admin))
        assert r.status_code == 202, r.text
        return str(r.json()["trace_id"])


def session_cookie(context: BrowserContext) -> dict[str, Any]:
    [cookie] = [c for c in context.cookies() if "atropos_session" in c["name"]]
    return dict(cookie)


# --- 4: the cookie is a session, not the key ----------------------------------------


def test_another_server_on_the_host_gets_a_session_id_that_opens_nothing_on_the_api(
    guarded: HubProcess, context: BrowserContext, attacker: Attacker
) -> None:
    """The admin signs in, then opens a page of another server on the same host (a
    notebook, TensorBoard): the browser sends it the hub's cookie. It used to be the
    API key itself, a bearer on all of /v1 including /v1/runs, valid after logout."""
    admin = new_key(guarded, "admin", "admin")
    page = context.new_page()
    sign_in(page, guarded, admin)
    cookie = session_cookie(context)
    assert cookie["name"] == "atropos_session"  # plain HTTP: no __Host- prefix, no Secure
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    assert cookie["expires"] > 0  # a lifetime (auth.session_hours), not for ever

    # The cookie's path is /ui: any server's /ui pages get it.
    attacker.pages["/ui/notebook"] = ("<p>a notebook</p>", [])
    page.goto(f"{attacker.url}/ui/notebook")
    stolen = wait_until(lambda: [c for c in attacker.cookies if "atropos_session" in c],
                        what="the hub's cookie at the other server")[0]
    session_id = stolen.split("atropos_session=", 1)[1].split(";")[0]
    assert admin not in stolen and "ath_" not in stolen
    assert session_id == cookie["value"]
    # The database keeps only the session's hash, bound to the key's id.
    with sqlite3.connect(db_path(guarded)) as conn:
        rows = conn.execute("SELECT session_hash, key_id, expires_at, revoked_at "
                            "FROM dashboard_sessions").fetchall()
    assert [(h, k) for h, k, _, _ in rows] == [
        (hashlib.sha256(session_id.encode()).hexdigest(), admin.split("_")[1])]

    with httpx.Client(base_url=guarded.url) as client:
        for path in ("/v1/stats", "/v1/traces", "/v1/runs", "/v1/batches"):
            r = client.get(path, headers=bearer(session_id))
            assert r.status_code == 401, (path, r.text)
    # As a cookie it opens the dashboard (that is what a session is) ...
    with httpx.Client(base_url=guarded.url, cookies={"atropos_session": session_id}) as c:
        assert c.get("/ui").status_code == 200

    # ... until the admin logs out: then it is refused, on the server.
    page.goto(f"{guarded.url}/ui")
    page.click("text=Log out")
    page.wait_for_url(re.compile(r"/ui/login$"))
    with httpx.Client(base_url=guarded.url, cookies={"atropos_session": session_id}) as c:
        r = c.get("/ui")
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")
    with sqlite3.connect(db_path(guarded)) as conn:
        assert conn.execute("SELECT revoked_at FROM dashboard_sessions").fetchone()[0]


def test_revoking_the_key_ends_its_sessions(guarded: HubProcess, context: BrowserContext) -> None:
    reader = new_key(guarded, "read", "short-lived")
    page = context.new_page()
    sign_in(page, guarded, reader)
    assert page.locator("h1").inner_text() == "Overview"
    revoked = run_cli("keys", "revoke", "--config", str(guarded.config), reader.split("_")[1])
    assert revoked.returncode == 0, revoked.stderr
    page.goto(f"{guarded.url}/ui")
    page.wait_for_url(re.compile(r"/ui/login\?next="))


def test_behind_a_trusted_tls_proxy_the_cookie_is_host_prefixed_and_secure(
    tmp_path: Path, guarded: HubProcess
) -> None:
    """The hub knows a request came over TLS from its scheme: X-Forwarded-Proto, believed
    only from trace_server.forwarded_allow_ips."""
    config = write_config(tmp_path, {"db_path": db_path(guarded),
                                     "forwarded_allow_ips": ["127.0.0.1"]}, auth=AUTH)
    proxied = HubProcess(config, "--no-workers").start()
    key = new_key(guarded, "read", "behind-proxy")
    try:
        for hub, tls in ((proxied, True), (guarded, False)):
            with httpx.Client(base_url=hub.url, headers={"X-Forwarded-Proto": "https"}) as c:
                login = c.get("/ui/login")
                token = re.search(r'name="csrf_token" value="([^"]+)"', login.text)
                assert token is not None
                # As a browser on https sends it back (httpx keeps Secure cookies for
                # https URLs, and this one is http: the proxy's side).
                form_cookie = login.headers["set-cookie"].split(";")[0]
                r = c.post("/ui/login", data={"csrf_token": token[1], "key": key},
                           headers={"Cookie": form_cookie})
                assert r.status_code == 303, r.text
                set_cookie = r.headers["set-cookie"].lower()
                if tls:
                    assert set_cookie.startswith("__host-atropos_session=")
                    assert "; secure" in set_cookie and "; path=/;" in set_cookie
                    assert "domain=" not in set_cookie
                else:  # a client's own X-Forwarded-Proto is not believed
                    assert set_cookie.startswith("atropos_session=")
                    assert "secure" not in set_cookie
    finally:
        proxied.kill()


def test_the_login_page_says_what_the_cookie_holds(guarded: HubProcess) -> None:
    with httpx.Client(base_url=guarded.url) as client:
        text = client.get("/ui/login").text
    assert "never the key" in text and "session" in text


# --- 6: CSRF from a same-site page, framing ------------------------------------------


def test_a_planted_token_and_a_307_from_a_same_site_page_save_no_review(
    guarded: HubProcess, context: BrowserContext, attacker: Attacker
) -> None:
    """The attack as found: the page on another port plants a form token in a cookie
    for the hub's host, then posts a review with that token through its own 307, so
    that the browser re-posts it to the hub with Origin: null."""
    admin = new_key(guarded, "admin", "csrf-admin")
    trace_id = a_trace(guarded, admin)
    page = context.new_page()
    sign_in(page, guarded, admin)
    attacker.bounce_to = f"{guarded.url}/ui/traces/{trace_id}"
    planted = "p" * 43
    attacker.pages["/"] = (
        f"""<form id="f" method="post" action="{attacker.url}/bounce">
        <input name="csrf_token" value="{planted}"><input name="label" value="good">
        <input name="reward" value="1000000"></form>
        <script>document.getElementById("f").submit()</script>""",
        [("Set-Cookie", f"atropos_csrf={planted}; Path=/ui")],
    )
    with page.expect_response(re.compile(re.escape(attacker.bounce_to))) as answer:
        page.goto(f"{attacker.url}/")
    response = answer.value
    assert response.status == 403
    assert "another site" in response.text()
    # The planted cookie reached the hub: only the token's binding refused it.
    assert any(c["name"] == "atropos_csrf" and c["value"] == planted
               for c in context.cookies(f"{guarded.url}/ui/traces"))

    # The same form without the redirect (Origin: the attacker's) is refused too ...
    attacker.pages["/direct"] = (
        f"""<form id="f" method="post" action="{attacker.bounce_to}">
        <input name="csrf_token" value="{planted}"><input name="label" value="good">
        <input name="reward" value="1000000"></form>
        <script>document.getElementById("f").submit()</script>""", [])
    with page.expect_response(re.compile(re.escape(attacker.bounce_to))) as answer:
        page.goto(f"{attacker.url}/direct")
    assert answer.value.status == 403

    # ... and so is the planted token without any Origin (a client that sends none).
    session = session_cookie(context)["value"]
    with httpx.Client(base_url=guarded.url, cookies={"atropos_session": session,
                                                     "atropos_csrf": planted}) as client:
        r = client.post(f"/ui/traces/{trace_id}",
                        data={"csrf_token": planted, "label": "good", "reward": "1000000"})
        assert r.status_code == 403 and "did not come from this dashboard" in r.text
        stored = client.get(f"/v1/traces/{trace_id}", headers=bearer(admin)).json()
    assert stored["review"] is None and stored["reward"] != 1_000_000

    # The dashboard's own form still saves, with the session's token.
    page.goto(f"{guarded.url}/ui/traces/{trace_id}")
    page.check("input[name=label][value=good]")
    page.click("text=Save review")
    page.wait_for_url(re.compile(r"saved=1"))
    with httpx.Client(base_url=guarded.url) as client:
        assert client.get(f"/v1/traces/{trace_id}",
                          headers=bearer(admin)).json()["review"]["label"] == "good"


def test_no_page_of_the_dashboard_can_be_framed(
    guarded: HubProcess, context: BrowserContext, attacker: Attacker
) -> None:
    admin = new_key(guarded, "admin", "frame-admin")
    page = context.new_page()
    sign_in(page, guarded, admin)
    attacker.pages["/"] = (f'<iframe id="hub" src="{guarded.url}/ui"></iframe>', [])
    refused: list[str] = []
    page.on("console", lambda m: refused.append(m.text))
    page.goto(f"{attacker.url}/")
    frame = page.frame_locator("#hub")
    wait_until(lambda: any("frame-ancestors" in m or "X-Frame-Options" in m for m in refused),
               what="chromium refusing to frame the dashboard")
    # Nothing of the hub's page in the frame (chromium shows its own error page there).
    assert "Overview" not in frame.locator("body").inner_text()


# --- 12, 13, 15: headers, the login problem, the review note --------------------------


def test_pages_say_how_they_may_be_used(guarded: HubProcess) -> None:
    admin = new_key(guarded, "admin", "headers-admin")
    trace_id = a_trace(guarded, admin)
    with httpx.Client(base_url=guarded.url) as client:
        for path in ("/ui/login", "/ui", "/ui/static/style.css", "/ui/no-such-page"):
            r = client.get(path)
            assert r.headers["x-frame-options"] == "DENY", path
            assert r.headers["x-content-type-options"] == "nosniff", path
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"], path
        for path in ("/docs", "/redoc"):
            r = client.get(path)
            assert r.status_code == 200 and r.headers["x-frame-options"] == "DENY"
        r = client.get(f"/v1/traces/{trace_id}", headers=bearer(admin))
        assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
        signed_in(client, admin)
        r = client.get(f"/ui/traces/{trace_id}?download=original")
        assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
        assert r.headers["cache-control"] == "no-store"
        assert r.headers["x-content-type-options"] == "nosniff"


def signed_in(client: httpx.Client, key: str) -> None:
    """Sign in with an HTTP client as the login form does: the session in its jar."""
    login = client.get("/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', login.text)
    assert token is not None
    r = client.post("/ui/login", data={"csrf_token": token[1], "key": key})
    assert r.status_code == 303, r.text
    assert "atropos_session" in r.cookies


def test_the_login_page_shows_only_the_hubs_own_problems(guarded: HubProcess) -> None:
    forged = "Your key expired. Paste it at https://evil.example/renew to keep access."
    with httpx.Client(base_url=guarded.url) as client:
        page = client.get("/ui/login", params={"problem": forged}).text
        assert "evil.example" not in page and 'role="alert"' not in page
        known = client.get("/ui/login", params={"problem": "invalid_key"}).text
        assert "That key is not valid" in known
        # What a wrong key leads to: the code, mapped to the hub's words.
        login = client.get("/ui/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', login.text)
        assert token is not None
        r = client.post("/ui/login", data={"csrf_token": token[1], "key": "ath_wrong"})
        assert r.status_code == 303 and "problem=invalid_key" in r.headers["location"]


def test_the_review_form_holds_notes_to_the_apis_bound(guarded: HubProcess) -> None:
    admin = new_key(guarded, "admin", "notes-admin")
    trace_id = a_trace(guarded, admin)
    with httpx.Client(base_url=guarded.url) as client:
        signed_in(client, admin)
        page = client.get(f"/ui/traces/{trace_id}").text
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token is not None
        r = client.post(f"/ui/traces/{trace_id}",
                        data={"csrf_token": token[1], "label": "good", "note": "n" * 60_000})
        assert r.status_code == 422 and "note" in r.text
        assert client.get(f"/v1/traces/{trace_id}", headers=bearer(admin)).json()["review"] is None
        r = client.post(f"/ui/traces/{trace_id}",
                        data={"csrf_token": token[1], "label": "good", "note": "n" * 10_000})
        assert r.status_code == 303
        review = client.get(f"/v1/traces/{trace_id}", headers=bearer(admin)).json()["review"]
        assert len(review["note"]) == 10_000
