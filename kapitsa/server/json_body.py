"""Request bodies as JSON with every string well formed: a lone UTF-16 surrogate becomes U+FFFD.

JSON may escape half of a surrogate pair (`"a\\ud800b"`); JavaScript clients send one when they cut a
string inside an emoji. Such a string cannot be encoded as UTF-8, so the tokenizer and the response
encoder would fail on it. It is replaced, as a UTF-8 decoder replaces a broken byte sequence, rather
than refused: agents re-send the whole history every turn, so a 400 would end the conversation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

# Only an escaped surrogate can produce one: raw surrogate bytes are invalid UTF-8 and fail to parse.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs into one code point
REPLACEMENT = "\ufffd"


def well_formed(text: str) -> str:
    return _LONE_SURROGATE.sub(REPLACEMENT, text)


def replace_lone_surrogates(value: Any) -> Any:
    """`value` (parsed JSON) with every lone surrogate in its strings and keys replaced; iterative, so
    nesting depth is no concern."""
    if isinstance(value, str):
        return well_formed(value)
    root = [value]
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        pairs = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        if isinstance(node, dict):
            node.clear()
        for key, item in pairs:
            if isinstance(item, str):
                item = well_formed(item)
            elif isinstance(item, (dict, list)):
                stack.append(item)
            node[well_formed(key) if isinstance(key, str) else key] = item
    return root[0]


def parse_json_body(body: bytes) -> Any:
    """The parsed body; lone surrogates replaced (the scan for them only runs when an escape is there)."""
    value = json.loads(body)
    return replace_lone_surrogates(value) if _SURROGATE_ESCAPE.search(body) else value


class _WellFormedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class WellFormedJsonRoute(APIRoute):
    """An `APIRoute` whose JSON body has only well-formed strings (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_WellFormedRequest(request.scope, request.receive))

        return route
