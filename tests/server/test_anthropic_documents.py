"""Anthropic `document` and `search_result` blocks: text documents are read, PDFs become a note (a
session whose history holds one goes on), in user messages and tool results (FakeEngine)."""

from __future__ import annotations

import anthropic
import pytest
from server_harness import live_server

from kapitsa.errors import InvalidRequest
from kapitsa.server.anthropic_documents import readable_blocks

PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}


def test_a_text_document_reads_as_its_title_context_and_text() -> None:
    block = {
        "type": "document",
        "title": "notes.txt",
        "context": "from the repo",
        "source": {"type": "text", "media_type": "text/plain", "data": "line one"},
    }
    assert readable_blocks(block) == [
        {"type": "text", "text": "Document: notes.txt\nfrom the repo\n\nline one"}
    ]


def test_a_content_document_keeps_its_text_and_image_blocks() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    block = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": "a"}, image]},
    }
    assert readable_blocks(block) == [{"type": "text", "text": "a"}, image]


def test_a_pdf_url_or_file_becomes_a_note_naming_it() -> None:
    (note,) = readable_blocks({**PDF, "title": "spec.pdf"})
    assert "PDF document (spec.pdf)" in note["text"] and "left out" in note["text"]
    assert (
        "URL"
        in readable_blocks({"type": "document", "source": {"type": "url", "url": "https://x"}})[0]["text"]
    )


def test_a_search_result_reads_as_its_title_source_and_text() -> None:
    block = {
        "type": "search_result",
        "source": "https://docs.example/a",
        "title": "A",
        "content": [{"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}],
    }
    assert (
        readable_blocks(block)[0]["text"] == "Search result: A\nSource: https://docs.example/a\n\nalpha\nbeta"
    )


@pytest.mark.parametrize(
    "block",
    [
        {"type": "document"},
        {"type": "document", "source": {"type": "zip"}},
        {"type": "search_result", "content": "x"},
    ],
)
def test_malformed_blocks_are_a_clear_error(block) -> None:
    with pytest.raises(InvalidRequest):
        readable_blocks(block)


def test_a_session_with_a_pdf_in_its_history_goes_on() -> None:
    with live_server() as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=10)
        messages = [
            {"role": "user", "content": [PDF, {"type": "text", "text": "Summarize it"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [PDF]}]},
        ]
        claude.messages.create(model="fake", messages=messages, max_tokens=8)
        sent = server.engine.requests[-1].messages
        assert "PDF document" in sent[0]["content"] and "Summarize it" in sent[0]["content"]
        tool = next(m for m in sent if m["role"] == "tool")
        assert "PDF document" in tool["content"]
