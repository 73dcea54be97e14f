"""KernelOptions.from_environ: each KAPITSA_* lab variable sets its field; unknown values are errors."""

from __future__ import annotations

import pytest

from kapitsa.engine.options import DEFAULT_FUSED_PARTS, FUSED_PARTS, KERNEL_FAMILIES, KernelOptions


def test_unset_variables_keep_the_defaults() -> None:
    options = KernelOptions.from_environ({})
    assert options == KernelOptions()
    assert options.families is None and options.fused_parts == DEFAULT_FUSED_PARTS == {"norm", "residual"}


@pytest.mark.parametrize(
    "value,families",
    [
        ("all", set(KERNEL_FAMILIES)),
        ("1", set(KERNEL_FAMILIES)),
        ("none", set()),
        ("0", set()),
        (" gdn, Mamba ", {"gdn", "mamba"}),
        ("qmv", {"qmv"}),
    ],
)
def test_kernels_names_the_families(value, families) -> None:
    assert KernelOptions.from_environ({"KAPITSA_KERNELS": value}).families == families


@pytest.mark.parametrize(
    "value,parts",
    [
        ("1", set(FUSED_PARTS)),
        ("all", set(FUSED_PARTS)),
        ("0", set()),
        (" norm, residual ", {"norm", "residual"}),
        ("act,glu", {"act", "glu"}),
    ],
)
def test_fused_norms_names_the_parts(value, parts) -> None:
    assert KernelOptions.from_environ({"KAPITSA_FUSED_NORMS": value}).fused_parts == parts


@pytest.mark.parametrize(
    "variable,value,message",
    [
        ("KAPITSA_KERNELS", "gdn,fold", "unknown ['fold']"),
        ("KAPITSA_FUSED_NORMS", "norms", "unknown ['norms']"),
        ("KAPITSA_SSD_CHUNK", "big", "not a positive integer"),
        ("KAPITSA_SSD_CHUNK", "0", "ssd_chunk must be >= 1"),
        ("KAPITSA_MOE_DEQUANT", "maybe", "use 1 or 0"),
        ("KAPITSA_FOLD_SHARED_EXPERTS", "2", "use 1 or 0"),
        ("KAPITSA_COMPILE_DECODE", "yes please", "use 1 or 0"),
        ("KAPITSA_MOE_MAX_PAIRS", "-1", "not an integer from 0 to 72"),
        ("KAPITSA_MOE_MAX_PAIRS", "73", "moe_max_pairs must be between 0 and 72"),
    ],
)
def test_unknown_values_are_errors(variable, value, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KernelOptions.from_environ({variable: value})


@pytest.mark.parametrize(
    "environ,field,value",
    [
        ({"KAPITSA_QLINEAR": "stock"}, "routed_linears", False),
        ({"KAPITSA_QLINEAR": " Stock "}, "routed_linears", False),
        ({"KAPITSA_QLINEAR": "routed"}, "routed_linears", True),
        ({"KAPITSA_MOE_DEQUANT": "0"}, "moe_dequant", False),
        ({"KAPITSA_MOE_DEQUANT": "1"}, "moe_dequant", True),
        ({"KAPITSA_SSD_CHUNK": " 64 "}, "ssd_chunk", 64),
        ({"KAPITSA_FOLD_SHARED_EXPERTS": "1"}, "fold_shared_experts", True),
        ({"KAPITSA_FOLD_SHARED_EXPERTS": "off"}, "fold_shared_experts", False),
        ({"KAPITSA_COMPILE_DECODE": "0"}, "compile_decode", False),
        ({"KAPITSA_COMPILE_DECODE": "on"}, "compile_decode", True),
        ({"KAPITSA_MOE_MAX_PAIRS": " 72 "}, "moe_max_pairs", 72),
        ({"KAPITSA_MOE_MAX_PAIRS": "0"}, "moe_max_pairs", 0),
    ],
)
def test_each_variable_sets_its_field(environ, field, value) -> None:
    options = KernelOptions.from_environ(environ)
    assert getattr(options, field) == value
    others = {f: getattr(KernelOptions(), f) for f in KernelOptions.__slots__ if f != field}
    assert {f: getattr(options, f) for f in others} == others  # and nothing else


def test_direct_construction_checks_names() -> None:
    with pytest.raises(ValueError, match="unknown kernel families"):
        KernelOptions(families=frozenset({"qmv_stream"}))
    with pytest.raises(ValueError, match="unknown fused parts"):
        KernelOptions(fused_parts=frozenset({"rope"}))
