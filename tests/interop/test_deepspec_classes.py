"""Our exported drafters in DeepSpec's own classes and evaluation code.

For every target family (tiny Qwen3, tiny Llama, tiny Gemma4 without per-layer inputs or KV
sharing) and every drafter kind we export (DSpark with a vanilla / gated / RNN Markov head,
DFlash, Eagle3), a randomly initialised drafter with visibly non-trivial norms, biases and
Markov bias is saved with `Draft.save`, and then, with DeepSpec's source
(`../shared/reference/deepspec`, imported, never copied):

  * DeepSpec's `eval.py` dispatch (`AutoConfig.from_pretrained(dir).architectures[0]` →
    `EVALUATORS`) picks the evaluator, whose `draft_model_cls.from_pretrained` (the evaluator's
    own load, fp32, SDPA) reports no missing / unexpected / mismatched tensor, and
    `load_state_dict(model.safetensors, strict=True)` passes;
  * DeepSpec's evaluator code (`_init_context` / `_propose`, built without NCCL as
    DEEPSPEC.md says) proposes one round at T = 0 from the target's prefill of a prompt (the
    Hugging Face target, fp32, SDPA, tapped by DeepSpec's own `extract_context_feature`), and
    the logits it computes — the backbone's base logits, the Markov-corrected logits its
    sampler draws from, the confidence logits; Eagle3's per-step chain logits — equal ours
    (`Draft.block_logits`; `Eagle3Draft.commit` / `propose`) on the same features to 1e-4.

DeepSpec's Gemma4 classes were written against an older transformers 5 Gemma4 API; under the
pinned transformers the Gemma4 cases restore it for the test only (`_gemma4_transformers_shims`,
like DEEPSPEC.md's `DynamicCache.crop`), without touching DeepSpec's or transformers' math.

Our target's own taps (`Target.hidden_states`, layer i = output of layer i, −1 = embeddings)
are checked against DeepSpec's `extract_context_feature` (hidden_states[i + 1]) separately.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import pathlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

DEEPSPEC = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepspec"
if not (DEEPSPEC / "deepspec").is_dir():
    pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent; a "
                "user's clone has none)", allow_module_level=True)
torch = pytest.importorskip("torch", reason="DeepSpec's classes are PyTorch modules")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dspark_jax.models import init_draft, load_target  # noqa: E402
from hf_tiny import save_tiny_gemma4, save_tiny_hf  # noqa: E402

sys.path.insert(0, str(DEEPSPEC.resolve()))
from deepspec.modeling.dspark.common import extract_context_feature  # noqa: E402
from deepspec.modeling.dspark.gemma4 import modeling as dspark_gemma4  # noqa: E402
from deepspec.modeling.eagle3.common import (extract_eagle3_context_feature,  # noqa: E402
                                             validate_eagle3_target_layer_ids)
from deepspec.modeling.eagle3.gemma4 import modeling as eagle3_gemma4  # noqa: E402


def _deepspec_evaluators() -> dict[str, type]:
    """`EVALUATORS` of DeepSpec's eval.py (architecture name → evaluator class)."""
    spec = importlib.util.spec_from_file_location("deepspec_eval_script", DEEPSPEC / "eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.EVALUATORS


EVALUATORS = _deepspec_evaluators()

FAMILIES = ("qwen3", "llama", "gemma4")
KINDS = ("dspark", "gated", "rnn", "dflash", "eagle3")
N_TARGET_LAYERS = 6
PROMPT_LEN = 11
# DSpark taps include −1 (the embeddings, hidden_states[0]); Eagle3 takes exactly five decoder
# layers (DeepSpec's validate_eagle3_target_layer_ids) and one draft layer (its evaluator)
BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(-1, 1, 4), mask_token_id=4)
DRAFTS = {
    "dspark": dict(BASE, markov_rank=8),
    "gated": dict(BASE, markov_rank=8, markov_head_type="gated"),
    "rnn": dict(BASE, markov_rank=8, markov_head_type="rnn", confidence_head_with_markov=False),
    "dflash": dict(BASE, model_type="dflash", markov_rank=0, enable_confidence_head=False),
    "eagle3": dict(model_type="eagle3", target_layer_ids=(0, 1, 2, 3, 4), mask_token_id=4,
                   draft_num_hidden_layers=1, ttt_length=4, block_size=4),
}
TOL = 1e-4


def _save_target(path: pathlib.Path, family: str) -> pathlib.Path:
    if family == "gemma4":
        # k=v full attention with its own head dim, proportional ¼-rotated RoPE, softcap, tied
        # head; per-layer inputs and KV sharing off (DeepSpec's Gemma4 drafters refuse them)
        return save_tiny_gemma4(path, "all_features", seed=5, num_hidden_layers=N_TARGET_LAYERS,
                                layer_types=["sliding_attention", "full_attention"] * 3,
                                hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    return save_tiny_hf(path, family, seed=3, layers=N_TARGET_LAYERS)


@pytest.fixture(scope="module")
def family_target(tmp_path_factory):
    """family → (our Target, the Hugging Face target), built once per family on first use."""
    built: dict[str, tuple] = {}

    def get(family: str):
        if family not in built:
            path = _save_target(tmp_path_factory.mktemp(family), family)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa").eval()
            built[family] = (load_target(path, with_tokenizer=False), hf)
        return built[family]

    return get


def _prefill(hf, seed: int = 0):
    """The evaluator loop's prefill at T = 0: prompt ids [1, S], the target output (with
    hidden_states) and its greedy first token."""
    ids = np.random.RandomState(seed).randint(5, 90, PROMPT_LEN)
    input_ids = torch.as_tensor(ids[None], dtype=torch.long)
    with torch.no_grad():
        out = hf(input_ids=input_ids, position_ids=torch.arange(PROMPT_LEN)[None],
                 use_cache=True, output_hidden_states=True)
    return ids, out, int(out.logits[0, -1].argmax())


def _exported(target, kind: str, path: pathlib.Path, seed: int = 1):
    """A random drafter with non-trivial norms, layer scalars and biases, and a Markov bias that
    matters, saved in DeepSpec's format → (draft, config.json)."""
    draft = init_draft(target, DRAFTS[kind], seed=seed)
    graphdef, state = nnx.split(draft.model)
    rng = np.random.RandomState(seed)

    def perturb(keypath, x):
        name = "/".join(str(getattr(p, "key", p)) for p in keypath)
        leaf = name.rsplit("/", 1)[-1]
        x = np.asarray(x)
        if "norm" in name or "scalar" in name:
            return x * (1.0 + 0.2 * rng.randn(*x.shape)).astype(x.dtype)
        if "markov" in name and leaf == "w2":
            return x * 40.0
        if leaf == "b" or leaf.endswith("_b"):          # confidence / gate / joint biases
            return x + (0.5 * rng.randn(*x.shape)).astype(x.dtype)
        return x

    pure = jax.tree_util.tree_map_with_path(perturb, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    draft = type(draft).from_model(nnx.merge(graphdef, state))
    draft.save(path)
    return draft, json.loads((path / "config.json").read_text())


class _RotaryTakingLayerType(transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding):
    """Gemma4TextRotaryEmbedding with the older transformers 5 constructor DeepSpec calls,
    `(config, layer_type="full_attention")`: newer ones take `(config, device)` and build every
    type in `config.layer_types` (a drafter's are all "full_attention", the one DeepSpec asks
    for) from `config.per_layer_config`; `forward(x, position_ids, layer_type)` is unchanged."""

    def __init__(self, config, device=None, layer_type=None):
        assert layer_type is None or set(config.layer_types) == {layer_type}
        super().__init__(config, device)


def _gemma4_transformers_shims(monkeypatch, config, raw: dict) -> None:
    """DeepSpec's Gemma4 classes use the older transformers 5 Gemma4 API (like its
    `DynamicCache.crop`, DEEPSPEC.md); restores it for the test only, where it is missing:
      * Gemma4TextConfig kept `global_head_dim` / `num_global_key_value_heads` as attributes
        (transformers 5.24 folds them into `per_layer_config`, and DeepSpec's constructors
        assert `config.num_global_key_value_heads must be provided.`): set from config.json;
      * Gemma4TextRotaryEmbedding took `layer_type=` (5.24: TypeError): `_RotaryTakingLayerType`.
    The math stays DeepSpec's and transformers'."""
    for field in ("global_head_dim", "num_global_key_value_heads"):
        if not hasattr(config, field):
            setattr(config, field, raw[field])
    for mod in (dspark_gemma4, eagle3_gemma4):
        if "layer_type" not in inspect.signature(mod.Gemma4TextRotaryEmbedding).parameters:
            monkeypatch.setattr(mod, "Gemma4TextRotaryEmbedding", _RotaryTakingLayerType)


def _deepspec_evaluator(ck: pathlib.Path, expect_arch: str, monkeypatch, **args):
    """eval.py's dispatch and the evaluator's `build_models` draft load (fp32 on CPU), plus a
    strict state-dict load; the evaluator object is built without `__init__` (NCCL)."""
    config = transformers.AutoConfig.from_pretrained(ck)
    arch = config.architectures[0]
    assert arch == expect_arch
    evaluator_cls = EVALUATORS[arch]
    if arch.startswith("Gemma4"):
        _gemma4_transformers_shims(monkeypatch, config,
                                   json.loads((ck / "config.json").read_text()))
    model, info = evaluator_cls.draft_model_cls.from_pretrained(
        ck, config=config, dtype=torch.float32,
        attn_implementation=evaluator_cls.EVAL_ATTN_IMPLEMENTATION, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"DeepSpec's from_pretrained of our export: {problems}"
    keys = model.load_state_dict(load_file(ck / "model.safetensors"), strict=True)
    assert not keys.missing_keys and not keys.unexpected_keys
    model = model.float().eval()
    evaluator = evaluator_cls.__new__(evaluator_cls)
    evaluator.args = SimpleNamespace(temperature=0.0, **args)
    evaluator.draft_model = model
    evaluator.device = torch.device("cpu")
    evaluator.confidence_head_recorder = None
    return evaluator


def _record(model, method: str, log: list) -> None:
    """Wraps model.<method> so every return value is appended to `log` (DeepSpec's own code
    keeps running; only its intermediate logits are observed)."""
    inner = getattr(model, method)

    def wrapped(*a, **kw):
        out = inner(*a, **kw)
        log.append(out)
        return out

    setattr(model, method, wrapped)


class _LegacyCropCache(transformers.DynamicCache):
    """DynamicCache with transformers 4's `crop(n)`: keep the first n positions (DeepSpec's
    call; transformers 5 takes a negative count, DEEPSPEC.md)."""

    def crop(self, n: int) -> None:
        super().crop(min(0, n - self.get_seq_length()) if n > 0 else n)


def _close(ours, ref, what: str) -> None:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err = np.abs(ours - ref).max()
    assert err <= TOL * max(1.0, np.abs(ref).max()), f"{what}: max |ours − DeepSpec| = {err:.3g}"


def _arch(family: str, kind: str) -> str:
    return ("Gemma4" if family == "gemma4" else "Qwen3") + (
        "Eagle3Model" if kind == "eagle3" else "DSparkModel")


# ----------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", FAMILIES)
def test_our_taps_are_deepspec_context_features(family_target, family):
    """Target.hidden_states(ids, layer_ids) == DeepSpec's extract_context_feature of the
    Hugging Face hidden_states (layer i → hidden_states[i + 1], −1 → hidden_states[0])."""
    ours_target, hf = family_target(family)
    ids, out, _ = _prefill(hf)
    layer_ids = [-1, 0, 1, 2, 3, 4]
    ref = extract_context_feature(out.hidden_states, layer_ids)[0].numpy()
    _close(ours_target.hidden_states(ids[None], layer_ids)[0], ref, f"{family} taps")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["dspark", "gated", "rnn", "dflash"])
def test_dspark_block_in_deepspec_evaluator(family_target, family, kind, tmp_path, monkeypatch):
    ours_target, hf = family_target(family)
    draft, cfg = _exported(ours_target, kind, tmp_path / "ck")
    g = cfg["block_size"]
    ev = _deepspec_evaluator(tmp_path / "ck", _arch(family, kind), monkeypatch,
                             confidence_threshold=0.0)
    model = ev.draft_model
    assert ev.max_proposal_tokens == g == draft.config.num_drafts
    assert (model.markov_head is None) == (kind == "dflash")
    assert (model.confidence_head is None) == (kind == "dflash")

    ids, out, anchor = _prefill(hf)
    S = PROMPT_LEN
    output_ids = torch.zeros((1, S + g + 1), dtype=torch.long)
    output_ids[0, :S] = torch.as_tensor(ids)
    output_ids[0, S] = anchor
    position_ids = torch.arange(output_ids.shape[1])[None]
    base_log, sample_log = [], []
    _record(model, "compute_logits", base_log)
    _record(model, "sample_draft_tokens", sample_log)
    with torch.no_grad():
        ctx = ev._init_context(initial_output=out, output_ids=output_ids,
                               position_ids=position_ids, num_input_tokens=S)
        ctx.past_key_values_draft = _LegacyCropCache()
        proposal = ev._propose(context=ctx, output_ids=output_ids, position_ids=position_ids,
                               start=S, stop_token_ids=None)
    assert ctx.past_key_values_draft.get_seq_length() == S     # the evaluator cropped to start
    (base,), ((sampled, logits),) = base_log, sample_log
    sampled = sampled[0].numpy()
    assert proposal.draft_token_count == g
    np.testing.assert_array_equal(proposal.verify_input_ids[0].numpy(),
                                  np.concatenate([[anchor], sampled]))

    feats = ctx.target_hidden_states[0].numpy()                 # DeepSpec's own taps
    assert feats.shape == (S, draft.config.num_features * draft.config.target.hidden_size)
    prev = np.concatenate([[anchor], sampled[:-1]])             # DeepSpec's chain at T = 0
    ours = draft.block_logits(feats, anchor, S, prev)
    _close(ours["base_logits"], base[0].numpy(), "base logits")
    _close(ours["logits"], logits[0].numpy(), "Markov-corrected logits")
    np.testing.assert_array_equal(ours["logits"].argmax(-1), sampled)
    if kind == "dflash":
        assert ours["confidence_logits"] is None and proposal.confidence_logits is None
    else:
        _close(ours["confidence_logits"], proposal.confidence_logits[0].numpy(),
               "confidence logits")
        # the Markov bias visibly matters, so a dropped / mis-laid head cannot pass
        assert np.abs(ours["logits"] - ours["base_logits"]).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_eagle3_chain_in_deepspec_evaluator(family_target, family, tmp_path, monkeypatch):
    ours_target, hf = family_target(family)
    draft, cfg = _exported(ours_target, "eagle3", tmp_path / "ck")
    validate_eagle3_target_layer_ids(cfg["target_layer_ids"], cfg["num_target_layers"])
    assert cfg["draft_num_hidden_layers"] == 1       # the evaluator's __init__ requires it
    ev = _deepspec_evaluator(tmp_path / "ck", _arch(family, "eagle3"), monkeypatch)
    model = ev.draft_model
    g = ev.max_proposal_tokens
    assert g == cfg["ttt_length"] == draft.config.num_drafts

    ids, out, anchor = _prefill(hf)
    S = PROMPT_LEN
    output_ids = torch.zeros((1, S + g + 1), dtype=torch.long)
    output_ids[0, :S] = torch.as_tensor(ids)
    output_ids[0, S] = anchor
    position_ids = torch.arange(output_ids.shape[1])[None]
    step_logits: list = []
    _record(model, "compute_logits", step_logits)
    with torch.no_grad():
        ctx = ev._init_context(initial_output=out, output_ids=output_ids,
                               position_ids=position_ids, num_input_tokens=S)
        proposal = ev._propose(context=ctx, output_ids=output_ids, position_ids=position_ids,
                               start=S, stop_token_ids=None)
    assert proposal.draft_token_count == g and len(step_logits) == g
    ref = torch.cat(step_logits, dim=1)[0].numpy()                          # [γ, V]
    tokens = proposal.verify_input_ids[0, 1:].numpy()

    # ours: commit the prompt's pairs (g_t, x_{t+1}), x_S = the anchor; chain γ steps greedily
    feats = extract_eagle3_context_feature(out.hidden_states, cfg["target_layer_ids"]).numpy()
    m = draft.model
    cache = m.init_cache(1, S + g)
    cache = m.commit(cache, jnp.asarray(feats), jnp.asarray(np.append(ids[1:], anchor)[None]),
                     jnp.asarray([S]))
    chain = m.propose(cache, jax.random.PRNGKey(0), 0.0, g,
                      sample_fn=lambda key, lg: jnp.argmax(lg, -1),
                      probs_fn=lambda lg: lg)                   # "probs" = the logits
    _close(np.asarray(chain["probs"])[0], ref, "Eagle3 chain logits")
    np.testing.assert_array_equal(np.asarray(chain["tokens"])[0], tokens)


def test_eagle3_proposal_length_survives(family_target, tmp_path, monkeypatch):
    """DeepSpec's Eagle3 evaluator proposes ttt_length tokens a round; an Eagle3 DraftConfig
    ties its γ (block_size) to ttt_length, so no consumer drafts a different number."""
    ours_target, _ = family_target("qwen3")
    draft = init_draft(ours_target, dict(DRAFTS["eagle3"], block_size=3), seed=1)
    assert draft.config.num_drafts == draft.config.ttt_length == 4
    draft.save(tmp_path / "ck")
    ev = _deepspec_evaluator(tmp_path / "ck", "Qwen3Eagle3Model", monkeypatch)
    assert ev.max_proposal_tokens == draft.config.num_drafts
