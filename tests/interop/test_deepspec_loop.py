"""Our engine against DeepSpec's own evaluation loop (its source, not a re-reading of it).

A tiny random Qwen3 target and a tiny full-vocabulary DSpark drafter started from the target's
layers (`init_draft(..., from_target=True)`, no training: τ ≈ 1.8 on these prompts). The drafter
is saved in DeepSpec format and loaded strictly by DeepSpec's `Qwen3DSparkModel`; the target is
loaded by transformers from the same Hugging Face directory (fp32). DeepSpec's
`Qwen3DSparkEvaluator.generate_one_sample` (its `generate_decoding_sample` + `verify_draft_tokens`)
decodes the prompts at T = 0; so do our `Engine(scheduler="fixed", budget_rule="deepspec")` and
`speculative_generate` (what `dspark_jax.evaluate` runs). Required: identical tokens, identical
per-round proposal lengths / accepted drafts / acceptance lengths, and identical τ, verify rate
and per-position counts and rates — ours from `eval.acceptance.acceptance_stats` (what
results.json reports), DeepSpec's from its evaluator's `allreduce_response_metrics` +
`build_metrics_row` (a one-process gloo group).

The prompts, the stop token and the budget are chosen so that every rule is exercised: a stop
token as the correction/bonus token, stop tokens among the accepted drafts (DeepSpec counts
eos_pos + 1, no bonus), requests ending on the budget, and one whose rounds land exactly on the
budget (DeepSpec's `while start < max_length` runs one more full-block round).

Skips with a reason where `../shared/reference/deepspec` (beside the repository) or torch is
absent.
"""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

DEEPSPEC_ROOT = (pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "reference"
                 / "deepspec")
if not (DEEPSPEC_ROOT / "deepspec" / "eval" / "base_evaluator.py").is_file():
    pytest.skip(f"DeepSpec's source is not at {DEEPSPEC_ROOT} (../shared is absent in a user's "
                "clone)", allow_module_level=True)
torch = pytest.importorskip("torch", reason="DeepSpec's loop runs in PyTorch")

from dspark_jax.serving import speculative_generate  # noqa: E402
from dspark_jax.eval.acceptance import acceptance_stats  # noqa: E402
from dspark_jax.models import init_draft, load_target  # noqa: E402
from dspark_jax.serving import Engine  # noqa: E402
from hf_tiny import load_hf, save_tiny_hf  # noqa: E402

GAMMA = 4
DRAFT_CFG = dict(block_size=GAMMA, num_draft_layers=1, target_layer_ids=(0, 1),
                 mask_token_id=96, markov_rank=8)
_RNG = np.random.default_rng(0)
PROMPTS = [list(map(int, _RNG.integers(3, 96, size=n))) for n in (5, 9, 3, 12, 7, 4)]
STOP = [35]
MAX_NEW = 23
MAX_LEN = 64


def _deepspec():
    if str(DEEPSPEC_ROOT) not in sys.path:
        sys.path.insert(0, str(DEEPSPEC_ROOT))
    from deepspec.eval.dspark.evaluator import Qwen3DSparkEvaluator
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel

    return Qwen3DSparkModel, Qwen3DSparkEvaluator


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("deepspec_loop")
    tdir = save_tiny_hf(base / "target", "qwen3", layers=3, seed=0)
    target = load_target(tdir)
    draft = init_draft(target, DRAFT_CFG, seed=1, from_target=True)
    ddir = base / "draft"
    draft.save(ddir)
    return target, draft, tdir, ddir


@pytest.fixture
def old_cache_crop(monkeypatch):
    """DeepSpec calls `DynamicCache.crop(n)` with the length to keep (transformers < 5)."""
    from transformers import DynamicCache

    orig = DynamicCache.crop

    def crop(self, n):
        if n > 0:
            cur = self.get_seq_length()
            if n < cur:
                orig(self, n - cur)
            return
        orig(self, n)

    monkeypatch.setattr(DynamicCache, "crop", crop)


def _deepspec_run(tdir, ddir, tmp_path):
    import torch.distributed as dist

    Qwen3DSparkModel, Qwen3DSparkEvaluator = _deepspec()
    dm, info = Qwen3DSparkModel.from_pretrained(ddir, dtype=torch.float32,
                                                attn_implementation="sdpa",
                                                output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    from safetensors.torch import load_file

    dm.load_state_dict(load_file(str(ddir / "model.safetensors")), strict=True)
    ev = Qwen3DSparkEvaluator.__new__(Qwen3DSparkEvaluator)   # its __init__ starts NCCL
    ev.args = SimpleNamespace(temperature=0.0, max_new_tokens=MAX_NEW, confidence_threshold=0.0)
    ev.target_model, ev.draft_model = load_hf(tdir), dm.eval()
    ev.device, ev.confidence_head_recorder = torch.device("cpu"), None
    assert ev.max_proposal_tokens == GAMMA
    outs = [ev.generate_one_sample(input_ids=torch.tensor([p]), stop_token_ids=STOP)
            for p in PROMPTS]
    # its dataset metrics, computed by its own code (a one-process group for the all-reduce)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        summary = ev.allreduce_response_metrics(outs)
    finally:
        dist.destroy_process_group()
    row = ev.build_metrics_row(dataset_name="tiny", metric_summary=summary)
    return outs, summary, row


def test_engine_and_deepspec_loop_give_identical_tokens_and_tau(models, old_cache_crop,
                                                                 tmp_path):
    target, draft, tdir, ddir = models
    outs, summary, row = _deepspec_run(tdir, ddir, tmp_path)
    ds_tokens = [o.output_ids[0, o.num_input_tokens:].tolist() for o in outs]

    # the cases this test exists for actually occur in DeepSpec's run
    stop_in_drafts = {i for i, o in enumerate(outs) if o.acceptance_lengths
                      and o.acceptance_lengths[-1] == o.accepted_draft_lengths[-1]}
    assert stop_in_drafts, "no round with a stop token among its accepted drafts"
    assert any(t[-1] in STOP and i not in stop_in_drafts for i, t in enumerate(ds_tokens)), \
        "no request stopped on its correction/bonus token"
    on_budget = [o for t, o in zip(ds_tokens, outs) if len(t) == MAX_NEW and t[-1] not in STOP]
    assert len(on_budget) >= 2, "fewer than two requests ended on the token budget"
    assert any(1 + sum(o.acceptance_lengths[:-1]) == MAX_NEW for o in on_budget), \
        "no request landed exactly on the budget (DeepSpec's extra round)"
    assert row["acceptance_length"] > 1.5, "the drafter is too weak for a meaningful check"

    kw = dict(capacity_buckets=[len(PROMPTS) * (GAMMA + 1)],
              prefill_chunk=sum(len(p) for p in PROMPTS))
    eng = Engine(target, draft, scheduler="fixed", max_requests=len(PROMPTS), max_len=MAX_LEN,
                 stop_token_ids=STOP, budget_rule="deepspec", **kw)
    res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    spec = speculative_generate(target, draft, PROMPTS, max_new_tokens=MAX_NEW,
                                temperature=0.0, stop_token_ids=STOP, max_cache_len=MAX_LEN)
    assert res.tokens == ds_tokens
    assert spec.tokens == ds_tokens
    for i, (o, pr) in enumerate(zip(outs, res.per_request)):
        assert pr["proposed"] == o.proposal_lengths, i
        assert pr["accepted"] == o.accepted_draft_lengths, i
        assert pr["acceptance"] == o.acceptance_lengths, i
        assert spec.proposed[i] == o.proposal_lengths, i
        assert spec.accepted[i] == o.accepted_draft_lengths, i
        assert spec.acceptance[i] == o.acceptance_lengths, i

    # τ and the per-position statistics as results.json reports them
    prop = [x for p in spec.proposed for x in p]
    acc = [x for a in spec.accepted for x in a]
    alen = [x for a in spec.acceptance for x in a]
    st = acceptance_stats(prop, acc, gamma=GAMMA, acceptance=alen)
    assert st.rounds == summary["proposal_count"]
    assert sum(alen) == summary["acceptance_length_sum"]
    assert sum(prop) == summary["proposal_length_sum"]
    assert [sum(p > k for p in prop) for k in range(GAMMA)] == summary["proposals_at_pos"]
    assert [sum(a > k for a in acc) for k in range(GAMMA)] == summary["accepted_at_pos"]
    assert st.tau == row["acceptance_length"] == res.tau == spec.tau
    assert st.verify_rate == row["verify_rate"]
    assert st.to_dict()["accept_rate_at"] == row["accept_rates_by_position"]

    # counting accepted + 1 on every round (no `acceptance`) is not DeepSpec's τ on these prompts
    assert acceptance_stats(prop, acc, gamma=GAMMA).tau > st.tau
