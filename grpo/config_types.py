"""The typed reader of the config dataclasses (GRPOConfig, EvalConfig): every value, whether it comes from a config
file (YAML or JSON), a preset, the command line or Python, is checked against its field's annotation before any
check or computation reads it, and a wrong one is refused in a message that names the field, the value and the type
the field takes.

    bool            true / false (YAML, JSON) or True / False; never a string ("false") or a number (0, 1)
    int             a whole number; a float with no fraction (1e3 in a file) becomes an int; never a bool or a string
    float           a number (an int becomes a float); never a bool or a string ("0.2")
    str             a string
    list[X]         a list (or tuple) whose items are each an X
    tuple[X, Y]     a list or tuple of exactly those items (tuple[X, ...]: any length)
    dict            a mapping with string keys (a JSON object)
    X | None        also None (null, ~)
    choices         a field whose option() has `choices` takes one of them (checked with the type)

Why our own code rather than pydantic, dacite or cattrs (docs/design.md): the config classes stay plain dataclasses
whose fields carry their help, sections and choices; the rules above are stricter than those libraries' defaults
(bool is an int to isinstance, so dacite takes True for an int field; pydantic's lax mode turns "0.2" into 0.2 and
"false" into False) and every message names the setting as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing


class ConfigTypeError(ValueError):
    """A setting whose value is not of its field's type."""


@functools.lru_cache(maxsize=None)
def field_types(config_cls) -> dict[str, object]:
    """{field name: its annotation, resolved} of a config dataclass."""
    return typing.get_type_hints(config_cls)


def describe_type(annotation) -> str:
    """The type as a message says it: `a number`, `a list of strings`, `true or false or null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        named = [describe_type(arg) for arg in args if arg is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} items ({', '.join(describe_type(arg) for arg in args)})"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
             dict: "a mapping of names to values (a JSON object)"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(annotation) -> str:
    return {bool: "true/false values", int: "whole numbers", float: "numbers", str: "strings"}.get(
        annotation, describe_type(annotation))


def describe_value(value) -> str:
    """The value as a message says it: `the string '0.2'`, `the number 3`, `true`."""
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if value is None:
        return "null"
    kind = {list: "list", tuple: "list", dict: "mapping"}.get(type(value), type(value).__name__)
    return f"the {kind} {list(value) if isinstance(value, tuple) else value!r}"


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|infinity|nan)", re.IGNORECASE)


def _hint(value, annotation) -> str:
    """A hint for the common slips: a number or a bool written in quotes."""
    if isinstance(value, str) and (_NUMBER.fullmatch(value.strip()) or value.strip().lower() in ("true", "false")):
        return f" (write {value.strip().lower() if value.strip().lower() in ('true', 'false') else value.strip()} " \
               "without quotes)"
    return ""


def read_value(annotation, value):
    """`value` as a value of `annotation` (ints become floats for a float, an integral float an int for an int,
    lists tuples for a tuple); raises TypeError with the expected type when it is not one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (arg for arg in args if arg is not type(None)):
            try:
                return read_value(arg, value)
            except TypeError:
                continue
        raise TypeError(describe_type(annotation))
    if annotation is typing.Any:
        return value
    if origin is typing.Literal:
        if value in args and not isinstance(value, bool) or value in args and any(arg is value for arg in args):
            return value
        raise TypeError(describe_type(annotation))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise TypeError(describe_type(annotation))
        return [read_value(args[0], item) for item in value] if args else list(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(describe_type(annotation))
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(read_value(args[0], item) for item in value)
        if len(value) != len(args):
            raise TypeError(describe_type(annotation))
        return tuple(read_value(arg, item) for arg, item in zip(args, value))
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif annotation is dict or origin is dict:
        if isinstance(value, dict) and all(isinstance(key, str) for key in value):
            return dict(value)
    elif isinstance(annotation, type) and isinstance(value, annotation):
        return value
    raise TypeError(describe_type(annotation))


def check_value(config_cls, name: str, value, where: str = "settings"):
    """The value of field `name` read as its type (see the module docstring), or ConfigTypeError naming the field,
    the value and the type; a field with `choices` must hold one of them."""
    annotation = field_types(config_cls)[name]
    try:
        value = read_value(annotation, value)
    except TypeError:
        raise ConfigTypeError(f"{where}: {name} must be {describe_type(annotation)}, got {describe_value(value)}"
                              f"{_hint(value, annotation)}") from None
    choices = {f.name: f for f in dataclasses.fields(config_cls)}[name].metadata.get("choices")
    if choices is not None and value is not None and value not in choices:
        raise ConfigTypeError(f"{where}: {name} must be one of {list(choices)}, got {value!r}")
    return value


def read_fields(config_cls, values: dict, where: str = "settings") -> dict:
    """`values` (field name -> value) each read as its field's type; every wrong one named in one ValueError."""
    problems, read = [], {}
    for name, value in values.items():
        try:
            read[name] = check_value(config_cls, name, value, where)
        except ConfigTypeError as error:
            problems.append(str(error))
    if problems:
        raise ConfigTypeError(problems[0] if len(problems) == 1 else
                              "invalid settings:\n  - " + "\n  - ".join(problems))
    return read


def type_problems(config) -> list[str]:
    """The fields of a config object (built in Python, say) whose values are not of their type; those that are get
    their read value in place (an int given for a float becomes a float)."""
    problems = []
    for f in dataclasses.fields(config):
        try:
            setattr(config, f.name, check_value(type(config), f.name, getattr(config, f.name), "settings"))
        except ConfigTypeError as error:
            problems.append(str(error).removeprefix("settings: "))
    return problems
