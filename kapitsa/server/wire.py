"""The base of every request body the server reads (OpenAI chat, completions and Responses,
Anthropic Messages)."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator


class WireModel(BaseModel):
    """A request body. Unknown fields are dropped for client compatibility; NaN/inf never pass as
    numbers; JSON null for a field that has a default and takes no null (`stream`, `n`, `store`)
    means that default, as the APIs' optional fields do (SDKs and proxies send explicit nulls)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or _takes_null(cls.model_fields.get(k))}


def _takes_null(field: Any) -> bool:
    """Whether a null is the field's to judge: unknown or required fields, and those that accept None."""
    if field is None or field.is_required():
        return True
    annotation = field.annotation
    return annotation is Any or type(None) in get_args(annotation)
