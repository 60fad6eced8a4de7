"""What a person sees of a radix tree: a bounded JSON-ready snapshot, and the same as indented text.

`tree_snapshot` walks the tree breadth first (the part nearest the root first) up to `max_nodes`
nodes and `max_tokens` tokens per node, and adds the recent events of the tree's `CacheEventLog`.
Namespaces are named by `NamespaceLabels`: their kind (LoRA adapter, API key, salt, ...) and a short
keyed hash, never the key or salt itself unless the caller asks (`reveal=True`, local debugging).
`format_tree` prints a snapshot; `RadixCache.pretty_print` and `radixserve cache` both use it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from typing import Any

_PROCESS_SECRET = os.urandom(16)  # NOTE: hashes name namespaces apart within one process, no further


class NamespaceLabels:
    """Stable short names for namespaces: {"kind", "hash", "owner", "value"} per extra_key.

    The hash is keyed by a random secret of this process, so a short or guessable value (a salt
    like "tenant-a") cannot be recovered by hashing candidates. `owner` is the API key id of a
    server namespace (its leading ("api", id) part), so a server can show each key its own nodes.
    """

    def __init__(self, secret: bytes | None = None, reveal: bool = False) -> None:
        self._secret = secret or _PROCESS_SECRET
        self.reveal = reveal
        self._labels: dict[Any, dict[str, Any]] = {}

    def describe(self, extra_key: Any) -> dict[str, Any]:
        label = self._labels.get(extra_key)
        if label is None:
            label = self._labels[extra_key] = self._make(extra_key)
        return label

    def _make(self, extra_key: Any) -> dict[str, Any]:
        if extra_key is None:
            return {"kind": "shared", "hash": None, "owner": None, "value": None}
        digest = hashlib.blake2b(repr(extra_key).encode(), key=self._secret, digest_size=4).hexdigest()
        return {"kind": namespace_kind(extra_key), "hash": digest, "owner": _owner(extra_key),
                "value": repr(extra_key) if self.reveal else None}


def label_text(label: dict[str, Any]) -> str:
    if label["hash"] is None:
        return label["kind"]
    return f"{label['kind']}={label['value']}" if label.get("value") else f"{label['kind']}#{label['hash']}"


def namespace_kind(extra_key: Any) -> str:
    """"api+salt" for the server's ((kind, value), ...) namespaces; else the value's type name."""
    if isinstance(extra_key, tuple) and extra_key and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in extra_key):
        return "+".join(kind for kind, _ in extra_key)
    return type(extra_key).__name__


def _owner(extra_key: Any) -> str | None:
    if isinstance(extra_key, tuple) and extra_key and isinstance(extra_key[0], tuple) \
            and len(extra_key[0]) == 2 and extra_key[0][0] == "api":
        return str(extra_key[0][1])
    return None


def node_tokens(node: Any, max_tokens: int | None, is_eagle: bool) -> tuple[list[int], int]:
    """The first `max_tokens` tokens of a node's edge (raw tokens in the bigram view) and how many were cut."""
    key = node.key
    if is_eagle and key.is_bigram:
        tokens = list(key.raw_token_ids)
    else:
        view = memoryview(key.packed).cast("q")
        tokens = list(view if max_tokens is None else view[:max_tokens])
        return tokens, len(key) - len(tokens)
    if max_tokens is None or len(tokens) <= max_tokens:
        return tokens, 0
    return tokens[:max_tokens], len(tokens) - max_tokens


def tree_snapshot(cache: Any, labels: NamespaceLabels | None = None, *, max_nodes: int | None = 400,
                  max_tokens: int | None = 48, since: int = 0, max_events: int | None = 300,
                  requests: list[tuple] = ()) -> dict[str, Any]:
    """The tree near the root (breadth first, at most `max_nodes`), and the events after `since`.

    `requests`: (rid, locked node id, extra_key, cached tokens, sequence length) of the requests
    that hold KV, listed with their namespace so a viewer can highlight the paths they hold.
    """
    labels = labels or NamespaceLabels()
    now = time.monotonic()
    namespaces: list[dict[str, Any]] = []
    ns_index: dict[Any, int] = {}

    def ns_of(extra_key: Any) -> int:
        index = ns_index.get(extra_key)
        if index is None:
            index = ns_index[extra_key] = len(namespaces)
            namespaces.append(labels.describe(extra_key))
        return index

    nodes, truncated = _walk(cache, ns_of, now, max_nodes, max_tokens)
    out = {
        "page_size": cache.page_size, "is_eagle": cache.is_eagle, "disabled": cache.disable,
        "eviction_policy": cache.eviction_policy,
        "evictable_tokens": cache.evictable_size(), "protected_tokens": cache.protected_size(),
        "nodes": nodes, "truncated": truncated, "max_tokens": max_tokens,
        "namespaces": namespaces,
        "requests": [{"rid": rid, "node": node, "ns": ns_of(extra_key), "cached": cached, "seqlen": seqlen}
                     for rid, node, extra_key, cached, seqlen in requests],
    }
    out.update(_events(cache, ns_of, now, since, max_events))
    return out


def _walk(cache: Any, ns_of: Any, now: float, max_nodes: int | None,
          max_tokens: int | None) -> tuple[list[dict[str, Any]], bool]:
    nodes: list[dict[str, Any]] = []
    queue: deque[tuple[Any, int | None, int]] = deque([(cache.root_node, None, 0)])
    while queue and (max_nodes is None or len(nodes) < max_nodes):
        node, parent, depth = queue.popleft()
        tokens, elided = node_tokens(node, max_tokens, cache.is_eagle)
        nodes.append({
            "id": node.id, "parent": parent, "depth": depth, "len": len(node.key), "tokens": tokens,
            "elided": elided, "ns": ns_of(node.key.extra_key), "lock_ref": node.lock_ref,
            "hits": node.hit_count, "age_s": round(now - node.last_access_time, 3),
            "evictable": node.lock_ref == 0, "leaf": not node.children, "priority": node.priority,
        })
        nodes[-1].update(cache.node_tier_fields(node))  # NOTE: a hybrid tree's window KV and window locks
        queue.extend((child, node.id, depth + 1) for child in node.children.values())
    return nodes, bool(queue)


def _events(cache: Any, ns_of: Any, now: float, since: int, max_events: int | None) -> dict[str, Any]:
    log = cache.events
    if log is None:
        return {"recording": False, "event_seq": 0, "events": [], "events_lost": 0}
    events, lost = log.since(since, max_events)
    return {"recording": True, "event_seq": log.seq, "events_lost": lost,
            "events": [_event_dict(e, ns_of, now) for e in events]}


def _event_dict(event: Any, ns_of: Any, now: float) -> dict[str, Any]:
    out = {"seq": event.seq, "age_s": round(now - event.time, 3), "kind": event.kind, "node": event.node,
           "ns": ns_of(event.extra_key), "tokens": event.tokens}
    if event.kind == "evict":
        asked, victims = event.detail
        out["asked"] = asked
        out["victims"] = [{"node": n, "tokens": t, "ns": ns_of(k), "parent": p} for n, t, k, p in victims]
    elif event.kind == "split":
        out["lower"] = event.detail
    elif event.kind in ("lock", "unlock"):
        out["lock_ref"] = event.detail
    elif event.kind == "insert":
        out["cached"] = event.detail
    elif event.kind == "match":
        out["asked"] = event.detail
    return out


# ---------------------------------------------------------------------------------------------- text

def format_tree(snapshot: dict[str, Any], texts: dict[int, str] | None = None) -> str:
    """One line per node, indented by depth: namespace, length, lock_ref, evictability, hits, age, tokens."""
    namespaces = snapshot["namespaces"]
    unit = "pairs" if snapshot["is_eagle"] else "tok"
    lines = []
    for node in depth_first(snapshot["nodes"]):
        indent = "  " * node["depth"]
        if node["parent"] is None:
            lines.append(f"{indent}#{node['id']} root lock_ref={node['lock_ref']} page_size={snapshot['page_size']}"
                         + (" bigram" if snapshot["is_eagle"] else ""))
            continue
        state = "evictable" if node["evictable"] else "protected"
        more = f", ... +{node['elided']}" if node["elided"] else ""
        tokens = ", ".join(map(str, node["tokens"]))
        window = f" window={node['window']}/{node['len']}" if "window" in node else ""
        line = (f"{indent}#{node['id']} [{label_text(namespaces[node['ns']])}] {node['len']} {unit} "
                f"lock_ref={node['lock_ref']} {state}{window} hits={node['hits']} age={node['age_s']:.2f}s "
                f"[{tokens}{more}]")
        text = (texts or {}).get(node["id"], node.get("text"))
        if text is not None:
            line += f" {text!r}"
        lines.append(line)
    if snapshot["truncated"]:
        lines.append(f"... more nodes beyond the first {len(snapshot['nodes'])}")
    total = snapshot["evictable_tokens"] + snapshot["protected_tokens"]
    lines.append(f"#tokens: {total} (evictable {snapshot['evictable_tokens']}, "
                 f"protected {snapshot['protected_tokens']})")
    return "\n".join(lines)


def depth_first(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Snapshot nodes (breadth first) reordered so that every node is followed by its subtree."""
    children: dict[Any, list[dict[str, Any]]] = {}
    for node in nodes:
        children.setdefault(node["parent"], []).append(node)
    ordered, stack = [], list(reversed(children.get(None, [])))
    while stack:
        node = stack.pop()
        ordered.append(node)
        stack.extend(reversed(children.get(node["id"], [])))
    return ordered


def format_pool(snapshot: dict[str, Any]) -> str:
    """The KV pool in one line, then (with the hierarchical cache) one line per tier behind it."""
    pool = snapshot["pool"]
    text = (f"KV pool {pool['size']} tokens: free {pool['available']}, evictable {pool['evictable']}, "
            f"protected {pool['protected']}, in requests {pool['in_requests']}; "
            f"{len(snapshot['requests'])} running, {snapshot['waiting_requests']} waiting")
    tiers = snapshot.get("tiers") or {}
    if tiers.get("hierarchical"):
        text += "\n" + format_tiers(tiers)
    return text


def format_tiers(tiers: dict[str, Any]) -> str:
    """The host and storage tiers of a snapshot's `tiers` (cache_observer.tiers_of), one line each."""
    host, store = tiers["host"], tiers["storage"]
    lines = ["host tier: none" if host is None else
             f"host tier: {host['pages']} pages, {host['bytes']} of {host['capacity_bytes']} bytes ({host['dtype']}); "
             f"hits {host['hits']}, misses {host['misses']}, evicted {host['evicted']}, "
             f"loaded {host['loaded_tokens']} tokens"]
    pages = "?" if store["pages"] is None else store["pages"]
    lines.append(f"storage tier ({store['backend']}{'' if store['enabled'] else ', turned off'}): {pages} pages, "
                 f"{store['bytes']} of {store['capacity_bytes'] or 'uncapped'} bytes; hits {store['hits']}, "
                 f"misses {store['misses']}, corrupt {store['corrupt']}, written {store['pages_written']}, "
                 f"evicted {store['evicted']}, loaded {store['loaded_tokens']} tokens "
                 f"({tiers['page_tokens']}-token pages, {tiers['write_policy']})")
    return "\n".join(lines)


def format_events(snapshot: dict[str, Any], limit: int = 20) -> str:
    """The newest `limit` events, one a line (evictions list their victims in order)."""
    namespaces = snapshot["namespaces"]
    lines = []
    for e in snapshot["events"][-limit:]:
        ns = label_text(namespaces[e["ns"]])
        if e["kind"] == "evict":
            victims = ", ".join(f"#{v['node']}({v['tokens']})" for v in e["victims"])
            lines.append(f"{e['seq']:>6} evict {e['tokens']} tok (asked {e['asked']}): {victims}")
        elif e["kind"] == "reset":
            lines.append(f"{e['seq']:>6} reset")
        else:
            extra = {"split": f"lower #{e.get('lower')}", "lock": f"lock_ref={e.get('lock_ref')}",
                     "unlock": f"lock_ref={e.get('lock_ref')}", "insert": f"already cached {e.get('cached')}",
                     "match": f"of {e.get('asked')}"}[e["kind"]]
            lines.append(f"{e['seq']:>6} {e['kind']} #{e['node']} [{ns}] {e['tokens']} tok, {extra}")
    if snapshot.get("events_lost"):
        lines.insert(0, f"({snapshot['events_lost']} older events not shown)")
    return "\n".join(lines)
