"""What every ahead-of-time program starts from, without a weight on disk: the target's
config.json (a Hugging Face directory, or the shapes of the paper's Qwen3 checkpoints,
`KNOWN_TARGETS`), the target DecoderConfig and the drafter's DraftConfig built from the training
config (SPEC §3–5 fields), and the config's (data, fsdp, tensor) mesh laid on a topology's
devices.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

from dspark_jax.aot.topology import AotError

# Target shapes of the paper's Qwen3 checkpoints (their Hugging Face config.json), so the
# paper's configs compile without the weights on disk.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
              head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)
KNOWN_TARGETS = {
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}


def target_hf_dict(c: Any) -> dict[str, Any]:
    """The target's config.json: from `config.target` (a Hugging Face directory or one of
    KNOWN_TARGETS), else the Qwen3 size named by the config (qwen3_8b_* → qwen3-8b)."""
    from dspark_jax.models.io.hf import read_config_json

    t = str(c.target)
    if t and pathlib.Path(t, "config.json").is_file():
        return dict(read_config_json(pathlib.Path(t)))
    for name in (t.lower(), str(c.name).lower().replace("_", "-")):
        for known, cfg in KNOWN_TARGETS.items():
            if name == known or name.startswith(known + "-"):
                return dict(cfg)
    raise AotError(f"config.target {t!r}: give a Hugging Face directory (only its config.json "
                   f"is read) or one of {sorted(KNOWN_TARGETS)}")


def mesh_and_configs(c: Any, devices: Sequence[Any]) -> tuple[Any, Any, Any]:
    """The config's mesh over `devices`, the target's DecoderConfig (from its config.json or
    preset, no weights) and the DraftConfig — what every abstract program here starts from."""
    from dspark_jax.models.config import DecoderConfig
    from dspark_jax.models.drafters.config import DraftConfig
    from dspark_jax.sharding import make_mesh

    try:
        mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, devices=devices)
    except ValueError as e:
        raise AotError(f"config.mesh: {e}") from None
    t_cfg = DecoderConfig.from_hf_dict(target_hf_dict(c), source=f"target of {c.name}")
    fields = dict(c.draft.to_dict())
    fields["target_layer_ids"] = tuple(int(i) for i in fields["target_layer_ids"])
    if fields["mask_token_id"] == -1:   # auto: no tokenizer here; any row works for shapes
        fields["mask_token_id"] = t_cfg.vocab_size - 1
    if 0 < fields.get("draft_vocab_size", 0) < t_cfg.vocab_size:   # the data chooses the ids;
        fields["draft_vocab"] = tuple(range(fields["draft_vocab_size"]))   # shapes need K only
    return mesh, t_cfg, DraftConfig(target=t_cfg, **fields)
