"""Anthropic-defined client tools (bash, text editor, memory, computer use) as function tools.

A request names these tools by a versioned `type` alone (`{"type": "bash_20250124", "name": "bash"}`):
Claude knows their input schemas, a local model does not. The client runs them, so the local model
gets each as a function tool with the schema Anthropic documents for its version, under the
request's `name`, which its `tool_use` blocks then carry. Other families (web search, web fetch, code
execution, tool search) run on Anthropic's servers, and the nameless `computer_toolset_*` entries
declare a tool per action, a shape not mapped here: those stay out of the prompt.

Sources: the tool pages of Anthropic's docs (bash, text editor, memory, computer use) and the
`anthropic` SDK's tool types. The text editor's `insert` takes `insert_text` from `20250429` on, as
Claude 4 models send it (anthropic-sdk-python#1155), and `new_str` before.
"""

from __future__ import annotations

import copy
import re
from typing import Any

_VERSIONED = re.compile(r"^([a-z][a-z_]*?)_(\d{8})$")

_POINT = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}

_BASH = {
    "description": "Run commands in a persistent bash shell: state such as the working directory and "
    "environment variables carries over between calls. Set `restart` to true to start a fresh shell.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "description": "The bash command to run. Required unless restarting.",
            },
            "restart": {"type": "boolean", "description": "True restarts the shell; otherwise leave it out."},
        },
    },
}


def _editor(date: str) -> dict[str, Any]:
    """The text editor of one version: `undo_edit` until 20250429, which also renames insert's text."""
    claude_4 = date >= "20250429"
    commands = ["view", "create", "str_replace", "insert"] + ([] if claude_4 else ["undo_edit"])
    insert_key = "insert_text" if claude_4 else "new_str"
    properties: dict[str, Any] = {
        "command": {"type": "string", "enum": commands, "description": "The command to run."},
        "path": {"type": "string", "description": "Absolute path to the file or directory."},
        "file_text": {"type": "string", "description": "`create`: the content of the new file."},
        "old_str": {
            "type": "string",
            "description": "`str_replace`: the exact text to replace, unique in the file.",
        },
        "new_str": {"type": "string", "description": "`str_replace`: the text that replaces `old_str`."},
        "insert_line": {
            "type": "integer",
            "description": "`insert`: the line after which to insert (0: the top).",
        },
        insert_key: {"type": "string", "description": "`insert`: the text to insert."},
        "view_range": {
            **_POINT,
            "description": "`view` of a file: [start, end] line numbers, from 1; an end of -1 reads to the end.",
        },
    }
    if not claude_4:
        properties["new_str"]["description"] += " `insert`: the text to insert."
    undo = " `undo_edit` reverts the last edit of `path`." if not claude_4 else ""
    return {
        "description": "View, create and edit text files. `view` shows a file with line numbers or lists a "
        "directory; `create` writes a new file; `str_replace` replaces one exact, unique occurrence of "
        f"`old_str` with `new_str`; `insert` adds text after line `insert_line`.{undo}",
        "parameters": {"type": "object", "properties": properties, "required": ["command", "path"]},
    }


_MEMORY = {
    "description": "Read and write your memory: files under the /memories directory that persist between "
    "conversations. View the directory before starting a task, and record progress and what you learn as "
    "you go. Commands: view (a file with line numbers, or a directory), create, str_replace, insert, "
    "delete, rename.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "enum": ["view", "create", "str_replace", "insert", "delete", "rename"],
                "description": "The command to run.",
            },
            "path": {
                "type": "string",
                "description": "The file or directory, under /memories (not for rename).",
            },
            "view_range": {**_POINT, "description": "`view`: [start, end] line numbers of a file."},
            "file_text": {"type": "string", "description": "`create`: the content of the file."},
            "old_str": {"type": "string", "description": "`str_replace`: the exact text to replace."},
            "new_str": {"type": "string", "description": "`str_replace`: the replacement text."},
            "insert_line": {"type": "integer", "description": "`insert`: the line at which to insert."},
            "insert_text": {"type": "string", "description": "`insert`: the text to insert."},
            "old_path": {"type": "string", "description": "`rename`: the current path."},
            "new_path": {"type": "string", "description": "`rename`: the new path."},
        },
        "required": ["command"],
    },
}

# Each computer tool version's actions: a later one adds to the one before it.
_ACTIONS_20241022 = [
    "key", "type", "mouse_move", "left_click", "left_click_drag", "right_click",
    "middle_click", "double_click", "screenshot", "cursor_position",
]  # fmt: skip
_ACTIONS_20250124 = [
    *_ACTIONS_20241022,
    *("hold_key", "left_mouse_down", "left_mouse_up", "triple_click", "scroll", "wait"),
]


def _computer(date: str, tool: dict[str, Any]) -> dict[str, Any]:
    """The computer use tool of one version; its description gives the display's size."""
    width, height = tool.get("display_width_px"), tool.get("display_height_px")
    screen = f"The display is {width}x{height} pixels. " if width and height else ""
    if tool.get("display_number") is not None:
        screen += f"It is X11 display :{tool['display_number']}. "
    actions = list(_ACTIONS_20241022 if date < "20250124" else _ACTIONS_20250124)
    properties: dict[str, Any] = {
        "action": {"type": "string", "enum": actions, "description": "The action to perform."},
        "coordinate": {**_POINT, "description": "(x, y): pixels from the left and top edges."},
        "text": {
            "type": "string",
            "description": "`type`: the text; `key`/`hold_key`: a key or combination in xdotool syntax "
            '("Return", "ctrl+s"); on a click or scroll, keys to hold down.',
        },
    }
    if date >= "20250124":
        properties |= {
            "start_coordinate": {**_POINT, "description": "`left_click_drag`: (x, y) where the drag starts."},
            "scroll_direction": {"type": "string", "enum": ["up", "down", "left", "right"]},
            "scroll_amount": {"type": "integer", "description": "`scroll`: clicks of the scroll wheel."},
            "duration": {"type": "number", "description": "`hold_key`/`wait`: seconds."},
        }
    if date >= "20251124" and tool.get("enable_zoom"):
        actions.append("zoom")
        properties["region"] = {
            "type": "array",
            "items": {"type": "integer"},
            "minItems": 4,
            "maxItems": 4,
            "description": "`zoom`: [x1, y1, x2, y2], the top-left and bottom-right corners to view at full size.",
        }
    return {
        "description": "Control the computer's screen, mouse and keyboard: take screenshots, move and click "
        f"the mouse, type and press keys. {screen}Coordinates are pixels from the top-left corner. Take "
        "a screenshot to see the result of an action.",
        "parameters": {"type": "object", "properties": properties, "required": ["action"]},
    }


def client_tool(tool: dict[str, Any]) -> dict[str, Any] | None:
    """The description and parameters of an Anthropic-defined client tool (matched by its type's
    family, so later dated versions work too); None for a type that Anthropic's servers run."""
    match = _VERSIONED.match(str(tool.get("type")))
    if match is None:
        return None
    family, date = match.groups()
    if family == "bash":
        return copy.deepcopy(_BASH)
    if family == "text_editor":
        return _editor(date)
    if family == "memory":
        return copy.deepcopy(_MEMORY)
    if family == "computer":
        return _computer(date, tool)
    return None
