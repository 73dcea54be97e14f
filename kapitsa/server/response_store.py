"""Stored Responses API responses: what `previous_response_id` continues and `GET`/`DELETE
/v1/responses/{id}` serve.

A stored response keeps its public object and the conversation that continues it: every input item the
model saw (its predecessors' included, instructions excluded, as OpenAI does) followed by its output
items. The store is in memory, bounded by count (the oldest goes first) and by age; a restart forgets it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kapitsa.server.errors import ApiError
from kapitsa.server.settings import MAX_STORED_RESPONSES, STORED_RESPONSE_MAX_AGE_S


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as the client received it
    items: tuple[dict[str, Any], ...]  # the conversation: input items as the model saw them + output items
    stored_at: float


class ResponseStore:
    """Responses by id, oldest first, expiring after `max_age_s`.

    Args:
        max_responses: how many are kept at once.
        max_age_s: how long each stays.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        *,
        max_responses: int = MAX_STORED_RESPONSES,
        max_age_s: float = STORED_RESPONSE_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_responses < 1 or max_age_s <= 0:
            raise ValueError("max_responses must be >= 1 and max_age_s > 0")
        self.max_responses, self.max_age_s, self._clock = max_responses, max_age_s, clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._responses)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep `response` (by its `id`) and the conversation `items` that continue it."""
        self._responses.pop(response["id"], None)
        self._responses[response["id"]] = StoredResponse(dict(response), tuple(items), self._clock())
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored (or has expired)."""
        self._expire()
        return self._responses.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest_kept = self._clock() - self.max_age_s
        while self._responses:
            first = next(iter(self._responses.values()))
            if first.stored_at > oldest_kept:
                return
            self._responses.popitem(last=False)


def previous_conversation(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    """The stored conversation that `previous_response_id` continues ([] without one). An unknown id is
    OpenAI's 400 `previous_response_not_found`."""
    if not previous_response_id:
        return []
    stored = store.get(previous_response_id)
    if stored is None:
        raise ApiError(
            400,
            f"Previous response with id '{previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(stored.items)


def stored_response(store: ResponseStore, response_id: str) -> StoredResponse:
    """The stored response, or OpenAI's 404 for an id that is not (or no longer) stored."""
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", code="not_found")
    return stored


def deletion_body(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def input_items_page(stored: StoredResponse, *, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the input items the model saw (its predecessors'
    included), each with an id, as a page of at most `limit` (1-100) in `order` ("asc" or "desc")
    after the item `after`."""
    if not 1 <= limit <= 100:
        raise ApiError(400, "`limit` must be between 1 and 100.", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "`order` must be `asc` or `desc`.", param="order")
    outputs = len(stored.response.get("output") or [])
    inputs = stored.items[: len(stored.items) - outputs] if outputs else stored.items
    items = [_listed_item(item, stored.response["id"], i) for i, item in enumerate(inputs)]
    if order == "desc":
        items.reverse()
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise ApiError(
                400, f"No input item `{after}` in response '{stored.response['id']}'.", param="after"
            )
        items = items[position + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _listed_item(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """An input item as the API lists it: an id (the client's, else one derived from the response),
    a message's string content as one `input_text` part, and a status."""
    listed = dict(item)
    listed.setdefault("id", f"{response_id.replace('resp_', 'item_', 1)}_{index}")
    if listed.get("type", "message" if "role" in listed else None) == "message":
        listed["type"] = "message"
        if isinstance(listed.get("content"), str):
            listed["content"] = [{"type": "input_text", "text": listed["content"]}]
        listed.setdefault("status", "completed")
    return listed
