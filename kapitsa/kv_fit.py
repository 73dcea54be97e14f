"""`--kv-bits`: attention K/V in the activation dtype, at 8 or 4 bits, or what doctor's fit picks.

"auto" asks the memory estimate (the one `kapitsa doctor` prints) which precision keeps a
comfortable context next to the weights on this machine's budget: bf16 when it fits, else 8 bits,
else 4 (`memory_estimate.choose_kv_bits`). Kept off the engine: the CLI validates the flag
before anything heavy loads.
"""

from __future__ import annotations

from pathlib import Path

from kapitsa.errors import InvalidRequest

KV_BITS_FLAGS = ("8", "4", "auto", "off")

KvBits = int | str | None  # 8, 4, "auto" or None (off)


def parse_kv_bits(value: str | int | None) -> KvBits:
    """The `--kv-bits` value as 8, 4, "auto" or None; InvalidRequest for anything else."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text not in KV_BITS_FLAGS:
        raise InvalidRequest(f"--kv-bits {value}: choose one of {', '.join(KV_BITS_FLAGS)}")
    if text == "off":
        return None
    return text if text == "auto" else int(text)


def resolve_kv_bits(choice: KvBits, folder: Path) -> int | None:
    """8, 4 or None for a model in `folder`; "auto" runs doctor's fit on this machine's budget."""
    if choice != "auto":
        return choice  # type: ignore[return-value]
    from kapitsa import memory_estimate
    from kapitsa.catalog import arch_for_folder, weight_bytes_on_disk
    from kapitsa.doctor import probe_hardware
    from kapitsa.errors import KapitsaError

    try:
        arch = arch_for_folder(folder)
    except KapitsaError:
        return None  # no config.json to read (a .gguf file): K/V stay as computed
    hardware = probe_hardware(folder)
    return memory_estimate.choose_kv_bits(
        arch,
        usable_bytes=hardware.usable_memory_bytes,
        weight_bytes=weight_bytes_on_disk(folder),
        backend=memory_estimate.gpu_backend(hardware.backend),
    )
