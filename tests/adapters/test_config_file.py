"""Config files: ``ToMAConfig.save`` and ``toma.load_config``."""

from __future__ import annotations

import json

import pytest
import torch

import toma
from toma.config import CONFIG_VERSION

from tests.tiny_models import make_sd15_unet, unet_inputs


@pytest.mark.parametrize(
    "config",
    [
        toma.ToMAConfig(),
        toma.ToMAConfig(
            ratio=0.25,
            tile_size=(2, 4),
            selection="grid",
            temperature=0.0,
            recompute_every=3,
            share_batch_plan=True,
            seed=7,
            levels=3,
            merge_crossattn=True,
            merge_mlp=True,
            proportional_attention=False,
            attn_ratio=0.5,
            crossattn_ratio=0.1,
            mlp_ratio=0.0,
        ),
        toma.ToMAConfig(blocks={"transformer_blocks": range(2, 5), "single_transformer_blocks": [0, 3]}, tile_frames=1),
        toma.ToMAConfig(flux_double_blocks=(1, 2), flux_single_blocks=[4], proportional_attention=True),
    ],
)
def test_save_and_load_round_trip(tmp_path, config):
    path = config.save(tmp_path / "c.json", provenance={"measured": "nothing", "speedup": 1.5})
    assert toma.load_config(path) == config
    doc = json.loads(path.read_text())
    assert doc["format"] == "toma-config" and doc["version"] == CONFIG_VERSION
    assert doc["provenance"] == {"measured": "nothing", "speedup": 1.5}
    assert set(doc["settings"]) == set(config.to_dict())


def test_missing_settings_take_their_defaults(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "toma-config", "version": 1, "settings": {"ratio": 0.4}}))
    assert toma.load_config(path) == toma.ToMAConfig(ratio=0.4)


def test_apply_toma_takes_a_loaded_config_bitwise_like_the_original(tmp_path):
    model = make_sd15_unet()
    inputs = unet_inputs(1, 16, 16, sdxl=False)
    with torch.no_grad():
        plain = model(**inputs).sample
    config = toma.ToMAConfig(ratio=0.5, merge_mlp=True, mlp_ratio=0.25)
    path = config.save(tmp_path / "c.json")
    outs = []
    for cfg in (config, toma.load_config(path)):
        toma.apply_toma(model, config=cfg)
        with torch.no_grad():
            outs.append(model(**inputs).sample)
        toma.remove_toma(model)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], plain)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not valid JSON"),
        ('["a"]', "field 'format' must be 'toma-config'"),
        ('{"format": "other", "version": 1, "settings": {}}', "field 'format' must be 'toma-config'; got 'other'"),
        ('{"format": "toma-config", "version": 99, "settings": {}}', "field 'version' must be an int from 1 to"),
        ('{"format": "toma-config", "settings": {}}', "field 'version'"),
        ('{"format": "toma-config", "version": 1, "settings": [0.5]}', "field 'settings' must be an object"),
        ('{"format": "toma-config", "version": 1, "settings": {"ratio": 0.5, "speed": 2}}', "unknown setting(s) speed"),
        (
            '{"format": "toma-config", "version": 1, "settings": {"ratio": 1.5}}',
            "setting 'ratio': ratio must be in [0, 1)",
        ),
        ('{"format": "toma-config", "version": 1, "settings": {"tile_size": "big"}}', "setting 'tile_size'"),
        (
            '{"format": "toma-config", "version": 1, "settings": {"mlp_ratio": 0.9}}',
            "settings do not go together: mlp_ratio is set but merge_mlp is off",
        ),
        ('{"format": "toma-config", "version": 1, "settings": {}, "provenance": 3}', "field 'provenance'"),
    ],
)
def test_bad_files_name_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(toma.ConfigFileError) as err:
        toma.load_config(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_missing_file_and_unserialisable_provenance(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        toma.load_config(tmp_path / "nope.json")
    with pytest.raises(TypeError):
        toma.ToMAConfig().save(tmp_path / "c.json", provenance={"x": object()})
    assert not (tmp_path / "c.json").exists()
    with pytest.raises(TypeError, match="provenance must be a dict"):
        toma.ToMAConfig().save(tmp_path / "c.json", provenance=[1])
