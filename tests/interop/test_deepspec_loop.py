"""Our engine against DeepSpec's own evaluation loop (its source, not a re-reading of it), run
by the library's consumer check `dspark_jax.interop.deepspec_loop` (what the training job's
eval stage runs for its "DeepSpec loop tau" line).

A tiny random Qwen3 target and a tiny full-vocabulary DSpark drafter started from the target's
layers (`init_draft(..., from_target=True)`, no training: τ ≈ 1.8 on these prompts). The drafter
is saved in DeepSpec format; `deepspec_evaluator` loads it strictly with DeepSpec's
`Qwen3DSparkModel` beside the target as transformers loads it (`torch_target`, fp32), and
`run_deepspec_loop` runs DeepSpec's `Qwen3DSparkEvaluator.generate_one_sample` (its
`generate_decoding_sample` + `verify_draft_tokens`) on the prompts at T = 0; so do our
`Engine(scheduler="fixed", budget_rule="deepspec")` and `speculative_generate` (what
`dspark_jax.evaluate` runs). Required: identical tokens, identical per-round proposal lengths /
accepted drafts / acceptance lengths, and identical τ, verify rate and per-position counts and
rates — ours from `eval.acceptance.acceptance_stats` (what results.json reports), the check's
`deepspec_tau`, and DeepSpec's from its evaluator's `allreduce_response_metrics` +
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

import numpy as np
import pytest

DEEPSPEC_ROOT = (pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "reference"
                 / "deepspec")
if not (DEEPSPEC_ROOT / "deepspec" / "eval" / "base_evaluator.py").is_file():
    pytest.skip(f"DeepSpec's source is not at {DEEPSPEC_ROOT} (../shared is absent in a user's "
                "clone)", allow_module_level=True)
torch = pytest.importorskip("torch", reason="DeepSpec's loop runs in PyTorch")

from dspark_jax.eval.acceptance import acceptance_stats  # noqa: E402
from dspark_jax.interop import deepspec_loop as dl  # noqa: E402
from dspark_jax.models import init_draft, load_target  # noqa: E402
from dspark_jax.serving import Engine, speculative_generate  # noqa: E402
from hf_tiny import save_tiny_hf  # noqa: E402

GAMMA = 4
DRAFT_CFG = dict(block_size=GAMMA, num_draft_layers=1, target_layer_ids=(0, 1),
                 mask_token_id=96, markov_rank=8)
_RNG = np.random.default_rng(0)
PROMPTS = [list(map(int, _RNG.integers(3, 96, size=n))) for n in (5, 9, 3, 12, 7, 4)]
STOP = [35]
MAX_NEW = 23
MAX_LEN = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("deepspec_loop")
    tdir = save_tiny_hf(base / "target", "qwen3", layers=3, seed=0)
    target = load_target(tdir)
    draft = init_draft(target, DRAFT_CFG, seed=1, from_target=True)
    ddir = base / "draft"
    draft.save(ddir)
    return target, draft, tdir, ddir


@pytest.fixture(scope="module")
def deepspec_where():
    ok, where = dl.locate_deepspec(DEEPSPEC_ROOT)
    assert ok, where
    return where


def test_absolute_cache_crop_keeps_the_first_n_positions():
    """DeepSpec passes the length to keep (`crop(start)`; its Eagle3 evaluator crops back to the
    length before a proposal, 0 on the first); transformers 5 reads a negative count."""
    from transformers import DynamicCache

    orig = DynamicCache.crop

    def cache(n: int) -> DynamicCache:
        c = DynamicCache()
        for layer in range(2):
            kv = torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1).expand(1, 2, n, 4)
            c.update(kv.clone(), kv.clone(), layer)
        return c

    with pytest.raises(ValueError):
        cache(5).crop(3)                            # transformers 5 alone: positive n refused
    with dl.absolute_cache_crop():
        for n, keep in ((3, 3), (5, 5), (9, 5), (0, 0), (-2, 3)):
            c = cache(5)
            c.crop(n)
            assert c.get_seq_length() == keep, n
            for layer in c.layers:
                assert layer.keys.shape[-2] == keep
                assert layer.keys[0, 0, :, 0].tolist() == list(range(keep))
        c = DynamicCache()
        c.crop(0)                                   # an empty cache stays empty
        assert c.get_seq_length() == 0
    assert DynamicCache.crop is orig                # restored on exit


def _deepspec_run(tdir, ddir, tmp_path):
    import torch.distributed as dist

    ev = dl.deepspec_evaluator(dl.torch_target(tdir), ddir, max_new_tokens=MAX_NEW)
    assert type(ev).__name__ == "Qwen3DSparkEvaluator" and ev.max_proposal_tokens == GAMMA
    loop = dl.run_deepspec_loop(ev, PROMPTS, STOP)
    outs = [r.sample for r in loop]
    # its dataset metrics, computed by its own code (a one-process group for the all-reduce)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        summary = ev.allreduce_response_metrics(outs)
    finally:
        dist.destroy_process_group()
    row = ev.build_metrics_row(dataset_name="tiny", metric_summary=summary)
    return loop, outs, summary, row


def test_engine_and_deepspec_loop_give_identical_tokens_and_tau(models, deepspec_where, tmp_path):
    target, draft, tdir, ddir = models
    loop, outs, summary, row = _deepspec_run(tdir, ddir, tmp_path)
    ds_tokens = [o.output_ids[0, o.num_input_tokens:].tolist() for o in outs]
    assert [r.tokens for r in loop] == ds_tokens
    for r, o in zip(loop, outs):
        assert r.acceptance_lengths == list(o.acceptance_lengths)
        assert r.proposal_lengths == list(o.proposal_lengths)
        assert r.accepted_draft_lengths == list(o.accepted_draft_lengths)
    assert dl.deepspec_tau(loop) == row["acceptance_length"]

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
    assert st.tau == row["acceptance_length"] == dl.deepspec_tau(loop) == res.tau == spec.tau
    assert st.verify_rate == row["verify_rate"]
    assert st.to_dict()["accept_rate_at"] == row["accept_rates_by_position"]

    # counting accepted + 1 on every round (no `acceptance`) is not DeepSpec's τ on these prompts
    assert acceptance_stats(prop, acc, gamma=GAMMA).tau > st.tau
