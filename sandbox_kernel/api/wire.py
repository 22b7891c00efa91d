"""The base of the wire models (models.py): plain classes whose annotated fields are checked
as they are made, without pydantic.

Why not pydantic here: the kernel's process imports these models at every start, and
pydantic with its core cost that process ~8 MiB and ~100 ms of its start (issue 33), for
checking a few JSON objects per request. The local engine's server, which needs request
validation and an OpenAPI document from FastAPI, still gets them from pydantic: each model
tells pydantic how to validate it (``__get_pydantic_core_schema__``, see wire_pydantic.py),
which only the server's process ever asks.

A model's fields are its class annotations (a name starting with ``_`` or a ClassVar is none);
a class attribute is the field's default, or a :func:`wire_field` with a default factory or
bounds. Making a model, ``Model(**values)`` or ``Model.from_wire(json_object)``, checks every
value, leniently where pydantic was (an int field takes a whole float or a string of digits, a
number field a numeric string), strictly elsewhere (a bool for a bool, a string for a string,
an enum's value, an object for a nested model); it ignores unknown keys and raises
:class:`WireError` naming every field that is wrong (never its value).
"""

from __future__ import annotations

import enum
import math
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar, Union

W = TypeVar("W", bound="WireModel")

_NO_DEFAULT: Any = object()


class WireError(ValueError):
    """Values that do not fit a model: (location, message) pairs, the location a tuple of
    field names and list indexes."""

    def __init__(self, model: str, errors: list[tuple[tuple[Any, ...], str]]) -> None:
        self.model = model
        self.errors = errors
        super().__init__(f"{len(errors)} invalid value(s) for {model}: {self.summary()}")

    def summary(self, limit: int = 5) -> str:
        """Locations and messages only (never the values)."""
        return "; ".join(f"{'.'.join(str(part) for part in loc) or '<root>'}: {message}"
                         for loc, message in self.errors[:limit])


class _Invalid(Exception):
    def __init__(self, errors: list[tuple[tuple[Any, ...], str]]) -> None:
        self.errors = errors


class FieldSpec:
    """A field's default or default factory and bounds, where a plain default is not enough."""

    def __init__(self, default: Any = _NO_DEFAULT, default_factory: Callable[[], Any] | None = None,
                 ge: int | None = None, le: int | None = None) -> None:
        self.default = default
        self.default_factory = default_factory
        self.ge = ge
        self.le = le


def wire_field(default: Any = _NO_DEFAULT, *, default_factory: Callable[[], Any] | None = None,
               ge: int | None = None, le: int | None = None) -> Any:
    """A field's default (or factory of one) with bounds for a number: ``x: int = wire_field(ge=0)``."""
    return FieldSpec(default, default_factory, ge, le)


class Field:
    """One field of a model, its checker made from its annotation."""

    def __init__(self, name: str, annotation: Any, spec: FieldSpec) -> None:
        self.name = name
        self.annotation = annotation
        self.spec = spec
        self.required = spec.default is _NO_DEFAULT and spec.default_factory is None
        self._check = _checker(annotation)

    def default(self) -> Any:
        return self.spec.default_factory() if self.spec.default_factory is not None else self.spec.default

    def check(self, value: Any) -> Any:
        value = self._check(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.spec.ge is not None and value < self.spec.ge:
                raise _Invalid([((), f"Input should be greater than or equal to {self.spec.ge}")])
            if self.spec.le is not None and value > self.spec.le:
                raise _Invalid([((), f"Input should be less than or equal to {self.spec.le}")])
        return value


class WireModel:
    """Base of all wire models: unknown keys ignored, omitempty serialisation via :meth:`to_wire`."""

    _fields: ClassVar[tuple[Field, ...]]
    _names: ClassVar[frozenset[str]]

    def __init__(self, /, **values: Any) -> None:  # positional-only: a key "self" is one more unknown key
        errors: list[tuple[tuple[Any, ...], str]] = []
        for field in self.wire_fields():
            if field.name in values:
                try:
                    value = field.check(values[field.name])
                except _Invalid as exc:
                    errors.extend(((field.name, *loc), message) for loc, message in exc.errors)
                    continue
            elif field.required:
                errors.append(((field.name,), "Field required"))
                continue
            else:
                value = field.default()
            setattr(self, field.name, value)
        if errors:
            raise WireError(type(self).__name__, errors)
        self._set = self._names.intersection(values)

    @classmethod
    def from_wire(cls: type[W], data: Any) -> W:
        """A model from a decoded JSON object (WireError if it is not one of this model)."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise WireError(cls.__name__, [((), "Input should be an object")])
        return cls(**{key: value for key, value in data.items() if isinstance(key, str)})

    @classmethod
    def wire_fields(cls) -> tuple[Field, ...]:
        """The fields, in declaration order (a base class's first), made on first use: the
        annotations are resolved then, not at import."""
        fields = cls.__dict__.get("_fields")
        if fields is None:
            hints = typing.get_type_hints(cls)
            fields = tuple(Field(name, hint, _spec_of(cls, name)) for name, hint in hints.items()
                           if not name.startswith("_") and typing.get_origin(hint) is not ClassVar)
            cls._names = frozenset(field.name for field in fields)
            cls._fields = fields  # last: another thread takes the fields once this is set
        return fields

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict to send: None fields omitted (omitempty)."""
        return {field.name: to_jsonable(value) for field in self.wire_fields()
                if (value := getattr(self, field.name)) is not None}

    def fields_set(self) -> frozenset[str]:
        """The fields given a value when the model was made (the rest have their defaults)."""
        return self._set

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, field.name) == getattr(other, field.name) for field in self.wire_fields())

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        shown = ", ".join(f"{field.name}={getattr(self, field.name)!r}" for field in self.wire_fields())
        return f"{type(self).__name__}({shown})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """How pydantic validates this model: asked by the local engine's server only (FastAPI)."""
        from sandbox_kernel.api import wire_pydantic

        return wire_pydantic.core_schema(cls, handler)


def _spec_of(cls: type, name: str) -> FieldSpec:
    default = getattr(cls, name, _NO_DEFAULT)
    return default if isinstance(default, FieldSpec) else FieldSpec(default)


def to_jsonable(value: Any) -> Any:
    """Models -> their wire dicts (omitempty), enums -> their values; lists, tuples and dicts
    converted recursively; anything else unchanged."""
    if isinstance(value, WireModel):
        return value.to_wire()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {key: to_jsonable(item) for key, item in value.items()}
    return value


# -- checkers: one function per annotation, raising _Invalid -----------------------------------


def _checker(annotation: Any) -> Callable[[Any], Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return lambda value: value
    if origin is Union or origin is types.UnionType:
        return _union_checker(args)
    if origin is list:
        return _list_checker(_checker(args[0]))
    if origin is dict:
        return _dict_checker(_checker(args[1]))
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_checker(annotation)
    if isinstance(annotation, type) and issubclass(annotation, WireModel):
        return _model_checker(annotation)
    raise TypeError(f"no wire check for {annotation!r}")


def _union_checker(members: tuple[Any, ...]) -> Callable[[Any], Any]:
    optional = type(None) in members
    others = tuple(member for member in members if member is not type(None))
    check = _number if set(others) == {int, float} else _checker(others[0]) if len(others) == 1 else None
    if check is None:
        raise TypeError(f"no wire check for a union of {others!r}")

    def checked(value: Any) -> Any:
        return None if value is None and optional else check(value)
    return checked


def _list_checker(item: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise _Invalid([((), "Input should be a valid list")])
        return [element for _, element in _each(item, enumerate(value))]
    return checked


def _dict_checker(item: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _Invalid([((), "Input should be a valid dictionary")])
        if not all(isinstance(key, str) for key in value):
            raise _Invalid([((), "Keys should be strings")])
        return dict(_each(item, value.items()))
    return checked


def _each(item: Callable[[Any], Any], pairs: Iterable[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """(key, checked element) of each pair; _Invalid naming every wrong element by its key."""
    checked, errors = [], []
    for key, element in pairs:
        try:
            checked.append((key, item(element)))
        except _Invalid as exc:
            errors.extend(((key, *loc), message) for loc, message in exc.errors)
    if errors:
        raise _Invalid(errors)
    return checked


def _enum_checker(kind: type[enum.Enum]) -> Callable[[Any], Any]:
    expected = ", ".join(repr(member.value) for member in kind)

    def checked(value: Any) -> enum.Enum:
        try:
            return kind(value)
        except (ValueError, TypeError):
            raise _Invalid([((), f"Input should be {expected}")]) from None
    return checked


def _model_checker(model: type[WireModel]) -> Callable[[Any], Any]:
    def checked(value: Any) -> WireModel:
        try:
            return model.from_wire(value)
        except WireError as exc:
            raise _Invalid(exc.errors) from None
    return checked


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid([((), "Input should be a valid string")])
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid([((), "Input should be a valid boolean")])
    return value


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():  # as pydantic: 5.0 is the int 5
        return int(value)
    if isinstance(value, str) and _INTEGER.fullmatch(value):  # and "5" too
        return int(value)
    raise _Invalid([((), "Input should be a valid integer")])


def _float(value: Any) -> float:
    return float(_number(value))


def _number(value: Any) -> int | float:
    """An int stays an int, a float a float (pydantic's smart union of the two); a numeric
    string is the int or float it spells."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        if _INTEGER.fullmatch(value):
            return int(value)
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if math.isfinite(number):
                return number
    raise _Invalid([((), "Input should be a valid number")])


_INTEGER = re.compile(r"\s*[+-]?\d{1,30}\s*")


_SCALARS: dict[Any, Callable[[Any], Any]] = {str: _str, bool: _bool, int: _int, float: _float}
