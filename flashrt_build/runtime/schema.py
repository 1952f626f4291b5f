"""The manifest's schema, written once: `manifest.schema.json` (JSON Schema,
shipped in the package), and a validator for the part of JSON Schema it uses,
so that a serving process needs no jsonschema. The tests check the shipped
schema with the jsonschema library too, and every manifest the suite writes
against it.

Supported: type, const, enum, pattern, minimum, properties, required,
additionalProperties, propertyNames, items, allOf, oneOf, $ref into $defs;
`x-expected` words what a pattern or enum expects, for the message.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("manifest.schema.json")

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


@functools.cache
def manifest_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def schema_problems(value: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every way `value` breaks the schema (the manifest's by default), each
    naming the field by its dotted path (`weights.tensors[0].shape`)."""
    root = manifest_schema() if schema is None else schema
    problems: list[str] = []
    _check(value, root, root, "", problems)
    return problems


def _check(value: Any, schema: dict[str, Any], root: dict[str, Any], key: str, problems: list[str]) -> None:
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        _check(value, root["$defs"][name], root, key, problems)
    for part in schema.get("allOf", []):
        _check(value, part, root, key, problems)
    if "oneOf" in schema:
        attempts = []
        for option in schema["oneOf"]:
            found: list[str] = []
            _check(value, option, root, key, found)
            if not found:
                break
            attempts.append(found)
        else:  # no option fits: say why the closest one did not, an option of the value's type first
            fits = [_type_fits(value, option, root) for option in schema["oneOf"]]
            problems.extend(min(zip(attempts, fits, strict=True), key=lambda a: (not a[1], len(a[0])))[0])
    shown = key or "the manifest"
    if "const" in schema and value != schema["const"]:
        problems.append(f"{shown} is {_brief(value)}, expected {_brief(schema['const'])}")
        return
    if "enum" in schema and value not in schema["enum"]:
        expected = schema.get("x-expected") or " or ".join(str(v) for v in schema["enum"])
        problems.append(f"{shown} is {_brief(value)}, expected {expected}")
        return
    if "type" in schema:
        types = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(_is(value, t) for t in types):
            problems.append(f"{shown} is {_brief(value)}, expected {' or '.join(types)}")
            return
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        problems.append(f"{shown} is {_brief(value)}, expected {schema.get('x-expected', schema['pattern'])}")
    if _is(value, "number") and "minimum" in schema and value < schema["minimum"]:
        problems.append(f"{shown} is {value}, expected at least {schema['minimum']}")
    if isinstance(value, dict):
        _check_object(value, schema, root, key, problems)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], root, f"{key}[{i}]", problems)


def _check_object(
    value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], key: str, problems: list[str]
) -> None:
    for field in schema.get("required", []):
        if field not in value:
            problems.append(f"{key + '.' if key else ''}{field} is missing")
    properties = schema.get("properties", {})
    for field, item in value.items():
        at = f"{key}.{field}" if key else field
        if "propertyNames" in schema and not re.search(schema["propertyNames"].get("pattern", ""), field):
            problems.append(f"{at} is not a valid key here")
        if field in properties:
            _check(item, properties[field], root, at, problems)
        elif isinstance(schema.get("additionalProperties"), dict):
            _check(item, schema["additionalProperties"], root, at, problems)


def _type_fits(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    """Is `value` of the type a schema (or the first it refers to or combines) declares?"""
    while "type" not in schema and ("$ref" in schema or schema.get("allOf")):
        schema = root["$defs"][schema["$ref"].removeprefix("#/$defs/")] if "$ref" in schema else schema["allOf"][0]
    types = schema.get("type", [])
    return any(_is(value, t) for t in ([types] if isinstance(types, str) else types))


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, _TYPES[kind])


def _brief(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
