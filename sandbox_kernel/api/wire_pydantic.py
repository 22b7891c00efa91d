"""The wire models (wire.py) as pydantic sees them: for the local engine's server, whose
FastAPI validates request bodies and writes the OpenAPI document with pydantic. Imported
only when pydantic asks a model for its schema, so never by the kernel's process.

Each model gets a pydantic model of the same name, fields, defaults and bounds (unknown
keys ignored); what that validates is then made into the wire model, with the fields it
was given.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic_core import core_schema as schemas

from sandbox_kernel.api.wire import WireModel


@functools.cache
def pydantic_model(model: type[WireModel]) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for field in model.wire_fields():
        bounds = {name: value for name, value in (("ge", field.spec.ge), ("le", field.spec.le)) if value is not None}
        if field.required:
            info = Field(**bounds)
        elif field.spec.default_factory is not None:
            info = Field(default_factory=field.spec.default_factory, **bounds)
        else:
            info = Field(default=field.spec.default, **bounds)
        fields[field.name] = (field.annotation, info)
    return create_model(model.__name__, __config__=ConfigDict(extra="ignore"), __doc__=model.__doc__,
                        __module__=model.__module__, **fields)


def core_schema(model: type[WireModel], handler: Any) -> schemas.CoreSchema:
    def to_wire_model(validated: BaseModel) -> WireModel:
        return model(**{name: getattr(validated, name) for name in validated.model_fields_set})

    return schemas.no_info_after_validator_function(to_wire_model, handler(pydantic_model(model)))
