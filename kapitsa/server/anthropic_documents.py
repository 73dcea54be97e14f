"""Anthropic `document` and `search_result` blocks as the text and image blocks a local model reads.

A plain-text or content document becomes its text (with its title and context); a search result its
title, source and text. A PDF, a URL or an uploaded file cannot be read here: it becomes a note that
says so, so the model can tell the user, and a session whose history holds one (Claude Code's Read
tool returns PDFs as documents) goes on instead of failing every later turn.
"""

from __future__ import annotations

from typing import Any

from kapitsa.errors import InvalidRequest

_UNREADABLE = {"base64": "a PDF document", "url": "a document at a URL", "file": "an uploaded file"}


def readable_blocks(block: dict[str, Any]) -> list[dict[str, Any]]:
    """The text (and image) blocks a `document` or `search_result` block reads as."""
    if block.get("type") == "search_result":
        return [_text(_search_result_text(block))]
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest("A `document` block needs a `source` object.")
    kind = source.get("type")
    head = _heading(block)
    if kind == "text" and isinstance(source.get("data"), str):
        return [_text(head + source["data"])]
    if kind == "content":
        return _content_blocks(head, source.get("content"))
    what = _UNREADABLE.get(kind) if isinstance(kind, str) else None
    if what is None:
        raise InvalidRequest(
            f"A `document` block's source type {kind!r} is not one of text, content, base64, url, file."
        )
    title = f" ({block['title']})" if isinstance(block.get("title"), str) and block["title"] else ""
    return [_text(f"[{what}{title}: the served model reads text and images only, so it is left out]")]


def _heading(block: dict[str, Any]) -> str:
    lines = [f"Document: {block['title']}" if isinstance(block.get("title"), str) and block["title"] else ""]
    lines.append(block["context"] if isinstance(block.get("context"), str) else "")
    head = "\n".join(line for line in lines if line)
    return head + "\n\n" if head else ""


def _content_blocks(head: str, content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [_text(head + content)]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise InvalidRequest("A `content` document source needs `content`: a string or a list of blocks.")
    kept = [b for b in content if b.get("type") in ("text", "image")]
    if head:
        kept.insert(0, _text(head.rstrip("\n")))
    return kept


def _search_result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if not isinstance(content, list):
        raise InvalidRequest("A `search_result` block needs `content`: a list of text blocks.")
    texts = [b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)]
    head = [
        f"Search result: {block.get('title', '')}".rstrip(),
        f"Source: {block.get('source', '')}".rstrip(),
    ]
    return "\n".join([*(h for h in head if not h.endswith(":")), "", *texts])


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}
