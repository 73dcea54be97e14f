"""The model catalog: aliases (`27b`, `27b:6bit`, `bolt`, `demo`) → where the weights live, plus the
architecture numbers the memory estimate needs.

The built-in entries live in `catalog.toml` beside this file; users add or override entries through
settings (`[catalog.<alias>]` in the config file). Everything here returns plain frozen dataclasses and
prints nothing, so the CLI, the TUI and the server can all use it.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from kapitsa.engine.loading.model_ref import is_repo_id, parse_model_ref
from kapitsa.engine.loading.small_rule import SMALL
from kapitsa.errors import ModelNotFound, NoRoutedExperts

# MLX affine quantization stores a 16-bit scale and bias per group of 64 weights: +0.5 bit.
_BITS_BY_QUANT = {
    "2bit": 2.5,
    "3bit": 3.5,
    "4bit": 4.5,
    "5bit": 5.5,
    "6bit": 6.5,
    "8bit": 8.5,
    "mxfp4": 4.25,
    "nvfp4": 4.5,
    "mxfp8": 8.25,
    "q8_0": 8.5,
    "q4_k_m": 4.85,
    "q6_k": 6.56,
    "bf16": 16.0,
    "fp16": 16.0,
}
_ARCH_KEYS = (
    "hidden_size",
    "vocab_size",
    "attention_layers",
    "linear_layers",
    "mamba_layers",
    "num_kv_heads",
    "head_dim",
    "linear_key_heads",
    "linear_value_heads",
    "linear_key_dim",
    "linear_value_dim",
    "mamba_heads",
    "mamba_head_dim",
    "mamba_state_size",
    "mamba_groups",
    "conv_kernel",
    "vision_hidden_size",
    "vision_image_patches",
    "expert_params_b",
    "attention_heads",
    "mlp_width",
    "moe_layers",
    "params_b",
    "active_params_b",
    "context_length",
    "max_output",
)


@dataclass(slots=True, frozen=True)
class Architecture:
    """What memory a model needs: its weights, KV per token, and fixed recurrent state per sequence.

    `linear_*` are Gated DeltaNet (Qwen3.5/Qwen3-Next) layers, `mamba_*` Mamba-2 (Nemotron-H) layers.
    """

    params_b: float
    active_params_b: float
    context_length: int
    max_output: int
    hidden_size: int
    vocab_size: int
    attention_layers: int
    num_kv_heads: int
    head_dim: int
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    mamba_layers: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_groups: int = 0
    conv_kernel: int = 4
    vision_hidden_size: int = 0  # the vision tower's width; 0: the model reads text only
    vision_image_patches: int = 0  # patches of the image one encoding is budgeted for (SCREENSHOT)
    expert_params_b: float = 0.0  # parameters in routed experts (what `:small` keeps at 2 bits); 0: dense
    # A GPU prefill's per-layer memory (memory_estimate.gpu_layer_bytes); 0: unknown, the estimate
    # falls back to its rule of thumb
    attention_heads: int = 0  # query heads of an attention layer
    mlp_width: int = 0  # the dense MLP's (or the shared expert's) intermediate width
    moe_layers: int = 0  # layers with routed experts

    @property
    def takes_images(self) -> bool:
        return self.vision_hidden_size > 0

    @property
    def is_moe(self) -> bool:
        return self.expert_params_b > 0


@dataclass(slots=True, frozen=True)
class Quant:
    name: str
    repo_id: str
    bits_per_weight: float
    allow_patterns: tuple[str, ...] | None = None


@dataclass(slots=True, frozen=True)
class CatalogEntry:
    alias: str
    name: str
    rank: int  # higher = more capable; doctor recommends the highest-ranked model that fits
    model_type: str | None = None
    arch: Architecture | None = None  # None: read from the checkpoint's config.json (demo, local folders)
    quants: tuple[Quant, ...] = ()
    default_quant: str | None = None
    package_path: str | None = None  # folder inside the kapitsa package (the demo)
    estimated: bool = False  # architecture numbers not read from a primary config
    small_source: str = "bf16"  # the quant `:small` re-quantizes on load (kapitsa.engine.loading.small)

    def quant(self, name: str | None) -> Quant:
        wanted = name or self.default_quant
        for quant in self.quants:
            if quant.name == wanted:
                return quant
        names = ", ".join(q.name for q in self.quants) or "none"
        raise ModelNotFound(f"model {self.alias!r} has no quant {wanted!r} (available: {names})")


@dataclass(slots=True, frozen=True)
class ResolvedModel:
    """A model reference resolved to one source of weights."""

    ref: str  # what the user typed
    kind: Literal["hf", "path"]
    display_name: str  # the id agents and the server use: the alias when there is one
    entry: CatalogEntry | None = None
    quant: Quant | None = None
    repo_id: str | None = None
    path: Path | None = None
    allow_patterns: tuple[str, ...] | None = None
    quantize: str | None = None  # a recipe the loader applies to these weights ("small")

    @property
    def source(self) -> str:
        """What the loader reads: the folder, else the repo id."""
        return str(self.path if self.kind == "path" else self.repo_id)


@dataclass(slots=True, frozen=True)
class Catalog:
    entries: dict[str, CatalogEntry] = field(default_factory=dict)

    def get(self, alias: str) -> CatalogEntry:
        entry = self.entries.get(alias.lower())
        if entry is None:
            known = ", ".join(sorted(self.entries))
            raise ModelNotFound(f"unknown model {alias!r}; catalog aliases: {known}")
        return entry

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(sorted(self.entries.values(), key=lambda e: (e.rank, e.alias)))


def load_catalog(user_entries: dict[str, dict[str, Any]] | None = None) -> Catalog:
    """The built-in catalog with the user's entries merged over it (a user key replaces a built-in one)."""
    raw = tomllib.loads(resources.files("kapitsa").joinpath("catalog.toml").read_text("utf-8"))["models"]
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in raw.items()}
    for alias, fields in (user_entries or {}).items():
        merged[alias.lower()] = {**merged.get(alias.lower(), {}), **fields}
    return Catalog({alias: _parse_entry(alias, fields) for alias, fields in merged.items()})


def _parse_entry(alias: str, fields: dict[str, Any]) -> CatalogEntry:
    try:
        arch = None
        if "package_path" not in fields and "path" not in fields:
            arch = Architecture(**{k: fields[k] for k in _ARCH_KEYS if k in fields})
        quants = tuple(_parse_quant(name, value) for name, value in fields.get("quants", {}).items())
        return CatalogEntry(
            alias=alias,
            name=fields.get("name", alias),
            rank=int(fields.get("rank", 0)),
            model_type=fields.get("model_type"),
            arch=arch,
            quants=quants,
            default_quant=fields.get("default_quant") or (quants[0].name if quants else None),
            package_path=fields.get("package_path"),
            estimated=bool(fields.get("estimated")),
            small_source=str(fields.get("small_source", "bf16")),
        )
    except (TypeError, ValueError, KeyError) as err:
        raise ModelNotFound(f"catalog entry {alias!r} is malformed: {err}") from err


def _parse_quant(name: str, value: str | dict[str, Any]) -> Quant:
    if isinstance(value, str):
        value = {"repo": value}
    bits = value.get("bits_per_weight", _BITS_BY_QUANT.get(name.lower().removeprefix("optiq-")))
    if bits is None:
        raise ValueError(f"quant {name!r} needs bits_per_weight")
    patterns = value.get("allow_patterns")
    return Quant(
        name=name,
        repo_id=value["repo"],
        bits_per_weight=float(bits),
        allow_patterns=tuple(patterns) if patterns else None,
    )


def resolve_model(ref: str, catalog: Catalog) -> ResolvedModel:
    """Resolve a catalog alias (with optional `:quant`), an existing folder or file, or an HF repo id."""
    parsed = parse_model_ref(ref)
    if parsed.source.lower() in catalog.entries:
        if parsed.revision != "main":
            raise ModelNotFound(
                f"{ref!r}: a catalog alias has no @revision; pin a revision on its repo id instead"
            )
        return _resolve_entry(ref, catalog.get(parsed.source), parsed.tag)
    path = Path(ref).expanduser()
    if path.exists():
        return ResolvedModel(ref=ref, kind="path", display_name=path.name, path=path.resolve())
    if is_repo_id(ref):
        return ResolvedModel(ref=ref, kind="hf", display_name=ref, repo_id=ref)
    known = ", ".join(sorted(catalog.entries))
    raise ModelNotFound(
        f"{ref!r} is not a catalog alias ({known}), an existing path, or a Hugging Face repo id"
    )


def is_alias(ref: str, catalog: Catalog) -> bool:
    """Whether `ref` names a catalog entry (`27b`, `27b:6bit`), not a path or a repo id."""
    return parse_model_ref(ref).source.lower() in catalog.entries


def _resolve_entry(ref: str, entry: CatalogEntry, quant_name: str | None) -> ResolvedModel:
    if entry.package_path is not None:
        if quant_name:
            raise ModelNotFound(f"model {entry.alias!r} has no quants")
        return ResolvedModel(
            ref=ref, kind="path", display_name=entry.alias, entry=entry, path=package_model_path(entry)
        )
    if quant_name and quant_name.lower() == SMALL:
        return _resolve_small(ref, entry)
    quant = entry.quant(quant_name)
    display = entry.alias if quant.name == entry.default_quant else f"{entry.alias}:{quant.name}"
    return ResolvedModel(
        ref=ref,
        kind="hf",
        display_name=display,
        entry=entry,
        quant=quant,
        repo_id=quant.repo_id,
        allow_patterns=quant.allow_patterns,
    )


def _resolve_small(ref: str, entry: CatalogEntry) -> ResolvedModel:
    """`alias:small`: the entry's `small_source` weights with the recipe applied on load."""
    quants = ", ".join(q.name for q in entry.quants)
    if entry.arch is not None and not entry.arch.is_moe and entry.arch.active_params_b < entry.arch.params_b:
        raise NoRoutedExperts(  # a MoE entry whose routed experts' size the catalog does not give
            f"{entry.alias!r} ({entry.name}) has no ':small' in the catalog: the recipe's fit needs the size "
            f"of its routed experts, which is not listed; pick a uniform quant ({quants}), or load its bf16 "
            "folder or repo id with ':small'"
        )
    if entry.arch is None or not entry.arch.is_moe:
        raise NoRoutedExperts(
            f"{entry.alias!r} ({entry.name}) is a dense model: ':small' keeps routed experts at 2 bits "
            f"and it has none; pick a uniform quant ({quants})"
        )
    source = entry.quant(entry.small_source)
    return ResolvedModel(
        ref=ref,
        kind="hf",
        display_name=f"{entry.alias}:{SMALL}",
        entry=entry,
        quant=source,
        repo_id=source.repo_id,
        allow_patterns=source.allow_patterns,
        quantize=SMALL,
    )


def package_model_path(entry: CatalogEntry) -> Path:
    """The folder of a model shipped inside the package; a clear error while it is not there."""
    folder = Path(str(resources.files("kapitsa").joinpath(entry.package_path or "")))
    if not (folder / "config.json").is_file():
        raise ModelNotFound(
            f"the {entry.alias!r} model is not in this kapitsa install "
            f"(expected a checkpoint with config.json in {folder})"
        )
    return folder


# The image the memory estimate budgets one vision encoding for: a full-HD screenshot, what coding
# agents send (a checkpoint's processor may accept far larger images).
SCREENSHOT = (1920, 1080)


def screenshot_patches(patch_size: int) -> int:
    return (SCREENSHOT[0] // patch_size) * (SCREENSHOT[1] // patch_size)


def arch_from_config(config: dict[str, Any]) -> Architecture:
    """Architecture numbers from a Hugging Face config.json (qwen3_5, qwen3_5_moe, qwen3_next,
    nemotron_h and their vision-language forms: the tower's width from `vision_config`)."""
    arch = _text_arch(config)
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or not vision.get("hidden_size"):
        return arch
    patches = screenshot_patches(int(vision.get("patch_size") or 16))
    return dataclasses.replace(
        arch, vision_hidden_size=int(vision["hidden_size"]), vision_image_patches=patches
    )


def _text_arch(config: dict[str, Any]) -> Architecture:
    cfg = config.get("text_config") or config.get("llm_config") or config
    layers = int(cfg["num_hidden_layers"])
    if "hybrid_override_pattern" in cfg or "layers_block_type" in cfg:
        kinds = _nemotron_layer_kinds(cfg)
        return _arch_common(
            cfg,
            attention_layers=kinds.count("attention"),
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim", 128) or cfg["hidden_size"] // cfg["num_attention_heads"],
            mamba_layers=kinds.count("mamba"),
            mamba_heads=cfg["mamba_num_heads"],
            mamba_head_dim=cfg["mamba_head_dim"],
            mamba_state_size=cfg["ssm_state_size"],
            mamba_groups=cfg["n_groups"],
            conv_kernel=cfg.get("conv_kernel", 4),
            moe_layers=kinds.count("moe"),
        )
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(layers)
    ]
    return _arch_common(
        cfg,
        attention_layers=kinds.count("full_attention"),
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim", 256) or cfg["hidden_size"] // cfg["num_attention_heads"],
        linear_layers=kinds.count("linear_attention"),
        linear_key_heads=cfg["linear_num_key_heads"],
        linear_value_heads=cfg["linear_num_value_heads"],
        linear_key_dim=cfg["linear_key_head_dim"],
        linear_value_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        moe_layers=layers if cfg.get("num_experts") else 0,
    )


def _mlp_width(cfg: dict[str, Any]) -> int:
    """The intermediate width of a layer's dense MLP: the shared expert's in a MoE model (its routed
    experts are counted by expert_params_b), else `intermediate_size`."""
    for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"):
        if cfg.get(key):
            return int(cfg[key])
    if cfg.get("num_experts") or cfg.get("n_routed_experts"):
        return 0
    return int(cfg.get("intermediate_size") or 0)


def _nemotron_layer_kinds(cfg: dict[str, Any]) -> list[str]:
    if "layers_block_type" in cfg:
        return list(cfg["layers_block_type"])
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    return [names[c] for c in cfg["hybrid_override_pattern"]]


def _arch_common(cfg: dict[str, Any], **shape: Any) -> Architecture:
    # The parameter count is not in config.json; the checkpoint's size on disk is used instead (hub.py).
    return Architecture(
        attention_heads=int(cfg.get("num_attention_heads") or 0),
        mlp_width=_mlp_width(cfg),
        params_b=0.0,
        active_params_b=0.0,
        context_length=int(cfg.get("max_position_embeddings", 0)),
        max_output=min(32768, int(cfg.get("max_position_embeddings", 32768))),
        hidden_size=int(cfg["hidden_size"]),
        vocab_size=int(cfg["vocab_size"]),
        **shape,
    )


def arch_for_folder(folder: Path) -> Architecture:
    """Architecture of a local checkpoint folder (its config.json)."""
    try:
        config = json.loads((folder / "config.json").read_text("utf-8"))
        return arch_from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelNotFound(f"cannot read the architecture of {folder}: {err}") from err


def weight_bytes_on_disk(folder: Path) -> int:
    """Bytes of weights in a checkpoint folder: what loading it puts in memory."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".gguf"))
