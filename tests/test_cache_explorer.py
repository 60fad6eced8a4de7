"""The cache explorer on a real server with two API keys: /cache/tree, `radixserve cache`, and /cache/view in
a real headless Chromium (the page draws the shared node with its lock count while requests run, shows
it unlocked after, and logs an eviction; the browser console stays free of errors)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from server_harness import ServerHandle, check_idle_conservation, start_server

from radixserve import envs
from radixserve.cli import main as cli_main
from radixserve.frontend.tokenizer_manager import api_key_id

pytestmark = pytest.mark.slow

KEYS = ("key-a", "key-b")
MODEL = "SmolLM2-135M-Instruct"
SHARED = ("You are the support assistant of a small bakery in Lyon. You answer in one short paragraph, you "
          "never invent opening hours, and you always mention that croissants sell out by ten in the morning. ")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server():
    handle = start_server("--dtype", "float32", "--max-total-tokens", "1024", "--page-size", "4",
                          "--api-key", ",".join(KEYS), "--admin-api-key", "admin-key", api_key=KEYS[0],
                          admin_key="admin-key")
    yield handle
    handle.stop()


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(server: ServerHandle, prompt: str, key: str = KEYS[0], max_tokens: int = 4, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=_as(key), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _tree(server: ServerHandle, key: str = KEYS[0], **params) -> dict:
    r = httpx.get(server.base_url + "/cache/tree", params=params, headers=_as(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------------- HTTP

def test_every_explorer_route_needs_a_key_bearer_or_basic(server: ServerHandle) -> None:
    for path in ("/cache/tree", "/cache/view", "/cache/static/cache_view.js"):
        r = httpx.get(server.base_url + path, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic ")
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.base_url + path, headers=_as("key-c"), timeout=30).status_code == 401
        assert httpx.get(server.base_url + path, auth=("me", KEYS[1]), timeout=30).status_code == 200
    page = httpx.get(server.base_url + "/cache/view", headers=_as(KEYS[0]), timeout=30)
    assert page.headers["content-type"].startswith("text/html") and "cache_view.js" in page.text
    assert "://" not in page.text  # nothing loaded from another origin (no CDN)
    r = httpx.get(server.base_url + "/cache/static/..%2Fhttp_server.py", headers=_as(KEYS[0]), timeout=30)
    assert r.status_code == 404
    r = httpx.get(server.base_url + "/cache/tree", params={"max_nodes": 0}, headers=_as(KEYS[0]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_nodes"


def test_a_key_sees_its_own_nodes_decoded_and_no_secret(server: ServerHandle) -> None:
    mine = f"Order {uuid.uuid4().hex[:8]}: two baguettes and a tarte tatin for Sunday."
    theirs = f"Invoice {uuid.uuid4().hex[:8]} for the flour supplier, net thirty days."
    _complete(server, mine)
    _complete(server, theirs, key=KEYS[1], cache_salt="salt-of-tenant-b")
    seen_a, seen_b = _tree(server, KEYS[0]), _tree(server, KEYS[1])
    text_a = "".join(n.get("text", "") for n in seen_a["nodes"])
    text_b = "".join(n.get("text", "") for n in seen_b["nodes"])
    assert mine[:20] in text_a and theirs[:20] not in text_a and seen_a["hidden_nodes"] >= 1
    assert theirs[:20] in text_b and mine[:20] not in text_b
    for snapshot in (seen_a, seen_b):
        dumped = json.dumps(snapshot)
        assert "salt-of-tenant-b" not in dumped and "key-a" not in dumped and "key-b" not in dumped
        assert api_key_id(KEYS[0]) not in dumped and api_key_id(KEYS[1]) not in dumped
    kinds = {seen_b["namespaces"][n["ns"]]["kind"] for n in seen_b["nodes"] if n["parent"] is not None}
    assert "api+salt" in kinds
    node = next(n for n in seen_a["nodes"] if mine[:20] in n.get("text", ""))
    assert node["lock_ref"] == 0 and node["evictable"] and node["len"] % 4 == 0  # page size 4
    assert seen_a["pool"]["size"] == 1024 and seen_a["recording"] and seen_a["took_ms"] < 1000
    later = _tree(server, KEYS[0], since=seen_a["event_seq"])
    assert all(e["seq"] > seen_a["event_seq"] for e in later["events"])


def test_cli_prints_a_running_servers_tree(server: ServerHandle, capsys) -> None:
    cli_main(["cache", "--base-url", server.base_url, "--api-key", KEYS[0], "--events", "5"])
    out = capsys.readouterr().out
    assert "root lock_ref=1 page_size=4" in out and "KV pool 1024 tokens" in out and "[api#" in out
    with pytest.raises(SystemExit, match="401"):
        cli_main(["cache", "--base-url", server.base_url])


# ---------------------------------------------------------------------------------------------- browser

def _chromium() -> str:
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no Chromium on this machine (apt-get install -y chromium; .ci/run installs it)")
    return path


def _node_state(page, node_id: int) -> tuple[str | None, str | None]:
    box = page.query_selector(f'.node[data-node-id="{node_id}"]')
    return (None, None) if box is None else (box.get_attribute("data-lock-ref"), box.get_attribute("class"))


@pytest.mark.long
def test_the_page_draws_locks_unlocks_and_evictions_live(server: ServerHandle, tmp_path: Path) -> None:
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    questions = [" Are you open on Monday?", " Do you sell gluten-free bread?", " Can I order a birthday cake?"]
    with sync_playwright() as pw, tempfile.TemporaryDirectory(prefix="radixserve-chromium-") as profile:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=executable, args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 860},
            http_credentials={"username": "reader", "password": KEYS[0]})
        page = context.new_page()
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        page.goto(server.base_url + "/cache/view?interval=200")
        page.wait_for_selector(".node.root")
        device = page.wait_for_selector("#tiers tr[data-tier=device]")  # the tiers: device only, no hierarchical cache
        assert "tokens cached in the tree" in device.inner_text()
        assert "off" in page.inner_text("#tiers tr[data-tier=host]")

        threads = [threading.Thread(target=_complete, args=(server, SHARED + q), kwargs={"max_tokens": 48})
                   for q in questions]
        for t in threads:
            t.start()
        shared_id = _wait_for_shared_node(page, lock_ref=len(questions))
        lock_ref, classes = _node_state(page, shared_id)
        assert lock_ref == "3" and "protected" in classes and "held" in classes  # a running request's path
        shot = tmp_path / "cache_explorer.png"
        page.screenshot(path=str(shot))
        for t in threads:
            t.join()

        page.wait_for_function(f"""() => {{ const box = document.querySelector('.node[data-node-id="{shared_id}"]');
            return box && box.dataset.lockRef === "0" && box.dataset.evictable === "true"; }}""", timeout=60_000)
        assert "evictable" in _node_state(page, shared_id)[1]

        for i in range(4):  # unrelated prompts of ~300 tokens fill the 1024-token pool: the tree must evict
            _complete(server, f"Filler {i} {uuid.uuid4().hex}: " + "flour water salt yeast " * 75)
        evicted = page.wait_for_selector("#events li[data-kind=evict]", timeout=60_000)
        assert evicted.is_visible() and "evict" in evicted.inner_text() and "tok" in evicted.inner_text()

        page.set_viewport_size({"width": 390, "height": 844})  # a phone: one column, nothing wider than it
        page.wait_for_timeout(500)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        assert page.is_visible("#tree .node.root") and page.is_visible("#events")
        context.close()
    assert not errors, errors
    target = envs.EXPLORER_SCREENSHOT.get()
    if target is not None:
        shutil.copyfile(shot, target)
    check_idle_conservation(server)


def _wait_for_shared_node(page, lock_ref: int, timeout_s: float = 120.0) -> int:
    """The id of the drawn node holding the shared prefix's text with `lock_ref` locks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for box in page.query_selector_all(".node[data-lock-ref]"):
            text = box.get_attribute("data-text") or ""
            if box.get_attribute("data-lock-ref") == str(lock_ref) and len(text) > 40 and text in SHARED:
                return int(box.get_attribute("data-node-id"))
        time.sleep(0.05)
    drawn = [(b.get_attribute("data-lock-ref"), (b.get_attribute("data-text") or "")[:30])
             for b in page.query_selector_all(".node[data-lock-ref]")]
    raise AssertionError(f"no node of the shared prefix with lock_ref {lock_ref} was drawn: {drawn}")

