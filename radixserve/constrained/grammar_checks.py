"""Checks a grammar passes before it is compiled: its size, that it can end, and the schema keywords it uses.

xgrammar turns a JSON schema, a regex, an EBNF grammar or a structural tag into a `Grammar` (rules in EBNF) in
a few milliseconds; compiling that grammar against the vocabulary is what costs: a token mask for each state of
each rule, and a bounded repetition (`X{0, 100}`, from `maxLength`, `maxItems`, a regex `{m,n}`) is a chain of
one state per repetition (xgrammar unrolls up to 128 of them, then 128 + a counted loop). So, read off the
grammar's text before compiling (`shape`):
- `states`: the states of every bounded repetition. The compiled grammar keeps a mask for each (~20 KB a state
  with a 49k vocabulary: 100 string fields with `maxLength` 20-119 are 6,956 states, 138 MiB compiled).
- `work`: the same, counting each distinct repeated unit once (xgrammar's rule-level cache computes a mask once
  per distinct rule state, so 100 fields of one kind cost about one): ~30 ms a state on a 2-core Xeon for a
  broad character class (`[^a]{0,100}[^b]{0,100}` is 200 and compiles in ~6 s), far less for narrow ones.
- whether every rule reachable from `root` can end (`unending`): a rule that only refers back to itself (a
  JSON schema whose required property is a `$ref` to the root) has no finite output, and xgrammar's
  jump-forward string for it never ends (it allocated until `std::bad_alloc`).
A grammar over `MAX_GRAMMAR_STATES` or `MAX_GRAMMAR_WORK`, or with a rule that cannot end, is refused (400)
without compiling. `refused_schema_keywords` lists the JSON-schema keywords xgrammar 0.2.8 drops without a word
(the output would then not validate), which are refused too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_GRAMMAR_STATES = 8192  # bounded-repetition states of one grammar (~20 KB compiled each, 49k vocabulary)
MAX_GRAMMAR_WORK = 1024  # distinct ones (~30 ms each to compile, worst case measured; docs/structured_outputs.md)
UNROLLED = 128  # xgrammar unrolls a repetition up to this many times (its kUnzipThreshold)

# Keywords xgrammar 0.2.8 ignores (its grammar is the same with and without them), each of which rejects values
# the grammar would then allow. NOTE: `uniqueItems`, `multipleOf` on numbers and `oneOf`'s exclusivity are not
# enforced either, but are common in generated schemas (pydantic's sets, multiple_of): documented, not refused.
REFUSED_SCHEMA_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                           "contains", "minContains", "maxContains", "propertyNames")
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA_VALUED = ("additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "items",
                  "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(ValueError):
    """A grammar refused before or after compiling: the message names the field; `reason` prefixes it in the
    request's 400 ("invalid grammar": it does not compile or matches nothing; "grammar too large")."""

    def __init__(self, field: str, message: str, reason: str = "invalid grammar") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = reason


def refused_schema_keywords(schema: Any) -> list[tuple[str, str]]:
    """(keyword, JSON pointer of the schema using it) for each refused keyword in `schema` and its subschemas."""
    found: list[tuple[str, str]] = []
    for at, node in _subschemas(schema, "#"):
        found.extend((key, at) for key in REFUSED_SCHEMA_KEYWORDS if key in node)
    return found


def tag_schemas(tag: Any, at: str = "") -> Iterator[tuple[str, Any]]:
    """The JSON schemas inside a structural tag, with where they are: xgrammar's `{"type": "json_schema",
    "json_schema": ...}` contents, and SGLang's older `structures[i].schema`."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            yield f"{at}/json_schema", tag["json_schema"]
            return
        for key, value in tag.items():
            if key == "schema" and at.startswith("/structures/"):
                yield f"{at}/schema", value
            else:
                yield from tag_schemas(value, f"{at}/{key}")
    elif isinstance(tag, list):
        for i, item in enumerate(tag):
            yield from tag_schemas(item, f"{at}/{i}")


def _subschemas(node: Any, at: str) -> Iterator[tuple[str, dict]]:
    """Every schema object in `node` (itself first), with its pointer; values (`enum`, `const`, `default`) are
    not walked, so a property named "not" is no keyword."""
    if not isinstance(node, dict):
        return
    yield at, node
    for key in _SCHEMA_VALUED:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{at}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, item in enumerate(node[key]):
                yield from _subschemas(item, f"{at}/{key}/{i}")
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, item in node[key].items():
                yield from _subschemas(item, f"{at}/{key}/{name}")


# ---- the grammar's text ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What compiling a grammar will cost, and whether it can end (module docstring)."""

    states: int
    work: int
    unending: str | None  # a rule reachable from root that can never end, or None


_RULE_START = re.compile(r"^([A-Za-z_][\w.\-]*) ::= ", re.M)  # NOTE: EBNF names may hold '-' and '.'
_TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<call>[A-Za-z_]\w*\()
  | (?P<ref>[A-Za-z_][\w.\-]*)
  | (?P<look>\(=)
  | (?P<rep>\{\s*-?\d+\s*,\s*-?\d+\s*\}|\{\s*-?\d+\s*\})
  | (?P<op>[()|*+?,=])
)""", re.X | re.S)
_REGEX_CALL = re.compile(r'Regex\("((?:[^"\\]|\\.)*)"')

# A parsed body: ("lit", text) | ("ref", name) | ("seq", [nodes]) | ("alt", [nodes]) | ("rep", node, lo, hi)
# | ("call", [names]) (xgrammar's TagDispatch, Regex, ...: can end; the rules it names are reachable)
Node = tuple


def shape(text: str, regex_shape: Any = None) -> Shape:
    """The `Shape` of a grammar printed by xgrammar (`str(xgr.Grammar)`). `regex_shape(pattern)` gives the
    Shape of a `Regex("...")` inside it (a JSON schema's `pattern`), else those count as nothing. A body this
    parser does not follow counts as one that can end, with no repetition."""
    rules = _rules(text)
    states, units = 0, {}
    for node in rules.values():
        for unit, lo, hi in _repetitions(node):
            n = _unrolled(lo, hi)
            states += n
            key = repr(rules.get(unit[1], unit)) if unit[0] == "ref" else repr(unit)
            units[key] = max(units.get(key, 0), n)
    work = sum(units.values())
    if regex_shape is not None:
        for literal in _REGEX_CALL.findall(text):
            inner = regex_shape(_unescape(literal))
            states, work = states + inner.states, work + inner.work
    return Shape(states, work, _unending(rules))


def _rules(text: str) -> dict[str, Node]:
    starts = list(_RULE_START.finditer(text))
    rules = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        try:
            rules[m.group(1)] = _Parser(text[m.end():end]).body()
        except (ValueError, IndexError):
            rules[m.group(1)] = ("lit",)  # NOTE: not followed: counted as a rule that can end, costing nothing
    return rules


class _Parser:
    """Recursive descent over one rule's body: alternatives of sequences of postfixed atoms."""

    def __init__(self, body: str) -> None:
        self.tokens = []
        pos, body = 0, body.strip()
        while pos < len(body):
            m = _TOKEN.match(body, pos)
            if m is None or m.end() == pos:
                raise ValueError(f"unexpected {body[pos:pos + 20]!r}")
            self.tokens.append((m.lastgroup, m.group(m.lastgroup)))
            pos = m.end()
        self.i = 0

    def body(self) -> Node:
        node = self.alt()
        if self.peek() == ("look", "(="):  # NOTE: a lookahead assertion consumes nothing: not part of the output
            self.i = len(self.tokens)
        return node

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def alt(self) -> Node:
        options = [self.seq()]
        while self.peek() == ("op", "|"):
            self.i += 1
            options.append(self.seq())
        return options[0] if len(options) == 1 else ("alt", options)

    def seq(self) -> Node:
        items = []
        while (tok := self.peek()) is not None and tok not in (("op", "|"), ("op", ")"), ("look", "(=")):
            items.append(self.postfix(self.atom()))
        return items[0] if len(items) == 1 else ("seq", items)

    def atom(self) -> Node:
        kind, value = self.tokens[self.i]
        self.i += 1
        if kind in ("str", "cls"):
            return ("lit", value)
        if kind == "ref":
            return ("ref", value)
        if kind == "call":
            return ("call", self.skip_call())
        if (kind, value) == ("op", "("):
            node = self.alt()
            if self.peek() != ("op", ")"):
                raise ValueError("unbalanced parenthesis")
            self.i += 1
            return node
        raise ValueError(f"unexpected {value!r}")

    def skip_call(self) -> list[str]:
        """Past a call's closing parenthesis; the rule names it mentions (keyword arguments' names excluded)."""
        depth, names = 1, []
        while depth:
            kind, value = self.tokens[self.i]
            self.i += 1
            depth += (kind in ("call", "look") or value == "(") - (value == ")")
            if kind == "ref" and self.peek() != ("op", "="):
                names.append(value)
        return names

    def postfix(self, node: Node) -> Node:
        while (tok := self.peek()) is not None and (tok[0] == "rep" or tok[1] in ("*", "+", "?")):
            self.i += 1
            if tok[0] == "rep":
                bounds = [int(x) for x in tok[1].strip("{}").split(",")]
                node = ("rep", node, bounds[0], bounds[-1])
            else:
                node = ("rep", node, 1 if tok[1] == "+" else 0, 1 if tok[1] == "?" else -1)
        return node


def _repetitions(node: Node) -> Iterator[tuple[Node, int, int]]:
    if node[0] == "rep":
        yield node[1], node[2], node[3]
        yield from _repetitions(node[1])
    elif node[0] in ("seq", "alt"):
        for child in node[1]:
            yield from _repetitions(child)


def _unrolled(lo: int, hi: int) -> int:
    """States of `X{lo, hi}` once xgrammar unrolled it (hi -1: unbounded; a star is one looping state)."""
    if 0 <= hi <= UNROLLED:
        return hi
    if hi < 0:
        return min(lo, UNROLLED) + 1
    return 2 * UNROLLED


def _unending(rules: dict[str, Node]) -> str | None:
    """A rule reachable from root that derives no finite string (least fixpoint of "can end"), or None."""
    ends: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, node in rules.items():
            if name not in ends and _can_end(node, ends, rules):
                ends.add(name)
                changed = True
    if "root" not in rules:
        return None
    seen, todo = {"root"}, ["root"]
    while todo:
        name = todo.pop()
        if name not in ends:
            return name
        for ref in _refs(rules[name]):
            if ref in rules and ref not in seen:
                seen.add(ref)
                todo.append(ref)
    return None


def _can_end(node: Node, ends: set[str], rules: dict[str, Node]) -> bool:
    kind = node[0]
    if kind in ("lit", "call"):
        return True
    if kind == "ref":
        return node[1] in ends or node[1] not in rules  # NOTE: a name not defined here (a builtin) can end
    if kind == "seq":
        return all(_can_end(child, ends, rules) for child in node[1])
    if kind == "alt":
        return any(_can_end(child, ends, rules) for child in node[1])
    return node[2] == 0 or _can_end(node[1], ends, rules)  # rep


def _refs(node: Node) -> Iterator[str]:
    kind = node[0]
    if kind == "ref":
        yield node[1]
    elif kind == "call":
        yield from node[1]
    elif kind in ("seq", "alt"):
        for child in node[1]:
            yield from _refs(child)
    elif kind == "rep":
        yield from _refs(node[1])


def _unescape(literal: str) -> str:
    try:
        return json.loads(f'"{literal}"')
    except ValueError:
        return literal
