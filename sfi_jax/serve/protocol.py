"""The OpenAI request bodies the server accepts (pydantic models that reject unknown fields and
out-of-range values) and the OpenAI-style error body every failure is answered with."""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# OpenAI fields a client may send that change nothing here: accepted and ignored.
IGNORED_FIELDS = ("user",)


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    user: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)  # None: 1, or 0 in exact mode
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension: sample from the k best tokens (0 = off)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # extension
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        if v != 0:
            raise ValueError(f"{info.field_name} is not supported (only 0), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension: usage in every chunk


_Body.model_rebuild()


class CompletionRequest(_Body):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = False
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v):
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v

    @field_validator("logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v is not None:
            raise ValueError(f"{info.field_name} is not supported")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class ChatCompletionRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _describe(err: dict) -> tuple[str, str | None]:
    """One line and the top-level field for a pydantic error."""
    loc = [str(x) for x in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if err["type"] == "extra_forbidden":
        if len(loc) == 1:
            return (f"unknown parameter '{where}'", param)
        return (f"unknown field '{where}'", param)
    if err["type"] == "missing":
        return (f"'{where}' is required", param)
    if err["type"] == "value_error":  # our validators name the value themselves
        return (f"{where}: {err['msg'].removeprefix('Value error, ')}", param)
    got = err.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool, type(None))) else None
    return (f"{where}: {err['msg']}" + (f" (got {shown})" if shown is not None else ""), param)


def parse(raw: bytes, model: type[BaseModel]):
    """The request body as `model`, or an APIError(400) naming the first bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        errors = e.errors()
        prompt = [err for err in errors if err["loc"][:1] == ("prompt",)]
        if prompt:  # a prompt that fits none of its shapes: one line, not one per shape
            said = [err for err in prompt if err["type"] in ("value_error", "missing")]
            if said:
                raise APIError(400, _describe(said[0])[0], "prompt") from None
            raise APIError(400, "prompt must be a string, a list of token ids, or a list with "
                                "one of those", "prompt") from None
        message, param = _describe(errors[0])
        raise APIError(400, message, param) from None
