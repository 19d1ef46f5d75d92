"""The operator views of a real worker: the JSON contract against docs/operating.md, stalls, /metrics,
400s, and the page in headless Chromium.

Each test plays the dependency groups itself: `relations` commits everything, `aggregates` stops at 2 on
partition 0, so payment (0, 2) waits on `aggregates` while every other payment is decided.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aml_app.kafka.tools import produce
from aml_app.tokens import COOKIE, session_cookie
from tests.chromium import Chromium
from tests.harness import ends_of, payments_for, wait_until

pytestmark = pytest.mark.integration

OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
PER_PARTITION = 5
HELD_AT = 2  # aggregates stops here on partition 0


def documented_fields() -> dict[str, dict[str, str]]:
    """The field tables of docs/operating.md's `/watermarks.json` section: object -> field -> type."""
    text = OPERATING.read_text()
    tables: dict[str, dict[str, str]] = {}
    for name, body in re.findall(r"<!-- json: (\w+) -->\n((?:\|.*\n)+)", text):
        rows = [line.split("|")[1:-1] for line in body.splitlines()[2:]]
        tables[name] = {cells[0].strip().strip("`"): cells[1].strip() for cells in rows}
    expected = {"top", "partitions", "dependencies", "gate"}
    assert set(tables) == expected, "docs/operating.md lost a field table"
    return tables


def has_type(value: Any, documented: str) -> bool:
    kind, _, nullable = documented.partition(" or ")
    if value is None:
        return nullable == "null"
    checks = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "list": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return checks[kind](value)


def check_contract(doc: dict[str, Any]) -> None:
    """Every documented field present with its documented type, and nothing undocumented."""
    fields = documented_fields()
    objects = [("top", doc)]
    objects += [("partitions", p) for p in doc["partitions"]]
    objects += [("dependencies", d) for d in doc["dependencies"]]
    if doc["gate"] is not None:
        objects.append(("gate", doc["gate"]))
    for name, obj in objects:
        assert set(obj) == set(fields[name]), (
            f"{name}: fields differ from docs/operating.md: {set(obj) ^ set(fields[name])}"
        )
        for field, documented in fields[name].items():
            assert has_type(obj[field], documented), f"{name}.{field} = {obj[field]!r} is not {documented}"


async def get(url: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, timeout=aiohttp.ClientTimeout(10), **kw) as r,
    ):
        return r.status, dict(r.headers), await r.read()


async def held_on_aggregates(names, producer, new_worker, deps, decision_log, **env: str):
    """A worker with payment (0, HELD_AT) waiting on aggregates, every other payment decided."""
    placed = await produce(producer, names.payments, payments_for(names.partitions, PER_PARTITION, "wv"))
    ends = ends_of(placed)
    worker = new_worker(**env)
    samples: list[dict[str, Any]] = []

    async def ready() -> dict | None:
        state = await worker.state()
        if state:
            samples.append(state)
        return state if state and not state["recovering"] and state["partitions"] else None

    await wait_until(ready, 60, "the worker to recover and see the table")
    for state in samples:  # while tables recover, the view shows no numbers rather than old ones
        if state["recovering"]:
            assert (state["partitions"], state["dependencies"], state["gate"]) == ([], [], None)

    # Nothing is committed yet and the records share batches, so Tansu's ListOffsets answers short of
    # the end: the log ends shown come from the worker's own fetches.
    async def log_ends_shown() -> bool:
        state = await worker.state()
        return bool(state) and [p["log_end"] for p in state["partitions"]] == [ends[p] for p in sorted(ends)]

    await wait_until(log_ends_shown, 30, "the log ends as the worker's fetches see them")
    relations, aggregates = names.deps
    await deps[relations].commit(ends)
    await deps[aggregates].commit({0: HELD_AT, **{p: ends[p] for p in range(1, names.partitions)}})
    committed_at = time.time()
    decided = {(p, o) for p, o in placed if p != 0 or o < HELD_AT}
    await decision_log.wait_for(decided, timeout=30)
    return worker, ends, decided, committed_at


async def settled(worker, names, ends) -> dict[str, Any]:
    """The state once the table shows the commits, our own commits and the wait at (0, HELD_AT)."""
    relations, aggregates = names.deps

    async def shown() -> dict | None:
        state = await worker.state()
        if not state or state["recovering"] or len(state["partitions"]) != names.partitions:
            return None
        parts = {p["partition"]: p for p in state["partitions"]}
        p0 = parts[0]
        ok = (
            p0["dependencies"] == {relations: ends[0], aggregates: HELD_AT}
            and p0["waiting_offset"] == HELD_AT
            and p0["service_committed"] == HELD_AT
            and all(parts[p]["service_committed"] == ends[p] for p in range(1, names.partitions))
            and all(parts[p]["log_end"] == ends[p] for p in parts)
        )
        return state if ok else None

    return await wait_until(shown, 30, "the table to show the commits and the wait")


async def test_json_contract_metrics_and_bad_parameters(names, producer, new_worker, deps, decision_log):
    worker, ends, decided, _ = await held_on_aggregates(names, producer, new_worker, deps, decision_log)
    relations, aggregates = names.deps
    state = await settled(worker, names, ends)
    check_contract(state)

    parts = {p["partition"]: p for p in state["partitions"]}
    p0 = parts[0]
    assert p0["watermark"] == HELD_AT and p0["lag"] == ends[0] - HELD_AT
    assert p0["payments_waiting"] == ends[0] - HELD_AT
    assert p0["in_flight"] == HELD_AT and p0["local"] is True
    assert p0["bottleneck"] == [aggregates]
    assert p0["dependency_lag"] == {relations: 0, aggregates: ends[0] - HELD_AT}
    assert p0["never_committed"] == []
    assert isinstance(p0["blocked_since"], float)
    for p in range(1, names.partitions):
        part = parts[p]
        assert part["dependencies"] == {relations: ends[p], aggregates: ends[p]}
        assert (part["watermark"], part["payments_waiting"], part["waiting_offset"]) == (ends[p], 0, None)
        assert part["in_flight"] is None and part["bottleneck"] == [relations, aggregates]
    by_group = {d["group"]: d for d in state["dependencies"]}
    assert [d["group"] for d in state["dependencies"]] == [relations, aggregates]
    assert by_group[relations]["status"] == "ok" and by_group[relations]["lag"] == 0
    assert by_group[aggregates]["status"] == "ok"  # AML_STALL_AFTER is 30 s here: not stalled yet
    assert by_group[aggregates]["holding_back"] == [0]
    assert by_group[aggregates]["committed"] == {"0": HELD_AT, **{str(p): ends[p] for p in range(1, 4)}}
    gate = state["gate"]
    assert gate["blocked_partitions"] == [0] and gate["payments_waiting"] == ends[0] - HELD_AT
    assert gate["admin_error"] is None and gate["refresh_age_s"] < 5
    assert (gate["stall_after_s"], gate["lag_warn"]) == (30.0, 1000)
    assert state["payments_handled"] == len(decided)
    assert "acct-" not in json.dumps(state), "payment contents leaked into the view"

    # /metrics, parsed by the Prometheus client's own parser
    status, headers, body = await get(f"{worker.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}

    def sample(name: str, **labels: str) -> float:
        family = families[name.removesuffix("_total").removesuffix("_count")]
        labels = {"service": "probe", **labels}
        found = [s.value for s in family.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, f"{name}{labels}: {found}"
        return found[0]

    assert sample("aml_watermark", partition="0") == HELD_AT
    assert sample("aml_watermark", partition="1") == ends[1]
    assert sample("aml_log_end_offset", partition="0") == ends[0]
    assert sample("aml_service_committed_offset", partition="0") == HELD_AT
    assert sample("aml_payments_waiting", partition="0") == ends[0] - HELD_AT
    assert sample("aml_dependency_committed_offset", dependency=aggregates, partition="0") == HELD_AT
    assert sample("aml_dependency_lag", dependency=aggregates, partition="0") == ends[0] - HELD_AT
    assert sample("aml_dependency_status", dependency=aggregates, status="ok") == 1
    assert sample("aml_dependency_stalled", dependency=aggregates) == 0
    assert sample("aml_blocked_partitions") == 1
    assert sample("aml_decisions_total") == len(decided)  # the probe: one decision per handled payment
    assert sample("aml_gate_wait_seconds_count") == len(decided)
    assert sample("aml_dead_lettered_total") == 0
    assert sample("aml_admin_refresh_seconds_count") > 0  # the only worker is the leader
    assert sample("aml_admin_refresh_errors_total") == 0
    assert "aml_alerts" not in families  # the probe has no detector
    assert families["aml_gate_wait_seconds"].type == "histogram"

    # bad parameters: a 400 with a sentence; good ones work
    for path in (
        "/watermarks.json?partition=x",
        "/watermarks.json?partition=9",
        "/watermarks.json?partition=0&partition=1",
        "/watermarks.json?verbose=1",
        "/watermarks/?refresh=0",
        "/metrics?name=x",
    ):
        status, headers, body = await get(worker.url + path)
        assert status == 400, path
        assert headers["Content-Type"].startswith("application/json")
        message = json.loads(body)["error"]
        assert message.endswith(".") and len(message.split()) > 4, message
    status, _, body = await get(f"{worker.url}/watermarks.json?partition=0,3")
    assert status == 200 and [p["partition"] for p in json.loads(body)["partitions"]] == [0, 3]

    # the page: self-contained, no external assets allowed by its policy; /watermarks redirects to it
    status, headers, body = await get(f"{worker.url}/watermarks", allow_redirects=False)
    assert status == 302 and headers["Location"] == "watermarks/"
    status, headers, body = await get(f"{worker.url}/watermarks")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert b"http://" not in body and b"https://" not in body

    # DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, names its own host; the
    # worker bound to loopback refuses it on every path, Faust's own included, and serves loopback names
    port = worker.url.rsplit(":", 1)[1]
    for path in ("/watermarks/", "/watermarks.json", "/metrics", "/router/", "/nowhere"):
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
            status, _, body = await get(worker.url + path, headers={"Host": host})
            assert status == 421, (path, host, status, body[:200])
            assert json.loads(body)["error"].startswith("This server listens on a loopback address")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        status, _, _ = await get(f"{worker.url}/metrics", headers={"Host": host})
        assert status == 200, host


async def test_stalled_within_the_configured_time_and_cleared_after(
    names, producer, new_worker, deps, decision_log
):
    stall_after = 2.0
    worker, ends, _, committed_at = await held_on_aggregates(
        names, producer, new_worker, deps, decision_log, AML_STALL_AFTER=str(stall_after)
    )
    relations, aggregates = names.deps

    async def status_of(group: str) -> tuple[float, dict[str, Any]] | None:
        state = await worker.state()
        if not state or state["recovering"]:
            return None
        return time.time(), next(d for d in state["dependencies"] if d["group"] == group)

    async def stalled() -> tuple[float, dict[str, Any]] | None:
        seen = await status_of(aggregates)
        return seen if seen and seen[1]["status"] == "stalled" else None

    seen_at, dep = await wait_until(stalled, stall_after + 10, "aggregates to show as stalled", interval=0.05)
    assert seen_at - committed_at >= stall_after, "flagged stalled before AML_STALL_AFTER had passed"
    assert seen_at - dep["last_advance"] >= stall_after
    assert dep["stalled_partitions"] == [0]
    assert f"(0:{HELD_AT})" in dep["detail"] and dep["detail"].startswith("not advanced for")
    state = await worker.state()
    assert next(d for d in state["dependencies"] if d["group"] == relations)["status"] == "ok"

    warning = f"dependency group '{aggregates}' stalled on partition 0"
    await wait_until(lambda: warning in worker.log_tail(400), 10, "the stall warning in the log")
    assert next(line for line in worker.log_tail(400).splitlines() if warning in line).count("[WARNING]") == 1
    _, _, body = await get(f"{worker.url}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    flag = {s.labels["dependency"]: s.value for s in families["aml_dependency_stalled"].samples}
    assert flag == {relations: 0, aggregates: 1}

    # it moves again: the stall clears, the metric flips back, one info line says so
    await deps[aggregates].commit({0: ends[0]})
    moved_at = time.time()

    async def cleared() -> dict[str, Any] | None:
        seen = await status_of(aggregates)
        return seen[1] if seen and seen[1]["status"] == "ok" else None

    dep = await wait_until(cleared, 15, "the stall to clear")
    assert dep["stalled_partitions"] == [] and dep["last_advance"] >= moved_at - 1
    await decision_log.wait_for({(0, o) for o in range(ends[0])}, timeout=15)
    cleared_line = f"dependency group '{aggregates}' no longer stalled on partition 0"
    await wait_until(lambda: cleared_line in worker.log_tail(400), 10, "the line saying the stall cleared")
    assert worker.log_tail(400).count(warning) == 1, "the stall warning was written more than once"
    _, _, body = await get(f"{worker.url}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert {s.labels["dependency"]: s.value for s in families["aml_dependency_stalled"].samples} == {
        relations: 0,
        aggregates: 0,
    }


PAGE_SNAPSHOT = """(() => {
  const cell = (row, sel) => { const c = row.querySelector(sel); return c ? c.textContent : null; };
  const parts = [...document.querySelectorAll("#parts tbody tr")].map((tr) => ({
    partition: tr.dataset.partition,
    fields: Object.fromEntries([...tr.querySelectorAll("td[data-field]")].map((td) =>
      [td.dataset.field, td.textContent])),
    deps: Object.fromEntries([...tr.querySelectorAll("td[data-dep]")].map((td) =>
      [td.dataset.dep, [td.textContent, td.classList.contains("bn")]])),
  }));
  const deps = [...document.querySelectorAll("#deps tbody tr")].map((tr) => ({
    group: tr.dataset.group,
    status: cell(tr, '[data-field="status"]'),
    lag: cell(tr, '[data-field="lag"]'),
    stalled: cell(tr, '[data-field="stalled_partitions"]'),
    holding: cell(tr, '[data-field="holding_back"]'),
  }));
  return { refreshes: window.gateView.refreshes, marker: window.pageMarker || null,
           banner: document.getElementById("banner").textContent, parts, deps,
           width: document.documentElement.scrollWidth,
           hidden: document.getElementById("tables").classList.contains("hidden") };
})()"""


def shown(value: Any) -> str:
    return "\u2014" if value is None else str(value)


async def check_token_required(worker: Any, token: str) -> None:
    """AML_WEB_TOKEN: every route but /health is a 401 without the token or with another one; the header
    opens them, and so does the page's address with the token once: a redirect to the address without
    it and a cookie (not the token) that only this page's browser carries."""
    routes = ("/watermarks/", "/watermarks.json", "/metrics", "/router/", "/nowhere")
    for path in routes:
        for headers in ({}, {"Authorization": "Bearer " + "x" * 32}, {"Authorization": token}):
            status, answer, body = await get(f"{worker.url}{path}", headers=headers)
            assert status == 401, (path, headers.keys(), status)
            assert answer["WWW-Authenticate"] == 'Bearer realm="aml-app"'
            assert "AML_WEB_TOKEN" in json.loads(body)["error"] and token not in body.decode()
    status, _, body = await get(f"{worker.url}/health")
    assert status == 200 and json.loads(body)["worker"] == worker.worker_id
    for path in ("/watermarks.json", "/metrics"):
        status, _, _ = await get(f"{worker.url}{path}", headers=worker.headers)
        assert status == 200, path

    status, _, _ = await get(f"{worker.url}/watermarks/?token=not-the-token-at-all", allow_redirects=False)
    assert status == 401
    # As a browser does, the session keeps cookies of a server named by its address (aiohttp does not).
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        async with session.get(worker.page_url, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"] == "/watermarks/", r.headers
            cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and token not in cookie, cookie
        async with session.get(f"{worker.url}/watermarks.json") as r:
            assert r.status == 200  # the cookie, no header
        async with session.get(f"{worker.url}/metrics") as r:
            assert r.status == 401  # the page's cookie opens the page's reads only
    later = int(time.time()) + 3600
    forged = {"Cookie": f"{COOKIE}={session_cookie('another-token-of-32-characters', later)}"}
    status, _, _ = await get(f"{worker.url}/watermarks.json", headers=forged)
    assert status == 401
    expired = {"Cookie": f"{COOKIE}={session_cookie(token, int(time.time()) - 1)}"}
    status, _, _ = await get(f"{worker.url}/watermarks.json", headers=expired)
    assert status == 401


async def test_page_in_headless_chromium_shows_the_json(
    names, producer, new_worker, deps, decision_log, tmp_path
):
    """The page as a deployment serves it: behind AML_WEB_TOKEN, opened once with the token."""
    token = secrets.token_urlsafe(24)
    worker, ends, _, _ = await held_on_aggregates(
        names, producer, new_worker, deps, decision_log, AML_STALL_AFTER="2", AML_WEB_TOKEN=token
    )
    relations, aggregates = names.deps
    await check_token_required(worker, token)

    async def stalled() -> dict | None:
        state = await worker.state()
        if not state or state["recovering"] or not state["dependencies"]:
            return None
        return state if state["dependencies"][1]["status"] == "stalled" else None

    await wait_until(stalled, 20, "aggregates to be stalled")
    await settled(worker, names, ends)

    async with Chromium(tmp_path / "chromium-profile") as browser:
        await browser.navigate(worker.page_url)
        await wait_until(
            lambda: browser.evaluate("window.gateView ? window.gateView.refreshes : 0"), 20, "a first render"
        )
        await browser.evaluate("window.pageMarker = 'same page'; 1")
        before = await browser.evaluate("window.gateView.refreshes")

        async def refreshed() -> dict | None:
            page = await browser.evaluate(PAGE_SNAPSHOT)
            return page if page["refreshes"] > before else None

        page = await wait_until(refreshed, 10, "the page to refresh by itself")
        shot = await browser.screenshot(tmp_path / "watermarks.png")
        print(f"screenshot: {shot}")
        assert await browser.evaluate("location.href") == f"{worker.url}/watermarks/"  # token dropped
        _, _, body = await get(f"{worker.url}/watermarks.json", headers=worker.headers)
        doc = json.loads(body)
        # nothing moves in this state, so the JSON now and the JSON the page rendered agree
        assert page["marker"] == "same page", "the page reloaded instead of updating in place"
        assert not page["hidden"]
        assert [p["partition"] for p in page["parts"]] == [str(p["partition"]) for p in doc["partitions"]]
        for shown_part, part in zip(page["parts"], doc["partitions"], strict=True):
            fields = shown_part["fields"]
            for field in ("log_end", "service_committed", "in_flight", "watermark"):
                assert fields[field] == shown(part[field]), (part["partition"], field)
            assert fields["payments_waiting"] == shown(part["payments_waiting"])
            assert fields["waiting_offset"] == shown(part["waiting_offset"])
            held = part["waiting_offset"] is not None or part["payments_waiting"] > 0
            assert fields["bottleneck"] == (", ".join(part["bottleneck"]) if held else "\u2014")
            for group in (relations, aggregates):
                text, highlighted = shown_part["deps"][group]
                assert text == str(part["dependencies"][group])
                assert highlighted == (held and group in part["bottleneck"]), (part["partition"], group)
        assert page["parts"][0]["deps"][aggregates] == [str(HELD_AT), True]  # the bottleneck, highlighted
        for shown_dep, dep in zip(page["deps"], doc["dependencies"], strict=True):
            assert shown_dep["group"] == dep["group"]
            assert shown_dep["status"] == dep["status"]  # in words, not only a colour
            assert shown_dep["lag"] == shown(dep["lag"])
            assert shown_dep["holding"] == (", ".join(map(str, dep["holding_back"])) or "\u2014")
        assert page["deps"][1]["status"] == "stalled" and page["deps"][1]["stalled"] == "0"
        assert aggregates in page["banner"] and "stalled" in page["banner"]
        assert page["width"] <= 1280, "the page scrolls sideways at 1280x800"

        assert shot.stat().st_size > 10_000
        outside = [u for u in browser.requested_urls() if not u.startswith(worker.url)]
        assert outside == [], f"the page asked for something outside the worker: {outside}"

        # while the JSON says recovering, the page says so and shows no numbers
        recovering = await browser.evaluate(
            "window.render({...window.gateView.last, recovering: true}); "
            "[document.getElementById('banner').textContent, "
            "document.getElementById('tables').classList.contains('hidden')]"
        )
        assert recovering[0].startswith("Recovering") and recovering[1] is True
        await browser.screenshot(tmp_path / "watermarks-recovering.png")

        # A row the gate distrusts closes it whatever the dependencies do: the banner says so first, and
        # the partition's watermark is marked with the reason (it blamed the dependencies, or said ok).
        why = "the row is 40.0 s old (more than 5 s): the leader's read failed: no answer within 5 s"
        distrusted = await browser.evaluate(
            "(() => { const d = window.gateView.last; "
            "const parts = d.partitions.map((p, i) => "
            f"({{...p, untrusted: i === 0 ? {json.dumps(why)} : null}})); "
            "window.render({...d, partitions: parts}); "
            "const cell = document.querySelector('#parts tbody tr td[data-field=\"watermark\"]'); "
            "return [document.getElementById('banner').textContent, cell.title, cell.className]; })()"
        )
        first = doc["partitions"][0]["partition"]
        assert distrusted == [
            f"The gate stays closed on partition {first}, whatever its watermark: {why}.",
            f"distrusted: {why}",
            "bn",
        ]
