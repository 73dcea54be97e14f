"""The model-reference grammar, one for the catalog and the loader: `source[@revision][:tag]`.

`source` is a catalog alias (`27b`), a Hugging Face repo id (`Qwen/Qwen3.5-27B`), a folder or a
`.gguf` file; a `:tag` naming a known quantization (`:4bit`, `:bf16`) is that quantization, any other
tag a variant (`:Q4_K_M` picks a file in a GGUF repo, `27b:q8_0` a catalog quant). Pure syntax: no MLX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kapitsa.errors import ModelNotFound

# The names loading.quantize.QUANT_SPECS can quantize to (a test keeps the two equal); kept here so
# parsing a reference imports no MLX. "small" is the mixed recipe of loading/small_rule.py.
QUANTIZATIONS = frozenset(
    {
        "2bit",
        "3bit",
        "4bit",
        "5bit",
        "6bit",
        "8bit",
        "mxfp4",
        "nvfp4",
        "mxfp8",
        "bf16",
        "fp16",
        "fp32",
        "small",
    }
)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, slots=True)
class ModelRef:
    source: str  # the alias, path or repo id, without `@revision` or `:tag`
    quantization: str | None = None  # "4bit", "bf16", ... from a `:4bit` tag, lowercased
    variant: str | None = None  # any other tag, as typed (a GGUF quant `Q4_K_M`, a catalog quant)
    revision: str = "main"  # from `org/repo@revision`

    @property
    def tag(self) -> str | None:
        """The `:tag` whatever it names: what a catalog alias takes as its quant name."""
        return self.quantization or self.variant


def parse_model_ref(spec: str) -> ModelRef:
    """Split `source[@revision][:tag]`; an existing path wins whole, even with ':' or '@' in it.

    Raises:
        ModelNotFound: the reference is empty.
    """
    source, tag = spec.strip(), None
    if not source or source.startswith(":"):
        raise ModelNotFound("empty model name")
    if Path(source).expanduser().exists():
        return ModelRef(source)
    head, sep, tail = source.rpartition(":")
    # "C:\\models" (a drive letter) and "a/b:c/d" are not tags
    if sep and head and len(head) > 1 and tail and "/" not in tail and "\\" not in tail:
        source, tag = head, tail
    revision = "main"
    if "@" in source and not Path(source).expanduser().exists():
        source, revision = source.rsplit("@", 1)
    if tag is not None and tag.lower() in QUANTIZATIONS:
        return ModelRef(source, quantization=tag.lower(), revision=revision)
    return ModelRef(source, variant=tag, revision=revision)


def is_repo_id(text: str) -> bool:
    """`org/name` as the Hugging Face hub spells repo ids (a relative path like `./a/b` is not one)."""
    return bool(REPO_ID.match(text)) and not text.startswith((".", "~"))
