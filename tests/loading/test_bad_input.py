"""Bad input gives a KapitsaError subclass with a clear message."""

from __future__ import annotations

import json
import struct

import pytest

from kapitsa.engine.loading.loader import load_model
from kapitsa.errors import CheckpointError, InvalidRequest, ModelNotFound, UnsupportedModel


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFound, match="no model at"):
        load_model(tmp_path / "nope")


def test_missing_config(tiny):
    folder = tiny("qwen3_5")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(folder)


def test_corrupt_config(tiny):
    folder = tiny("qwen3_5")
    (folder / "config.json").write_text('{"model_type": "qwen3_5", ')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(folder)


def test_unknown_model_type_names_the_supported_ones(tiny):
    folder = tiny("qwen3_5")
    _edit_config(folder, model_type="llama")
    with pytest.raises(UnsupportedModel, match="'llama'.*nemotron_h.*qwen3_5"):
        load_model(folder)


def test_missing_weight_files(tiny):
    folder = tiny("qwen3_5")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(folder)


def test_missing_shard_named_in_the_index(tiny):
    folder = tiny("nemotron_h", shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="incomplete: 1 of 3 weight files.*00002"):
        load_model(folder)


def test_truncated_safetensors(tiny):
    folder = tiny("qwen3_5")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match="cannot read .*model.safetensors.*incomplete download or corrupt"
    ):
        load_model(folder)


def test_garbage_safetensors(tiny):
    folder = tiny("qwen3_5")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"junk")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(folder)


def test_shapes_not_matching_the_config(tiny):
    folder = tiny("qwen3_5")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="do not match config.json.*shape"):
        load_model(folder)


def test_a_missing_tensor(tiny, tmp_path):
    from safetensors.numpy import load_file

    from kapitsa.engine.loading.safetensors_io import write_safetensors

    folder = tiny("nemotron_h_dense")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["backbone.layers.1.mixer.up_proj.weight"]
    write_safetensors(folder / "model.safetensors", weights)
    with pytest.raises(CheckpointError, match="up_proj"):
        load_model(folder)


def test_pytorch_only_checkpoint(tiny):
    folder = tiny("qwen3_5")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(UnsupportedModel, match="safetensors"):
        load_model(folder)


def test_unknown_quantization(tiny):
    with pytest.raises(InvalidRequest, match="unknown quantization 'q5'.*4bit"):
        load_model(tiny("qwen3_5"), quantize="q5")


def test_conflicting_quantizations(tiny):
    with pytest.raises(InvalidRequest, match="two quantizations"):
        load_model(f"{tiny('qwen3_5')}:4bit", quantize="8bit")


def test_requantizing_an_mlx_quantized_checkpoint_is_refused(tiny):
    folder = tiny("qwen3_5")
    first = load_model(folder, quantize="4bit")
    # save it the way mlx-lm does: quantized tensors plus a `quantization` block
    import numpy as np
    from mlx.utils import tree_flatten

    from kapitsa.engine.loading.safetensors_io import write_safetensors

    weights = {k: np.array(v) for k, v in tree_flatten(first.model.parameters())}
    for name in list(folder.glob("*.safetensors")):
        name.unlink()
    write_safetensors(folder / "model.safetensors", weights, metadata={"format": "mlx"})
    _edit_config(folder, quantization={"group_size": 64, "bits": 4})
    assert load_model(folder).info.quantization == "4bit"
    with pytest.raises(InvalidRequest, match="already quantized \\(4bit\\)"):
        load_model(folder, quantize="8bit")


def test_a_plain_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(UnsupportedModel, match="not a .gguf"):
        load_model(path)


def test_checkpoint_quantized_by_another_tool_is_refused(tiny):
    folder = tiny("qwen3_5")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="quantized with 'fp8'"):
        load_model(folder)


def test_modelopt_side_file_names_the_quantizer(tiny):
    """NVIDIA ModelOpt exports may name their method only in `hf_quant_config.json`."""
    folder = tiny("qwen3_5")
    side = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    (folder / "hf_quant_config.json").write_text(json.dumps(side))
    with pytest.raises(UnsupportedModel, match=r"quantized with 'modelopt \(NVFP4\)'"):
        load_model(folder)


def test_an_mlx_checkpoint_beside_a_leftover_side_file_loads(tiny, tmp_path):
    from mlx_lm import convert

    converted = tmp_path / "mlx-4bit"
    convert(str(tiny("qwen3_5")), str(converted), quantize=True, q_bits=4, q_group_size=64)
    (converted / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    assert load_model(converted).info.quantization == "4bit"
