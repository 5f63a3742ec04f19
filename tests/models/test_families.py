"""The family registry (models/families.py): one record per family, no family tests elsewhere."""

from __future__ import annotations

import pathlib
import re

import pytest

from dspark_jax.models import DecoderConfig, DraftConfig
from dspark_jax.models.config import ConfigError
from dspark_jax.models.families import FAMILIES, family, family_by_deepspec_prefix

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_round_trips_its_config_json(name):
    extra = {"qk_norm": True} if name in ("qwen3", "gemma4") else {}
    if name == "gemma4":
        extra.update(hidden_act="gelu_pytorch_tanh", sliding_window=4,
                     layer_types=("sliding_attention",) * 5 + ("full_attention",))
    cfg = DecoderConfig(family=name, **TINY, **extra)
    hf = cfg.to_hf_dict()
    assert hf["architectures"][0] in family(name).hf_architectures
    back = DecoderConfig.from_hf_dict(hf)
    assert back.family == name and back.to_hf_dict() == hf
    assert back.num_params() == cfg.num_params() > 0


def test_drafter_layers_come_from_the_family_record():
    for name, fam in FAMILIES.items():
        assert family_by_deepspec_prefix(fam.deepspec_prefix) is fam
        assert set(fam.drafter_classes) == {"dspark", "dflash", "eagle3"}
    llama = DecoderConfig(family="llama", **TINY)
    d = DraftConfig(target=llama, num_draft_layers=2)
    assert d.layer_family == "qwen3" and d.layer_config().qk_norm
    assert d.layer_config().family == "qwen3" and d.layer_config().num_hidden_layers == 2
    with pytest.raises(ConfigError, match="cannot serve a llama target"):
        DraftConfig(target=llama, layer_family="gemma4")
    with pytest.raises(ConfigError, match="unknown model family"):
        family("mamba")


def test_no_family_name_tests_outside_the_family_modules():
    """`is_gemma4` / `family == "gemma4"` style branches live only in the registry and the
    family packages; everything else asks the family's record."""
    allowed = ("dspark_jax/models/families.py", "dspark_jax/models/gemma4/",
               "dspark_jax/models/llama/")
    pattern = re.compile(r"is_gemma4|is_llama|is_qwen3"
                         r"|\w*family\w*\s*[!=]=\s*[\"'](gemma4|llama|qwen3)"
                         r"|[\"'](gemma4|llama|qwen3)[\"']\s*[!=]=\s*\w*family")
    bad = []
    for f in (ROOT / "dspark_jax").rglob("*.py"):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(allowed):
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
