"""The dashboard in a real browser: Playwright driving Debian's chromium against a live
hub holding the real corpus (../shared/fixtures/real, imported with `atropos import`
and compressed by `atropos worker --burst`).

Every page visited is checked for console errors, and saved as a screenshot under
artifacts/ui/ (1280x720, and phone width for the main pages) for a person to look at.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import REAL, ROOT
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.waiting import wait_until

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():  # .ci/run installs it; a developer without it skips these
    pytest.skip("no /usr/bin/chromium (apt-get install -y chromium)", allow_module_level=True)

from playwright.sync_api import Browser, Locator, Page, ViewportSize, expect, sync_playwright  # noqa: E402

pytestmark = pytest.mark.process

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "artifacts" / "ui"
DESKTOP: ViewportSize = {"width": 1280, "height": 720}
PHONE: ViewportSize = {"width": 390, "height": 844}
THRESHOLD = 5
# Nothing is batched while the corpus is prepared: the test of labelling forms the
# batch itself.
NO_BATCHES = 1_000_000


def distributor(directory: Path, batch_size: int) -> dict[str, Any]:
    return {"target": "jsonl", "batch_size": batch_size, "min_reward_threshold": THRESHOLD,
            "output_dir": str(directory / "batches")}


# --- the corpus, prepared once per test session ------------------------------------


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A SQLite file with the real corpus imported and compressed. xdist workers share
    one (made by the first under a file lock); each test module works on a copy."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    done = shared / "ui-corpus" / "traces.db"
    with open(shared / "ui-corpus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            work = shared / "ui-corpus-work"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            config = write_config(work, {"db_path": str(work / "traces.db")},
                                  distributor=distributor(work, NO_BATCHES))
            imported = run_cli("import", "--config", str(config), str(REAL))
            assert imported.returncode == 0, imported.stderr
            compressed = run_cli("worker", "--config", str(config), "--compression",
                                 str(ROOT / "compression.json.example"), "--burst")
            assert compressed.returncode == 0, compressed.stderr
            done.parent.mkdir(exist_ok=True)
            shutil.copy(work / "traces.db", done)
    return done


@pytest.fixture(scope="module")
def store(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """This module's copy of the corpus: its trace_server section."""
    directory = tmp_path_factory.mktemp("ui")
    shutil.copy(corpus, directory / "traces.db")
    return {"db_path": str(directory / "traces.db")}


@pytest.fixture(scope="module")
def hub(store: dict[str, Any]) -> Iterator[HubProcess]:
    directory = Path(store["db_path"]).parent
    config = write_config(directory, store, distributor=distributor(directory, NO_BATCHES))
    hub = HubProcess(config, "--no-workers").start()
    yield hub
    hub.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


class Visit:
    """A browser tab on the hub that records console errors and takes screenshots."""

    def __init__(self, browser: Browser, base_url: str, viewport: ViewportSize) -> None:
        self.context = browser.new_context(base_url=base_url, viewport=viewport)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def shot(self, name: str) -> None:
        """The whole page, or for a long one (a trace of hundreds of steps) what a
        person sees first."""
        SHOTS.mkdir(parents=True, exist_ok=True)
        tall = self.page.evaluate("document.documentElement.scrollHeight") > 4000
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=not tall)


@pytest.fixture
def visit(browser: Browser, hub: HubProcess) -> Iterator[Visit]:
    tab = Visit(browser, hub.url, DESKTOP)
    yield tab
    tab.context.close()
    assert tab.errors == [], "console errors: " + "; ".join(tab.errors)


@pytest.fixture
def page(visit: Visit) -> Page:
    return visit.page


def trace_of(store: dict[str, Any], origin: str) -> str:
    """The trace_id of the imported trace whose source location ends with `origin`."""
    with sqlite3.connect(store["db_path"]) as conn:
        [(trace_id,)] = conn.execute(
            "SELECT trace_id FROM trace_payloads WHERE json_extract(trace, "
            "'$.metadata.imported_from.location') LIKE ?", (f"%{origin}",)).fetchall()
    return str(trace_id)


def one(store: dict[str, Any], sql: str, *params: Any) -> Any:
    with sqlite3.connect(store["db_path"]) as conn:
        return conn.execute(sql, params).fetchone()[0]


# --- the pages ---------------------------------------------------------------------


def test_the_overview_counts_are_the_stats(visit: Visit, hub: HubProcess) -> None:
    page = visit.page
    page.goto("/ui")
    stats = httpx.get(f"{hub.url}/v1/stats").json()

    def figure(name: str) -> int:
        return int(page.locator(f"[data-stat={name}]").inner_text().replace(",", ""))

    def table(section: str) -> dict[str, int]:
        rows = page.locator(f"#{section} tbody tr")
        return {rows.nth(i).locator("th").inner_text():
                int(rows.nth(i).locator(".figure").inner_text().replace(",", ""))
                for i in range(rows.count())}

    assert stats["traces"] > 900
    assert figure("traces") == stats["traces"]
    assert figure("total_tokens") == stats["total_tokens"]
    assert figure("compressed") == stats["compression"]["compressed"] > 0
    assert figure("batches") == stats["batches"]["total"]
    assert table("by-stage") == stats["by_stage"]
    assert table("by-status") == stats["by_status"]
    expect(page.locator("figure.chart svg polyline").first).to_be_attached()
    visit.shot("overview")
    page.select_option("select[name=range]", "24h")
    page.click("form.filters button")
    expect(page).to_have_url(re.compile(r"range=24h"))


def test_the_overview_shows_the_environments_reward(visit: Visit, hub: HubProcess) -> None:
    """Most imported traces are `unknown` by design: beside them, what the environments
    said (their reward's spread, its mean, the share that reaches the threshold)."""
    page = visit.page
    page.goto("/ui")
    env = httpx.get(f"{hub.url}/v1/stats").json()["env_reward"]
    assert env["traces"] > 0 and len(env["histogram"]) == 10
    section = page.locator("#env-reward")
    expect(section.locator("[data-stat=env_traces]")).to_have_text(f"{env['traces']:,}")
    expect(section.locator("[data-stat=env_passing]")).to_contain_text(
        f"{100 * env['passing_share']:.1f}%")
    expect(section.locator("[data-stat=env_passing]")).to_contain_text(f"({env['passing']:,})")
    expect(section).to_contain_text(f"Reach the threshold ({THRESHOLD:g})")
    expect(section).to_contain_text("not a failure")  # the unknown ones, explained
    bars = section.locator("#env-histogram tbody tr")
    expect(bars).to_have_count(10)
    shown = sum(int(bars.nth(i).locator(".figure").inner_text().replace(",", ""))
                for i in range(10))
    assert shown == env["traces"] == sum(b["traces"] for b in env["histogram"])
    visit.shot("overview-env-reward")


def test_the_list_shows_task_and_answer_and_a_search_its_matches(
    visit: Visit, hub: HubProcess
) -> None:
    page = visit.page
    page.goto("/ui/traces?limit=25")
    api = httpx.get(f"{hub.url}/v1/traces", params={"limit": 25}).json()["traces"]
    rows = page.locator("tr.trace")
    expect(rows).to_have_count(25)
    for i in (0, 24):
        expect(rows.nth(i).locator("td.gist .task")).to_have_text(api[i]["task"] or "—")
        answer = api[i]["final_answer"]
        expect(rows.nth(i).locator("td.gist .answer")).to_have_text(
            f"→ {answer if answer is not None else 'no final answer'}")
    assert all(len(t["task"] or "") <= 120 for t in api)

    page.fill("input[name=q]", "the")
    page.click("form.filters button[type=submit]")
    expect(page).to_have_url(re.compile(r"q=the"))
    found = httpx.get(f"{hub.url}/v1/traces", params={"q": "the", "limit": 25}).json()
    assert found["matches"] > 25  # more than a page: the count is of all of them
    expect(page.locator("#matches")).to_contain_text(f"{found['matches']:,} traces match")
    snippets = page.locator("td.gist .snippet")
    expect(snippets.first).to_be_visible()
    for i in range(snippets.count()):
        assert "the" in snippets.nth(i).inner_text().lower()
    visit.shot("traces-search")


def test_filtering_to_timeouts_shows_the_openhands_run(
    visit: Visit, store: dict[str, Any]
) -> None:
    page = visit.page
    ponyc = trace_of(store, "ponyc-4588.jsonl:1")
    page.goto("/ui/traces")
    visit.shot("traces")
    page.select_option("select[name=status]", "timeout")
    page.click("form.filters button[type=submit]")
    expect(page).to_have_url(re.compile(r"status=timeout"))
    rows = page.locator("tr.trace")
    assert rows.count() == one(store, "SELECT count(*) FROM traces WHERE status = 'timeout'")
    for i in range(rows.count()):
        expect(rows.nth(i).locator(".badge.status-timeout")).to_have_text("timeout")
    visit.shot("traces-timeout")

    page.click(f"a[href='/ui/traces/{ponyc}']")
    expect(page.locator("h1")).to_contain_text(ponyc)
    header = page.locator(".trace-header")
    expect(header.locator(".badge.status-timeout")).to_have_text("timeout")
    expect(header).to_contain_text("maximum iteration")
    failed = page.locator("#steps article.step.failed")
    assert failed.count() > 0
    expect(page.locator("#steps .badge.flag-error", has_text="tool error").first).to_be_visible()
    expect(page.locator("#steps .badge.flag-error", has_text="exit code").first).to_be_visible()
    expect(page.locator("#rewards tr.fired", has_text="timeout")).to_be_visible()
    visit.shot("trace-openhands-timeout")


def test_rejections_point_at_their_steps(visit: Visit, store: dict[str, Any]) -> None:
    page = visit.page
    # Line 4 repeats one action 46 times: its loop fires the loop rule, and its run of
    # "Nothing happens." the tool-error-streak filter, which names the step.
    page.goto(f"/ui/traces/{trace_of(store, 'KnowAgentALFWorld_llama-2-13b_D0.lines-1-60.jsonl:4')}")
    expect(page.locator("#rewards tr.fired", has_text="loop_detected")).to_be_visible()
    link = page.locator("#rejections a", has_text="at step")
    expect(link).to_have_count(1)
    link.click()
    step = page.locator("article.step:target")
    expect(step).to_contain_text("rejected here: tool_error_streak")
    visit.shot("trace-knowagent-line4")

    # A run that thinks the same thought three times: the repeated-thought rejection.
    page.goto(f"/ui/traces/{trace_of(store, 'KnowAgentALFWorld_llama-2-13b_D0.lines-1-60.jsonl:10')}")
    reason = page.locator("#rejections li", has_text="repeated_thought")
    expect(reason).to_contain_text("thought repeated 3 times")
    reason.locator("a").click()
    step = page.locator("article.step:target")
    expect(step).to_have_class(re.compile(r"step-thought"))
    expect(step).to_contain_text("rejected here: repeated_thought")
    visit.shot("trace-knowagent-repeated-thought")


def compression_of_the_smallest(page: Page, store: dict[str, Any], kind: str) -> Locator:
    """The side-by-side view of the smallest trace whose compression did `kind`."""
    trace_id = one(store, "SELECT trace_id FROM traces JOIN trace_payloads USING (trace_id) "
                   "WHERE compressed IS NOT NULL AND "
                   f"json_extract(compression, '$.removed.{kind}') > 0 "
                   "ORDER BY total_tokens LIMIT 1")
    page.goto(f"/ui/traces/{trace_id}#compression")
    return page.locator("#compression")


def test_a_compressed_trace_shows_both_sides(visit: Visit, store: dict[str, Any]) -> None:
    page = visit.page
    section = compression_of_the_smallest(page, store, "intermediate_thoughts")
    expect(section.locator("[role=columnheader]")).to_have_text(["Original", "Compressed"])
    removed = section.locator(".row-removed")
    assert removed.count() > 0
    expect(removed.first.locator(".original article.step")).to_be_visible()
    # What compression did, in words: a dropped thought, an elided output.
    expect(removed.first.locator(".compressed .badge.change-removed")).to_have_text(
        "thought dropped")
    elided = section.locator(".compressed .badge.kind-redundant_tool_outputs")
    assert elided.count() > 0
    expect(elided.first).to_have_text(re.compile(r"output elided: [\d,]+ tokens"))
    expect(section).to_contain_text("tokens of output elided …]")
    kept = section.locator(".row-kept")
    assert kept.count() > 0 and kept.first.locator("article.step").count() == 2
    visit.shot("trace-compressed")
    page.set_viewport_size(PHONE)
    visit.shot("phone-trace-compressed")


def test_collapsed_repeats_and_referenced_outputs_say_what_they_are(
    visit: Visit, store: dict[str, Any]
) -> None:
    section = compression_of_the_smallest(visit.page, store, "repeated_calls")
    expect(section).to_contain_text(re.compile(r"repeated calls collapsed [1-9]"))
    collapsed = section.locator(".row-removed .badge.kind-repeated_calls")
    assert collapsed.count() > 0
    expect(collapsed.first).to_have_text(re.compile(r"exact repeat of step \d+, collapsed into it"))
    # The first call's result says how many more times it came, and may be elided too.
    expect(section.locator(".compressed .badge.kind-repeat_counts").first).to_have_text(
        re.compile("the first of a repeated call: says how many times it came"))
    expect(section).to_contain_text("the same call, with the same result, was made")

    section = compression_of_the_smallest(visit.page, store, "repeated_observations")
    expect(section.locator(".compressed .badge.kind-repeated_observations").first).to_have_text(
        "the same output as an earlier step: a reference to it")
    expect(section).to_contain_text("[output identical to the output of step ")


def test_labelling_a_passing_trace_bad_keeps_it_out_of_the_next_batch(
    visit: Visit, hub: HubProcess, store: dict[str, Any]
) -> None:
    page = visit.page
    eligible = "stage IN ('compressed', 'compression_skipped') AND reward >= 5"
    trace_id = one(store, f"SELECT trace_id FROM traces WHERE {eligible} "
                   "ORDER BY created_at, trace_id LIMIT 1")
    page.goto(f"/ui/traces/{trace_id}")
    # By keyboard alone: to the "bad" label, then to the button.
    for _ in range(300):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.name === 'label'"):
            break
    page.keyboard.press("ArrowDown")  # the second radio of the group: bad
    expect(page.locator("input[name=label][value=bad]")).to_be_checked()
    page.locator("textarea[name=note]").fill("looks right but the answer is wrong")
    page.locator("textarea[name=note]").focus()
    for _ in range(5):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.type === 'submit'"):
            break
    page.keyboard.press("Enter")
    expect(page.locator("#review .notice")).to_have_text("Review saved.")
    expect(page.locator("#review .badge.label-bad")).to_be_visible()
    visit.shot("trace-reviewed-bad")

    # A batch of every eligible trace but one: the bad one is the one left out.
    waiting = one(store, f"SELECT count(*) FROM traces WHERE {eligible}")
    directory = Path(store["db_path"]).parent
    config = write_config(directory, store, distributor=distributor(directory, waiting - 1))
    formed = run_cli("worker", "--config", str(config), "--burst")
    assert formed.returncode == 0, formed.stderr
    batches = httpx.get(f"{hub.url}/v1/batches").json()["batches"]
    assert len(batches) == 1
    batch = httpx.get(f"{hub.url}/v1/batches/{batches[0]['batch_id']}").json()
    assert len(batch["trace_ids"]) == waiting - 1 and trace_id not in batch["trace_ids"]
    page.reload()
    expect(page.locator(".trace-header .badge.stage-batched, .trace-header .badge.stage-delivered")).to_have_count(0)
    page.goto(f"/ui/batches/{batch['batch_id']}")
    expect(page.locator("tbody tr")).to_have_count(waiting - 1)
    visit.shot("batch")


def test_the_review_queue_hands_out_the_next_trace(visit: Visit) -> None:
    page = visit.page
    page.goto("/ui/review")
    visit.shot("review-queue")
    page.select_option("select[name=status]", "failure")
    page.click("text=Start reviewing")
    expect(page).to_have_url(re.compile(r"/ui/traces/.+queue="))
    first = page.locator("h1 code").inner_text()
    expect(page.locator("#review .badge.status-failure, .trace-header .badge.status-failure")).not_to_have_count(0)
    page.check("input[name=label][value=good]")
    page.click("text=Save and next")
    expect(page).to_have_url(re.compile(r"/ui/traces/.+queue="))
    assert page.locator("h1 code").inner_text() != first
    page.click("#review button:has-text('Skip')")
    expect(page).to_have_url(re.compile(r"/ui/traces/.+queue="))


def test_the_queue_shows_what_to_judge_says_what_waits_and_lets_go_when_left(
    visit: Visit, store: dict[str, Any]
) -> None:
    page = visit.page
    waiting = one(store, "SELECT count(*) FROM traces WHERE status = 'success' AND trace_id "
                  "NOT IN (SELECT trace_id FROM reviews) AND trace_id NOT IN "
                  "(SELECT trace_id FROM review_claims WHERE expires_at >= datetime('now'))")
    page.goto("/ui/review?status=success")
    expect(page.locator("#queue-waiting")).to_have_text(
        f"{waiting:,} traces wait for review with these filters.")
    page.click("text=Start reviewing")
    expect(page).to_have_url(re.compile(r"/ui/traces/.+queue="))
    held = page.locator("h1 code").inner_text()
    review = page.locator("#review")
    # The task, the final answer and the form, together.
    task = one(store, "SELECT json_extract(trace, '$.task') FROM trace_payloads WHERE trace_id = ?",
               held)
    expect(review.locator("#queue-task pre").first).to_contain_text(task.strip()[:40])
    expect(review.locator("#queue-answer")).to_be_visible()
    expect(review.locator("form.review-form input[name=label]").first).to_be_visible()
    expect(review.locator("#queue-waiting")).to_contain_text(
        f"{waiting - 1:,} more traces wait in this queue after this one.")
    visit.shot("review-queue-trace")

    def holders() -> int:
        return int(one(store, "SELECT count(*) FROM review_claims WHERE trace_id = ?", held))

    assert holders() == 1
    page.goto("/ui/batches")  # the page is left: the hold goes with it
    wait_until(lambda: holders() == 0 or None, what="the hold to be released")
    page.goto("/ui/review?status=success")
    expect(page.locator("#queue-waiting")).to_contain_text(f"{waiting:,} traces wait")


def test_with_auth_off_no_page_speaks_of_keys(visit: Visit) -> None:
    page = visit.page
    for path in ("/ui", "/ui/traces?label=good", "/ui/review", "/ui/batches", "/ui/runs",
                 "/ui/atropos", "/ui/login"):
        page.goto(path)
        text = page.locator("body").inner_text()
        assert not re.search(r"\b(api )?keys?\b", text, re.IGNORECASE), (path, text[:500])


def test_batches_runs_and_atropos_pages(visit: Visit, hub: HubProcess, store: dict[str, Any]) -> None:
    page = visit.page
    with sqlite3.connect(store["db_path"]) as conn:
        conn.execute("INSERT INTO batches (batch_id, created_at, updated_at, size, target, "
                     "format, state, attempts, last_error) VALUES ('b-failed', "
                     "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 0, 'http', 'sharegpt', "
                     "'failed', 5, 'HTTP 503 from the trainer')")
    page.goto("/ui/batches?state=failed")
    expect(page.locator("tbody tr")).to_have_count(1)
    visit.shot("batches")
    page.click("text=b-failed")
    expect(page.locator(".problem")).to_contain_text("HTTP 503 from the trainer")
    page.click("text=Retry delivery")
    expect(page.locator(".notice")).to_contain_text("pending again")
    expect(page.locator(".badge.batch-pending")).to_be_visible()

    page.goto("/ui/runs")
    expect(page.locator("main")).to_contain_text("runs.enabled")
    visit.shot("runs")

    assert httpx.post(f"{hub.url}/register", json={
        "wandb_group": "g", "wandb_project": "p", "batch_size": 8, "max_token_len": 512,
        "checkpoint_dir": "/tmp/ckpt", "save_checkpoint_interval": 10, "starting_step": 0,
        "num_steps": 100}).status_code == 200
    assert httpx.get(f"{hub.url}/batch").status_code == 200  # the trainer has started
    assert httpx.post(f"{hub.url}/register-env", json={
        "max_token_length": 512, "desired_name": "gsm8k", "weight": 1.5,
        "group_size": 4}).status_code == 200
    page.goto("/ui/atropos")
    expect(page.locator("main")).to_contain_text("gsm8k")
    expect(page.locator("main table").first).to_contain_text("1.5")
    visit.shot("atropos")


def test_the_main_pages_at_phone_width(browser: Browser, hub: HubProcess, store: dict[str, Any]) -> None:
    tab = Visit(browser, hub.url, PHONE)
    try:
        for name, path in [("overview", "/ui"), ("traces", "/ui/traces"),
                           ("trace", f"/ui/traces/{trace_of(store, 'ponyc-4588.jsonl:1')}")]:
            tab.page.goto(path)
            # Nothing wider than the screen but the tables' own scrolling boxes.
            width = tab.page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"], f"{path} is {width} px wide"
            tab.shot(f"phone-{name}")
    finally:
        tab.context.close()
    assert tab.errors == []


def test_keyboard_users_can_skip_to_the_content(page: Page) -> None:
    page.goto("/ui/traces")
    page.keyboard.press("Tab")
    expect(page.locator(".skip")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"#main$"))


def test_the_api_docs_work_without_internet(visit: Visit, hub: HubProcess) -> None:
    page = visit.page
    outside: list[str] = []

    def only_the_hub(route: Any) -> None:
        if route.request.url.startswith(hub.url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_hub)
    page.goto("/docs")
    expect(page.locator(".opblock").first).to_be_visible(timeout=20_000)
    visit.shot("docs")
    page.goto("/redoc")
    expect(page.locator("h1", has_text="atropos-hub")).to_be_visible(timeout=20_000)
    visit.shot("redoc")
    assert outside == []


def test_the_root_sends_browsers_to_the_dashboard(page: Page, hub: HubProcess) -> None:
    page.goto("/")
    expect(page).to_have_url(f"{hub.url}/ui")
    assert httpx.get(f"{hub.url}/").json() == {"message": "AtroposLib API"}


# --- with auth on ------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(store: dict[str, Any]) -> Iterator[HubProcess]:
    """A second hub on the same database, with auth.enabled."""
    directory = Path(store["db_path"]).parent
    config = write_config(directory, store, auth={"enabled": True},
                          distributor=distributor(directory, NO_BATCHES))
    hub = HubProcess(config, "--no-workers").start()
    yield hub
    hub.kill()


def new_key(hub: HubProcess, scope: str, name: str) -> str:
    """A key made as a person makes one: `atropos keys create` (its last line)."""
    made = run_cli("keys", "create", "--config", str(hub.config), "--scope", scope,
                   "--name", name)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def test_with_auth_a_page_asks_for_a_key_once(browser: Browser, guarded: HubProcess) -> None:
    reader = new_key(guarded, "read", "viewer")
    reviewer = new_key(guarded, "review", "carol")
    tab = Visit(browser, guarded.url, DESKTOP)
    page = tab.page
    try:
        page.goto("/ui/traces?status=timeout")
        expect(page).to_have_url(re.compile(r"/ui/login\?next="))
        expect(page.locator("h1")).to_have_text("Sign in")
        tab.shot("login")
        page.fill("input[name=key]", "ath_000000000000_wrong")
        page.locator("form.login button").click()
        expect(page.locator(".problem")).to_contain_text("not valid")
        page.fill("input[name=key]", reader)
        page.locator("form.login button").click()
        expect(page).to_have_url(re.compile(r"/ui/traces\?status=timeout$"))
        assert page.locator("tr.trace").count() > 0
        [cookie] = [c for c in tab.context.cookies() if c["name"] == "atropos_session"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # no script reads either cookie

        # A read key cannot review: the form answers 403, naming the scope.
        page.click("tr.trace a >> nth=0")
        trace_id = page.locator("h1 code").inner_text()
        page.check("input[name=label][value=good]")
        page.click("text=Save review")
        expect(page.locator("h1")).to_contain_text("403")
        expect(page.locator(".problem")).to_contain_text("review")
        tab.shot("forbidden")
        page.goto("/ui/runs")  # admin's
        expect(page.locator("h1")).to_contain_text("403")

        page.goto("/ui")
        page.click("text=Log out")
        expect(page).to_have_url(re.compile(r"/ui/login$"))
        assert [c for c in tab.context.cookies() if c["name"] == "atropos_session"] == []
        page.goto("/ui")
        expect(page).to_have_url(re.compile(r"/ui/login"))

        # A review key reviews, recorded under its name; but not with a form that lacks
        # its token (as one sent from another site would), whatever the cookie.
        page.fill("input[name=key]", reviewer)
        page.locator("form.login button").click()
        forged = page.request.post(f"/ui/traces/{trace_id}", form={"label": "bad"})
        assert forged.status == 403 and "did not come from this dashboard" in forged.text()
        elsewhere = page.request.post(f"/ui/traces/{trace_id}", form={"label": "bad"},
                                      headers={"Origin": "https://evil.example"})
        assert elsewhere.status == 403 and "another site" in elsewhere.text()
        page.goto(f"/ui/traces/{trace_id}")
        expect(page.locator("#review")).to_contain_text("Not reviewed yet")
        page.check("input[name=label][value=good]")
        page.click("text=Save review")
        expect(page.locator("#review")).to_contain_text("by carol")
    finally:
        tab.context.close()
    # The 403 pages above are expected to show in the console as failed loads.
    assert [e for e in tab.errors if "403" not in e] == []
