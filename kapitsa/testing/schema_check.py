"""A small JSON Schema checker for tests (the subset the structured-output tests use).

Covers type, enum, const, properties/required/additionalProperties, items/minItems/maxItems,
minimum/maximum, minLength/maxLength, anyOf and local `$ref`s; anything else is not checked.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def schema_errors(value: Any, schema: dict[str, Any], root: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with `value` under `schema` (empty: it validates)."""
    root = root if root is not None else schema
    if "$ref" in schema:
        return schema_errors(value, _resolve(root, schema["$ref"]), root)
    if "anyOf" in schema and not any(not schema_errors(value, s, root) for s in schema["anyOf"]):
        return [f"{value!r} matches no anyOf branch"]
    errors = _type_errors(value, schema.get("type"))
    if errors:
        return errors
    if "enum" in schema and value not in schema["enum"]:
        return [f"{value!r} not in {schema['enum']}"]
    if "const" in schema and value != schema["const"]:
        return [f"{value!r} != {schema['const']!r}"]
    if isinstance(value, dict):
        return _object_errors(value, schema, root)
    if isinstance(value, list):
        return _array_errors(value, schema, root)
    return _scalar_errors(value, schema)


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _type_errors(value: Any, kind: str | list[str] | None) -> list[str]:
    if kind is None:
        return []
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if k == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return []
        if k == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            return []
        if k in _TYPES and isinstance(value, _TYPES[k]) and not (k != "boolean" and isinstance(value, bool)):
            return []
    return [f"{value!r} is not of type {kind}"]


def _object_errors(value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any]) -> list[str]:
    props = schema.get("properties", {})
    errors = [f"missing {key}" for key in schema.get("required", []) if key not in value]
    for key, item in value.items():
        if key in props:
            errors += schema_errors(item, props[key], root)
        elif schema.get("additionalProperties") is False:
            errors.append(f"unexpected key {key}")
    return errors


def _array_errors(value: list[Any], schema: dict[str, Any], root: dict[str, Any]) -> list[str]:
    errors = []
    if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
        errors.append(f"{len(value)} items is out of bounds")
    for item in value:
        errors += schema_errors(item, schema.get("items", {}), root)
    return errors


def _scalar_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return [f"{value!r} has a length out of bounds"]
        return []
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if is_number and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        return [f"{value} is out of bounds"]
    return []
