"""A tool's parameter schema checked for the shape of JSON Schema, as OpenAI and Anthropic check it.

The structure is checked (each keyword's value has the kind JSON Schema gives it, `type` names one of
its seven types), not the meaning: unknown keywords pass, since clients add their own. Walks iteratively
with a depth cap, so a schema nested thousands deep is a 400, not a RecursionError.
"""

from __future__ import annotations

from typing import Any

from kapitsa.errors import InvalidRequest
from kapitsa.server.errors import param_error

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
MAX_DEPTH = 64
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "not", "contains", "propertyNames")
_SCHEMAS_TOO = ("if", "then", "else", "additionalItems", "unevaluatedItems")


def check_tool_schema(schema: Any, where: str) -> dict[str, Any]:
    """`schema` when it is an object schema; raises `InvalidRequest` (param `tools`) naming `where`."""
    try:
        _check(schema, where)
    except InvalidRequest as err:
        raise param_error("tools", str(err)) from None
    return schema


def _check(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"`{where}` must be a JSON Schema object, not {_kind(schema)}.")
    top = schema.get("type", "object")
    if top != "object" and not (isinstance(top, list) and "object" in top):
        raise InvalidRequest(f'`{where}` must be a schema of `type: "object"`, not {top!r}.')
    stack: list[tuple[Any, str, int]] = [(schema, where, 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"`{where}` is nested more than {MAX_DEPTH} levels deep.")
        stack += [(child, child_path, depth + 1) for child, child_path in _children(node, path)]


def _children(node: Any, path: str) -> list[tuple[Any, str]]:
    """The subschemas of one schema node; raises on a keyword whose value has the wrong kind."""
    if isinstance(node, bool):
        return []
    if not isinstance(node, dict):
        raise InvalidRequest(f"`{path}` must be a schema (an object or a boolean), not {_kind(node)}.")
    _check_type(node.get("type"), path)
    if "required" in node and not _is_list_of(node["required"], str):
        raise InvalidRequest(f"`{path}.required` must be a list of property names.")
    if "enum" in node and not isinstance(node["enum"], list):
        raise InvalidRequest(f"`{path}.enum` must be a list.")
    out: list[tuple[Any, str]] = []
    for key in _SCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise InvalidRequest(f"`{path}.{key}` must be an object of schemas.")
            out += [(sub, f"{path}.{key}.{name}") for name, sub in node[key].items()]
    for key in _SCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise InvalidRequest(f"`{path}.{key}` must be a non-empty list of schemas.")
            out += [(sub, f"{path}.{key}[{i}]") for i, sub in enumerate(node[key])]
    out += [(node[key], f"{path}.{key}") for key in (*_SCHEMAS, *_SCHEMAS_TOO) if key in node]
    items = node.get("items")
    if isinstance(items, list):
        out += [(sub, f"{path}.items[{i}]") for i, sub in enumerate(items)]
    elif "items" in node:
        out.append((items, f"{path}.items"))
    return out


def _check_type(value: Any, path: str) -> None:
    if value is None:
        return
    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(n, str) and n in TYPES for n in names):
        raise InvalidRequest(
            f"`{path}.type` must name JSON Schema types ({', '.join(sorted(TYPES))}), not {value!r}."
        )


def _is_list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) for v in value)


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({value!r:.40})"
