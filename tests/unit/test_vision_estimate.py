"""Vision-language models in the memory estimate and doctor: one image encoding is budgeted, the
catalog and a checkpoint's config say which models read images."""

from __future__ import annotations

import dataclasses

from kapitsa import memory_estimate as me
from kapitsa.catalog import arch_from_config, load_catalog, screenshot_patches
from kapitsa.doctor import RECORDED_PROFILES, build_report
from kapitsa.testing.tiny import tiny_config
from kapitsa.testing.tiny_tokenizer import token_ids
from kapitsa.testing.tiny_vision import nemotron_vl_config


def test_a_vision_model_budgets_one_image_encoding() -> None:
    arch = load_catalog().get("super-vl").arch
    assert arch is not None and arch.takes_images
    text_only = dataclasses.replace(arch, vision_hidden_size=0, vision_image_patches=0)
    weights = me.weights_bytes(arch, 4.5)
    budget = weights + 3 * 2**30  # room for less than the whole window, so the workspace shows
    alone = {"resident_conversations": 0, "prefetch_bytes": 0}  # no other conversation's checkpoints
    with_vision = me.estimate(arch, usable_bytes=budget, weight_bytes=weights, **alone)
    without = me.estimate(text_only, usable_bytes=budget, weight_bytes=weights, **alone)
    assert me.vision_workspace_bytes(arch) == 8040 * 1280 * 4 * 16  # a 1920x1080 screenshot, 16-px patches
    assert with_vision.workspace_bytes == max(without.workspace_bytes, me.vision_workspace_bytes(arch))
    assert with_vision.workspace_bytes > without.workspace_bytes
    assert with_vision.max_context < without.max_context
    assert me.vision_workspace_bytes(text_only) == 0


def test_the_config_names_the_tower() -> None:
    qwen = tiny_config("qwen3_5")  # published with a vision_config (patch 4 in the tiny one)
    nemotron_vl = nemotron_vl_config(tiny_config("nemotron_h"), token_ids("nemotron"))
    for config, width in ((qwen, 16), (nemotron_vl, 32)):
        arch = arch_from_config(config)
        assert arch.takes_images and arch.vision_hidden_size == width
        assert arch.vision_image_patches == screenshot_patches(4) == 480 * 270
    assert (
        arch_from_config(nemotron_vl).attention_layers
        == arch_from_config(tiny_config("nemotron_h")).attention_layers
    )
    assert not arch_from_config(tiny_config("nemotron_h")).takes_images
    assert not arch_from_config(tiny_config("qwen3_next")).takes_images


def test_doctor_says_which_models_read_images() -> None:
    report = build_report(RECORDED_PROFILES["m4-pro-48gb"], load_catalog())
    images = {fit.alias: fit.takes_images for fit in report.models}
    assert images["super-vl"] and images["4b"] and images["27b"] and images["35b"]
    assert not images["flash-next"] and not images["lightning"] and not images["demo"]
