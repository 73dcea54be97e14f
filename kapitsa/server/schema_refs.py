"""Local `$ref`s in tool schemas (`#`, `#/$defs/A`, any `#/...` pointer), as Pydantic writes nested
models: rebasing a tool's schema below a composed grammar's root, the definitions a value's refs
reach, and the schema a ref chain ends at. Every walk visits each schema node once at most, so a
cyclic or fanned-out schema costs its size, not more (the size is the request body's to cap)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from kapitsa.server.errors import param_error

# Keywords whose value maps names to subschemas, and keywords whose value is data, not a schema.
_NAME_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_MAX_REF_HOPS = 16


def hoisted(index: int, name: str, params: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A tool's parameters ready to sit below a composed grammar's root: `(key, schema)`.

    A tool's refs are relative to its own root, which a composed schema moves below a new one, so a
    tool with local refs moves whole into the root's `$defs` under `key` (its own, so two tools'
    `#/$defs/A` stay apart) and each pointer ref `#` / `#/...` is rebased onto `#/$defs/key` (a
    recursive definition stays a ref, never an inlined copy). A tool without refs keeps its schema
    as it is (`key` None). Anchor refs (`#name`) stay as written and resolve while anchor names are
    unique across the request's tools; refs to other documents are refused (nothing is fetched)."""
    if not _has_local_refs(params, name):
        return None, params
    key = f"tool{index}_{re.sub(r'[^A-Za-z0-9_]', '_', name)[:48]}"
    rebased = json.loads(json.dumps(params))  # a copy: the request's own schema stays as sent
    rebased.pop("$id", None)  # its refs now resolve against the composed root, not its old base
    for node in schema_nodes(rebased):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = f"#/$defs/{key}{ref[1:]}"
    return key, rebased


def _has_local_refs(params: dict[str, Any], name: str) -> bool:
    """Whether the tool's schema holds a `$ref`; raises `InvalidRequest` on a ref to another document."""
    found = False
    for node in schema_nodes(params):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise param_error(
                "tools",
                f"tool `{name}`: `$ref` {ref!r} points outside the tool's schema; only refs within it "
                "(`#`, `#/$defs/...`, `#/definitions/...`, any `#/...` pointer, `#anchor`) are supported.",
            )
        found = found or isinstance(ref, str)
    return found


def schema_nodes(schema: Any, seen: set[int] | None = None) -> Iterator[dict[str, Any]]:
    """Every schema object in `schema`, each once (iterative: depth is the tool checker's to cap),
    skipping data keywords (a `const` holding `{"$ref": ...}` is data) and nested resources with
    their own `$id` (their refs resolve against that `$id`, which the compiler honours). `seen`
    (ids of nodes already walked) carries over between walks of one schema."""
    seen = set() if seen is None else seen
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, is_name_map = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, list):
            stack += [(item, False) for item in node]
        elif isinstance(node, dict) and is_name_map:
            stack += [(sub, False) for sub in node.values()]
        elif isinstance(node, dict):
            if node is not schema and isinstance(node.get("$id"), str) and not node["$id"].startswith("#"):
                continue
            yield node
            stack += [(v, k in _NAME_MAPS) for k, v in node.items() if k not in _DATA_KEYWORDS]


def pointer_parts(ref: str) -> list[str] | None:
    """The segments of a pointer ref (`#` → [], `#/$defs/A%20B` → ["$defs", "A B"]); None for others."""
    if ref == "#":
        return []
    if not ref.startswith("#/"):
        return None
    return [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]


def _at(root: Any, parts: list[str]) -> Any:
    node = root
    for part in parts:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            node = node.get(part) if isinstance(node, dict) else None
    return node


def ref_target(schema: Any, root: Any) -> Any:
    """The schema a chain of pointer `$ref`s from `schema` ends at within `root` (`schema` itself
    when it holds none, or a ref that points at nothing)."""
    for _ in range(_MAX_REF_HOPS):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        parts = pointer_parts(ref) if isinstance(ref, str) else None
        target = _at(root, parts) if parts is not None else None
        if not isinstance(target, dict):
            return schema
        schema = target
    return schema


def reachable_defs(schema: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """The part of the hoisted `defs` that the (rebased) refs under `schema` reach, transitively, as a
    sparse copy ({} when none): a value's grammar carries what it uses, not its whole tool."""
    root: dict[str, Any] = {"$defs": defs}
    walked: set[int] = set()
    targeted: set[int] = set()
    stack, targets = [schema], []
    while stack:
        for node in schema_nodes(stack.pop(), walked):
            ref = node.get("$ref")
            parts = pointer_parts(ref) if isinstance(ref, str) else None
            target = _at(root, parts) if parts else None
            if isinstance(target, (dict, list)) and id(target) not in targeted:
                targeted.add(id(target))
                targets.append(parts)
                stack.append(target)  # walked once however many refs reach it
    return _sparse(root, targets).get("$defs", {})


def _sparse(root: dict[str, Any], paths: list[list[str]]) -> dict[str, Any]:
    """A copy of `root` holding only the subtrees at `paths` (an ancestor's subtree holds its descendants)."""
    out: dict[str, Any] = {}
    placed: list[list[str]] = []
    for full in sorted(paths, key=len):
        path = _dict_prefix(root, full)  # a pointer into a list places the list's dict holder whole
        if any(path[: len(p)] == p for p in placed):
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _at(root, path)
        placed.append(path)
    return out


def _dict_prefix(root: Any, path: list[str]) -> list[str]:
    """`path` up to the first segment whose container is a list."""
    node = root
    for i, part in enumerate(path):
        if not isinstance(node, dict):
            return path[: i - 1] if i > 1 else path[:1]
        node = node.get(part)
    return path


def schema_types(schema: Any, root: Any) -> list[str]:
    """The JSON types a value of `schema` may take, first declared first: its `type`, else its
    `anyOf` / `oneOf` options', refs followed within `root` (each node once)."""
    types: list[str] = []
    stack, seen = [schema], set()
    while stack:
        node = ref_target(stack.pop(), root)
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        declared = node.get("type")
        if isinstance(declared, str):
            types.append(declared)
        elif isinstance(declared, list):
            types += [t for t in declared if isinstance(t, str)]
        else:
            options = node.get("anyOf") or node.get("oneOf") or []
            stack += reversed(options) if isinstance(options, list) else []
    return list(dict.fromkeys(types))
