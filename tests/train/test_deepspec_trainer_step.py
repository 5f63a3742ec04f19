"""One DSpark / DFlash training step of ours equals one of DeepSpec's own trainer.

DeepSpec's `Qwen3DSparkTrainer` (`../shared/reference/deepspec`, imported, never copied; its
DFlash recipe is the same trainer without Markov and confidence heads) is built through its own
`__init__` and driven through its own `train()` loop on CPU: its draft config builder, FSDP
`no_shard` wrapper, `BF16Optimizer` (fp32 master weights, `torch.optim.AdamW`,
`CosineAnnealingWarmupLR`), `CacheCollator`, forward (masks, labels, teacher forcing),
`compute_dspark_loss`, `FSDP.clip_grad_norm_` and gradient accumulation. Only the environment
around it is replaced, in the fixtures:

  * gloo at world size 1 on a local FileStore instead of NCCL (`init_dist`), and "local main
    process" answered from the rank (DeepSpec asks `torch.cuda.current_device()`);
  * `device_id=cpu` added to its FSDP arguments;
  * an in-memory dataset with a cache manifest instead of its on-disk target cache
    (`validate_train_cache` still checks the manifest), and a plain iterator of batches collated
    by its `CacheCollator` instead of its DataLoader and CUDA prefetcher, so both trainers see
    the same micro-batches in the same order;
  * a dense attention for `flex_attention` (flex has no backward on CPU): DeepSpec's own
    BlockMask materialised with `create_mask`, masked scores and `torch._safe_softmax`, which is
    bit-identical to flex's eager forward (checked here);
  * no checkpoint writes (`save_and_eval_checkpoint` returns), so no CUDA RNG state is needed;
  * its anchor sampler returns the anchors our step drew: our sampler runs unchanged inside our
    jitted step and a debug callback records each row's draw, keyed by the row's loss mask
    (the replay checks the draw against DeepSpec's own candidate rule);
  * import-time: see the `ds` fixture (tensorboard, the Triton-only Eagle3 trainer).

Both start from the same drafter (ours, random, exported to DeepSpec's format and loaded
strictly into its model before its optimizer copies the master weights), take the same
micro-batches (input ids, loss masks, target taps and final hidden states of a tiny random Qwen3
target, fp32, one sample right-padded by the collator) with the same anchors, and use
DeepSpec's recipe: full vocabulary, random init, fp32, AdamW(β .9/.999, ε 1e-8, wd 0), clip 1.0
(active: the first gradient norm is above it), warmup int(ratio·total) steps then cosine.
Compared: the loss terms and metrics DeepSpec logs, the pre-clip gradient norm, the lr each
step ran with (DeepSpec logs the next step's: its scheduler steps before it logs), the clipped
gradients (our first Adam moment after a first step is exactly (1 − β1)·g), the Adam moments,
and the fp32 parameter updates after one step, after a second step (the schedule's next lr),
and after a first step accumulated over two micro-batches (DeepSpec normalises each micro-step
by its own Σw and divides by the accumulation count; ours with `micro_batches` = 2 and the
"deepspec" loss normalisation); and that accumulated step on micro-batches of different longest
samples, which DeepSpec's collator pads each to its own longest (24 and 18 tokens) and our data
pipeline with `pad_to="longest"` pads together to the global batch's longest rounded up to
`pad_multiple` (32).

Tolerances, fp32 on both sides with different reduction orders:
  * scalars rtol 2e-5;
  * gradients and Adam moments per tensor |Δ| ≤ 1e-4·max|ref| (+ 1e-7, 1e-14 for v): relative
    to the tensor's scale, because an entry far below it (1e-8 where the largest is 1e-2) keeps
    the absolute rounding of the sums that formed it;
  * parameter updates |Δ(θ₁ − θ₀)| ≤ 1e-3·lr where Adam's update is resolved
    (`_compare_updates`).
The scalar and tensor ones sit about two orders of magnitude above what the two trainers
differ by, the update one five fp32 ulps of a weight near 1 above it (the updates differ by one
such ulp); a 1% change of the lr, the clip norm or β2, the "global" loss normalisation, or
DeepSpec drawing its own anchors fails them. The intended numerical differences are below them: DeepSpec divides by
Σw + 1e-6 (ours max(Σw, 1e-6)) and clips by max/(‖g‖ + 1e-6) (optax max/‖g‖).

The same two DSpark steps also run in bf16 (`train.precision` "bf16" against DeepSpec's
`precision: bf16`: its model, frozen embedding / LM head and forward inputs in bf16 through FSDP's
MixedPrecision, its BF16Optimizer's fp32 master and fp32 AdamW), both starting from the same
bf16-representable fp32 master. The sides then differ by bf16 rounding in different places
(DeepSpec also takes its per-token CE and the gradient norm and clipping of its bf16 gradients in
bf16, ours in fp32), so the tolerances are bf16's, about 2^-8 relative per rounding:
  * loss terms and metrics rtol 1e-3 (seen ≤ 5.5e-4: DeepSpec's CE per token is a bf16 number);
    the gradient norm rtol 1e-2 (DeepSpec's is a bf16 number, 2^-8 apart from its neighbours);
  * the first step's L1 term rtol 5e-5 (seen 3e-6): both forwards see bit-identical bf16
    weights and inputs and both take the softmaxes of bf16 logits in fp32; ours in fp32 from the
    same weights is 2e-4 apart;
  * clipped gradients per tensor ‖Δ‖₂ ≤ 8% of ‖ref‖₂, Adam moments 10% (seen ≤ 3.4% and ≤ 5%:
    two bf16 backward passes, with the Markov head's sparse gradients the farthest apart);
  * the fp32 masters' first update, |Δ| ≤ 1e-3·lr on the entries whose gradient is ≥ 10% of
    its tensor's largest (there Adam's first step is exactly ∓lr on both sides).
`test_bf16_tolerances_reject_other_recipes` shows they fail for an fp32 forward, for a master
kept in bf16 and for unclipped gradients. The second step's updates are not compared entry by
entry: Adam's m/√v at step 2 magnifies the 1–3% gradient differences of bf16 into visible
fractions of lr; its moments and loss terms are.

DeepSpec's Eagle3 trainer is not driven here: its loss is a Triton kernel, with no CPU backend.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import types
from typing import Any, Callable

import numpy as np
import pytest

DEEPSPEC = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepspec"
if not (DEEPSPEC / "deepspec").is_dir():
    pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent; a "
                "user's clone has none)", allow_module_level=True)
torch = pytest.importorskip("torch", reason="DeepSpec's trainer is PyTorch")

import jax  # noqa: E402
import optax  # noqa: E402
import torch.distributed as dist  # noqa: E402
from flax import nnx  # noqa: E402
from torch.nn.attention.flex_attention import create_mask, flex_attention  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from dspark_jax.data.pipeline import PipelineConfig, make_dataset  # noqa: E402
from dspark_jax.models import init_draft, load_target  # noqa: E402
from dspark_jax.models.io.deepspec import deepspec_tensors_from_pure  # noqa: E402
from dspark_jax.sharding import make_mesh  # noqa: E402
from dspark_jax.train import losses as our_losses  # noqa: E402
from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,  # noqa: E402
                                   make_optimizer, make_schedule, split_draft)
from tiny_job import make_tiny_target  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile:UserWarning",   # the equality check
    "ignore:To get the last learning rate computed by the scheduler:UserWarning")  # DeepSpec's

LAYER_IDS = (-1, 1, 2)       # the embeddings and two decoder layers of the 4-layer target
MASK_TOKEN = 99              # an id the tiny target's tokenizer never produces (tiny_job.VOCAB)
BLOCK, ANCHORS, RANK = 4, 6, 8
S = 24                       # the longest sample; every micro-batch holds one of this length
LR, TOTAL, WARMUP_RATIO = 6e-4, 20, 0.1       # W = 2 warmup steps: lr/2 at step 0, lr at step 1
MAX_GRAD_NORM = 1.0
B1, B2, EPS = 0.9, 0.999, 1e-8
LOCAL_BATCH = 2

SCALAR_RTOL = 2e-5
TENSOR_RTOL, TENSOR_ATOL = 1e-4, 1e-7
UPDATE_ATOL = 1e-3 * LR
BF16_SCALAR_RTOL, BF16_NORM_RTOL, BF16_FIRST_L1_RTOL = 1e-3, 1e-2, 5e-5
BF16_GRAD_RTOL, BF16_MOMENT_RTOL, BF16_RESOLVED = 0.08, 0.1, 0.1

# our drafter and DeepSpec's model arguments for it (its dspark / dflash Qwen3 recipes)
BASE = dict(block_size=BLOCK, num_draft_layers=2, target_layer_ids=LAYER_IDS,
            mask_token_id=MASK_TOKEN, num_anchors=ANCHORS, draft_vocab_size=0,
            loss_normalization="deepspec")
DRAFTS = {
    "dspark": dict(BASE, markov_rank=RANK, markov_head_type="vanilla"),
    "dflash": dict(BASE, model_type="dflash", markov_rank=0, enable_confidence_head=False),
}
DEEPSPEC_MODEL_ARGS = {
    "dspark": dict(markov_rank=RANK, markov_head_type="vanilla", confidence_head_alpha=1.0,
                   confidence_head_with_markov=True, loss_decay_gamma=4.0, ce_loss_alpha=0.1,
                   l1_loss_alpha=0.9),
    "dflash": dict(markov_rank=0, confidence_head_alpha=0.0, loss_decay_gamma=4.0,
                   ce_loss_alpha=1.0, l1_loss_alpha=0.0),
}


# ---------------------------------------------------------------------------- the data
def _samples(target: Any, seed: int, n: int,
             lengths: tuple[int, ...] | None = None) -> list[dict[str, np.ndarray]]:
    """n samples (DeepSpec cache items, numpy): random ids, a prompt then an assistant reply
    (loss mask 1), some with a second turn (a hole in the mask) or few candidates, lengths ≤ S
    with the even-numbered ones exactly S (or `lengths`); target taps and final hidden states
    from our target. Every loss mask is distinct (the anchor replay is keyed by it)."""
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        length = S if i % 2 == 0 else int(rng.randint(S - 7, S))
        if lengths is not None:
            length = lengths[i]
        ids = rng.randint(3, 98, length).astype(np.int64)
        lm = np.zeros(length, np.int64)
        prompt = 2 + (3 * i + seed) % 7
        lm[prompt:] = 1
        if i % 3 == 1:                                   # a user turn inside the reply
            lm[prompt + 6: prompt + 9] = 0
        if i % 4 == 3:                                   # fewer candidates than anchors
            lm[:] = 0
            lm[length - 6:] = 1
        feats = target.hidden_states(ids[None], LAYER_IDS)[0]
        hidden = np.asarray(target.model(jax.numpy.asarray(ids[None])).hidden)[0]
        out.append(dict(input_ids=ids, loss_mask=lm, target_hidden_states=feats.astype(np.float32),
                        target_last_hidden_states=hidden.astype(np.float32)))
    assert len({_mask_key(s["loss_mask"]) for s in out}) == n, "loss masks must be distinct"
    return out


def _our_batch(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Our offline batch of the samples, right-padded to S like the data pipeline (segment 1 on
    tokens, 0 on padding) — the same zeros DeepSpec's collator pads with."""
    n = len(samples)
    out = {k: np.zeros((n, S), np.int32) for k in ("input_ids", "loss_mask", "positions",
                                                   "segment_ids")}
    nf = samples[0]["target_hidden_states"].shape[1]
    d = samples[0]["target_last_hidden_states"].shape[1]
    out["features"] = np.zeros((n, S, nf), np.float32)
    out["target_hidden"] = np.zeros((n, S, d), np.float32)
    for r, s in enumerate(samples):
        L = len(s["input_ids"])
        out["input_ids"][r, :L] = s["input_ids"]
        out["loss_mask"][r, :L] = s["loss_mask"]
        out["positions"][r, :L] = np.arange(L)
        out["segment_ids"][r, :L] = 1
        out["features"][r, :L] = s["target_hidden_states"]
        out["target_hidden"][r, :L] = s["target_last_hidden_states"]
    return out


def _mask_key(row: np.ndarray) -> bytes:
    """A padded loss-mask row of any width as a lookup key (padding is zeros on both sides;
    samples are at most S long)."""
    row = np.asarray(row) > 0.5
    assert not row[S:].any()
    full = np.zeros(S, bool)
    full[: min(S, row.shape[0])] = row[:S]
    return full.tobytes()


# ---------------------------------------------------------------------------- our trainer
@dataclasses.dataclass
class Ours:
    """Our jitted train step and its state; `drawn` holds the anchors of the last step."""

    cfg: Any
    state: Any
    frozen: Any
    train: Callable
    drawn: dict[bytes, tuple[np.ndarray, np.ndarray]]

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        self.drawn.clear()
        self.state, metrics = self.train(self.state, self.frozen, None, batch)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def tensors(self, tree: Any) -> dict[str, np.ndarray]:
        """A params-shaped tree (params, Adam moments) under DeepSpec's tensor names, through
        our export's naming (frozen embedding / LM head dropped)."""
        pure = nnx.to_pure_dict(tree)
        pure.update(nnx.to_pure_dict(self.frozen))
        named = deepspec_tensors_from_pure(self.cfg, pure)
        return {k: np.asarray(v, np.float64) for k, v in named.items()
                if k not in ("embed_tokens.weight", "lm_head.weight")}

    def adam(self, moment: str) -> dict[str, np.ndarray]:
        return self.tensors(optax.tree_utils.tree_get(self.state.opt_state, moment))


def _recording_sampler(drawn: dict) -> Callable:
    """Our `sample_anchors`, unchanged, plus a debug callback that records each row's draw
    (anchors, kept) under the row's loss mask."""
    real = our_losses.sample_anchors

    def sample(key, loss_mask, num_anchors, segment_ids=None, max_segments=1):
        anchors, valid = real(key, loss_mask, num_anchors, segment_ids, max_segments)

        def record(lm, a, v):
            for row, ar, vr in zip(np.asarray(lm), np.asarray(a), np.asarray(v)):
                drawn[_mask_key(row)] = (ar.copy(), vr.copy())

        jax.debug.callback(record, loss_mask, anchors, valid)
        return anchors, valid

    return sample


def _build_ours(draft: Any, micro_batches: int, monkeypatch, precision: str = "fp32") -> Ours:
    """Our offline-features train step (as the training loop builds it, on a one-device mesh)
    with DeepSpec's optimizer settings and `train.precision`, its sampler observed by
    `_recording_sampler`."""
    drawn: dict = {}
    monkeypatch.setattr(our_losses, "sample_anchors", _recording_sampler(drawn))
    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    graphdef, params, frozen = split_draft(draft.model)
    oc = OptimConfig(lr=LR, b1=B1, b2=B2, eps=EPS, weight_decay=0.0, clip_norm=MAX_GRAD_NORM,
                     warmup_ratio=WARMUP_RATIO, total_steps=TOTAL)
    tx, schedule = make_optimizer(oc), make_schedule(oc)
    state, sh = init_train_state(params, tx, 0, mesh)
    fns = build_train_step(graphdef, draft.config, tx, schedule, target_graphdef=None, mesh=mesh,
                           state_sh=sh, frozen=frozen, target_state=None,
                           micro_batches=micro_batches, precision=precision)
    return Ours(cfg=draft.config, state=state, frozen=frozen, train=fns.train, drawn=drawn)


# ---------------------------------------------------------------------------- DeepSpec's trainer
class _MemoryCache:
    """Stands in for DeepSpec's on-disk `CacheDataset` where the trainer's `__init__` reads it:
    its length (the epoch arithmetic) and its manifest (`validate_train_cache`). The batches
    themselves come from the test (`_build_train_dataloader`)."""

    def __init__(self, size: int, manifest: dict[str, Any]):
        self.size, self.manifest = size, manifest

    def __len__(self) -> int:
        return self.size


def _dense_flex(seen: list) -> Callable:
    """`flex_attention` for DeepSpec's drafter, differentiable on CPU: the BlockMask's own
    `mask_mod` materialised by `create_mask`, scaled scores set to −inf where masked and
    `torch._safe_softmax` (a fully masked row, a padding block, gives zeros), the operations of
    flex's eager forward in its order and its precision (scores and softmax in fp32, the
    probabilities cast back to the input dtype before the product with the values). The first
    call's inputs go to `seen`."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        del module, kwargs
        B, H, Q, _ = query.shape
        mask = create_mask(attention_mask.mask_mod, B, 1, Q, key.shape[-2], device=query.device)
        scores = (query.float() @ key.float().transpose(-2, -1)) * scaling
        scores = torch.where(mask, scores, torch.tensor(-float("inf"), dtype=scores.dtype))
        out = torch._safe_softmax(scores, dim=-1).to(query.dtype) @ value
        if not seen:
            seen.append((query.detach(), key.detach(), value.detach(), attention_mask, scaling,
                         out.detach()))
        return out.transpose(1, 2).contiguous(), None

    return attend


def _replay_sampler(ds: Any, drawn: dict, checked: list) -> Callable:
    """DeepSpec's `sample_anchor_positions` answering with the anchors our step drew for each
    row (looked up by its loss mask). It checks them against DeepSpec's own candidate rule:
    every kept anchor a candidate, min(num_anchors, #candidates) of them, sorted, pads at 0."""

    def sample(*, seq_len, loss_mask, num_anchors, device):
        rows = [drawn[_mask_key(row)] for row in loss_mask.cpu().numpy()]
        anchors = torch.as_tensor(np.stack([a for a, _ in rows]), dtype=torch.long, device=device)
        keep = torch.as_tensor(np.stack([v for _, v in rows]), dtype=torch.bool, device=device)
        assert anchors.shape == (loss_mask.shape[0], num_anchors)
        cand = ds.common.build_anchor_candidate_mask(seq_len=seq_len, loss_mask=loss_mask)
        for a, k, c in zip(anchors, keep, cand):
            assert int(k.sum()) == min(num_anchors, int(c.sum()))
            assert bool(c[a[k]].all()) and bool((a[~k] == 0).all())
            assert bool(k[: int(k.sum())].all()) and bool((a[k].diff() > 0).all())
        checked.append(anchors.clone())
        return anchors, keep

    return sample


@dataclasses.dataclass
class Theirs:
    """DeepSpec's trainer and what the test observes of it: the batches its loader yields
    (`feed`), each optimizer step's logged summary, clipped gradients and lr."""

    trainer: Any
    feed: list
    summaries: list
    clipped: list
    lrs: list
    names: list[str]

    def step(self, items: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One optimizer step of DeepSpec's `train()` over `items` (gradient accumulation
        steps × local batch, in order)."""
        self.feed[:] = items
        n = len(self.summaries)
        self.trainer.train()
        assert len(self.summaries) == n + 1, "one optimizer step per call"
        out = {k.removeprefix("train/"): v for k, v in self.summaries[-1].items()}
        # DeepSpec logs the lr after its scheduler has stepped (the next step's); the lr this
        # step ran with is the optimizer's just before `step()`
        out["lr_logged"], out["lr"] = out["lr"], self.lrs[-1]
        return out

    def params(self) -> dict[str, np.ndarray]:
        return {n: p.detach().double().numpy()
                for n, p in zip(self.names, self.trainer.optimizer.fp32_params)}

    def adam(self, moment: str) -> dict[str, np.ndarray]:
        key = {"mu": "exp_avg", "nu": "exp_avg_sq"}[moment]
        opt = self.trainer.optimizer.optimizer
        return {n: opt.state[p][key].detach().double().numpy()
                for n, p in zip(self.names, self.trainer.optimizer.fp32_params)}


@pytest.fixture(scope="module")
def ds():
    """DeepSpec's trainer modules, imported with two import-time shims:
      * its training logger imports `torch.utils.tensorboard`, which needs the `tensorboard`
        package; where that is missing, tensorboardX's SummaryWriter (the same API, one of our
        dependencies) stands in (no writer is opened: the test gives no tensorboard directory);
      * `deepspec/trainer/__init__.py` also imports the Eagle3 trainer, whose loss is a Triton
        kernel (no Triton on CPU): the package is registered bare so that only the base and
        DSpark trainer modules load."""
    with pytest.MonkeyPatch.context() as mp:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            import tensorboardX

            mp.setitem(sys.modules, "torch.utils.tensorboard",
                       types.SimpleNamespace(SummaryWriter=tensorboardX.SummaryWriter))
        mp.syspath_prepend(str(DEEPSPEC.resolve()))
        import deepspec

        trainer_pkg = types.ModuleType("deepspec.trainer")
        trainer_pkg.__path__ = [str(DEEPSPEC.resolve() / "deepspec" / "trainer")]
        mp.setitem(sys.modules, "deepspec.trainer", trainer_pkg)
        mp.setattr(deepspec, "trainer", trainer_pkg, raising=False)
        import deepspec.utils.distributed as distributed
        import deepspec.utils.training_logger as logger
        from deepspec.data.cuda_prefetcher import move_batch_to_device
        from deepspec.modeling.dspark import common
        from deepspec.modeling.dspark.qwen3 import modeling as qwen3
        import deepspec.trainer.base_trainer as base
        from deepspec.trainer.dspark_trainer import Qwen3DSparkTrainer
        from deepspec.utils.config import to_config_node

        yield types.SimpleNamespace(
            distributed=distributed, logger=logger, move_batch_to_device=move_batch_to_device,
            common=common, qwen3=qwen3, base=base, Qwen3DSparkTrainer=Qwen3DSparkTrainer,
            to_config_node=to_config_node)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """gloo, world size 1, on a FileStore (what DeepSpec's `init_dist` sets up with NCCL)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> pathlib.Path:
    return make_tiny_target(tmp_path_factory.mktemp("target"), seed=4)


@pytest.fixture(scope="module")
def drafters(target_dir):
    """(kind, precision) → (our target, a random drafter of that kind), built on first use.
    Norms, the Markov output and the confidence bias are moved off their initial values so that
    each carries a visible gradient. precision "bf16": the same drafter computing in bfloat16,
    its weights rounded to bfloat16 (the fp32 master DeepSpec's BF16Optimizer copies from its
    bf16 model)."""
    target = load_target(target_dir)
    built: dict[tuple[str, str], tuple] = {}

    def get(kind: str, precision: str = "fp32"):
        if (kind, precision) in built:
            return built[kind, precision]
        if precision == "bf16":
            _, fp32 = get(kind)
            draft = init_draft(target, DRAFTS[kind], seed=1, dtype="bfloat16")
            graphdef, state = nnx.split(draft.model)
            rounded = jax.tree.map(
                lambda x: (np.asarray(x).astype(jax.numpy.bfloat16).astype(np.float32)
                           if np.issubdtype(np.asarray(x).dtype, np.floating) else x),
                nnx.to_pure_dict(fp32.state))
            nnx.replace_by_pure_dict(state, rounded)
            built[kind, precision] = target, type(draft).from_model(nnx.merge(graphdef, state))
            return built[kind, precision]
        draft = init_draft(target, DRAFTS[kind], seed=1)
        graphdef, state = nnx.split(draft.model)
        rng = np.random.RandomState(2)

        def perturb(keypath, x):
            name = "/".join(str(getattr(p, "key", p)) for p in keypath)
            x = np.asarray(x)
            if "norm" in name:
                return x * (1.0 + 0.2 * rng.randn(*x.shape)).astype(x.dtype)
            if name.endswith("markov/w2"):
                return (0.05 * rng.randn(*x.shape)).astype(x.dtype)
            if name.endswith("confidence/b"):
                return x + 0.5
            return x

        pure = jax.tree_util.tree_map_with_path(perturb, nnx.to_pure_dict(state))
        nnx.replace_by_pure_dict(state, pure)
        built[kind, precision] = target, type(draft).from_model(nnx.merge(graphdef, state))
        return built[kind, precision]

    return get


def _build_theirs(ds: Any, kind: str, tmp: pathlib.Path, target_dir: pathlib.Path, draft: Any,
                  accumulation: int, drawn: dict, monkeypatch, seen_attention: list,
                  checked: list, precision: str = "fp32") -> Theirs:
    export = tmp / "draft"
    draft.save(export)
    from safetensors.torch import load_file

    weights = load_file(export / "model.safetensors")
    feed: list = []
    summaries: list = []
    clipped: list = []
    lrs: list = []

    class Trainer(ds.Qwen3DSparkTrainer):
        def _build_draft_model(self, *, target_config, model_args):
            model = super()._build_draft_model(target_config=target_config,
                                               model_args=model_args)
            keys = model.load_state_dict(weights, strict=True)
            assert not keys.missing_keys and not keys.unexpected_keys
            return model

        def _build_train_dataloader(self, start_offset_samples=0, num_samples=None):
            collate = self.data_collator_cls()
            b = int(self.args.train.local_batch_size)
            return [collate(feed[i: i + b]) for i in range(0, len(feed), b)]

        def save_and_eval_checkpoint(self):
            return None

    def init_dist(local_rank):
        assert dist.is_initialized() and dist.get_world_size() == 1
        return torch.device("cpu"), 0, 1

    build_fsdp_kwargs = ds.base._build_fsdp_kwargs

    def on_optimizer_step(**kw):
        summaries.append(real_on_step(**kw))
        return summaries[-1]

    real_on_step = ds.logger.on_optimizer_step
    monkeypatch.setattr(ds.base, "init_dist", init_dist)
    monkeypatch.setattr(ds.distributed, "is_local_main_process", lambda: dist.get_rank() == 0)
    monkeypatch.setattr(ds.base, "_build_fsdp_kwargs",
                        lambda **kw: dict(build_fsdp_kwargs(**kw), device_id=torch.device("cpu")))
    monkeypatch.setattr(ds.base, "CUDAPrefetcher",
                        lambda loader, device: (ds.move_batch_to_device(b, device) for b in loader))
    monkeypatch.setattr(ds.logger, "on_optimizer_step", on_optimizer_step)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flex_attention", _dense_flex(seen_attention))
    monkeypatch.setattr(ds.qwen3, "sample_anchor_positions", _replay_sampler(ds, drawn, checked))
    manifest = dict(target_layer_ids=list(LAYER_IDS), hidden_size=draft.config.target.hidden_size,
                    target_model_name_or_path=str(target_dir))
    monkeypatch.setattr(ds.base, "CacheDataset",
                        lambda cache_dir: _MemoryCache(8, manifest))

    args = ds.to_config_node(dict(
        exp_name=f"step_equality_{kind}",
        model=dict(target_model_name_or_path=str(target_dir), block_size=BLOCK,
                   num_draft_layers=BASE["num_draft_layers"], target_layer_ids=list(LAYER_IDS),
                   mask_token_id=MASK_TOKEN, num_anchors=ANCHORS, **DEEPSPEC_MODEL_ARGS[kind]),
        train=dict(lr=LR, warmup_ratio=WARMUP_RATIO, weight_decay=0.0, precision=precision,
                   local_batch_size=LOCAL_BATCH, global_batch_size=LOCAL_BATCH * accumulation,
                   num_train_epochs=1, max_train_steps=TOTAL, max_grad_norm=MAX_GRAD_NORM,
                   sharding_strategy="no_shard", torch_compile=False),
        logging=dict(logging_steps=1, checkpointing_steps=10 ** 9,
                     checkpoint_dir=str(tmp / "ckpt"), tensorboard_dir=None),
        data=dict(target_cache_path=str(tmp / "cache"), num_workers=0)))
    trainer = Trainer(0, args)
    opt = trainer.optimizer
    names = [n for n, p in trainer.draft_model.named_parameters() if p.requires_grad]
    assert len(names) == len(opt.model_params)
    assert all(p is q for p, q in zip(opt.model_params,
                                      (p for _, p in trainer.draft_model.named_parameters()
                                       if p.requires_grad)))
    assert opt.optimizer.defaults["betas"] == (B1, B2) and opt.optimizer.defaults["eps"] == EPS
    real_step = opt.step

    def step():       # the clipped gradients and the lr the optimizer is about to apply
        clipped.append({n: p.grad.detach().double().numpy().copy()
                        for n, p in zip(names, opt.model_params)})
        lrs.append(opt.get_learning_rate())
        real_step()

    opt.step = step
    return Theirs(trainer=trainer, feed=feed, summaries=summaries, clipped=clipped, lrs=lrs,
                  names=names)


# ---------------------------------------------------------------------------- comparisons
Tensors = dict[str, np.ndarray]

LOSS_KEYS = ("loss", "ce_loss", "tau_probabilistic", "valid_anchors_abs", "sampled_anchors_abs",
             "block_supervised_tokens_abs", "grad_norm", "lr") + tuple(
                 f"accept_rate@{k}" for k in range(BLOCK))
DSPARK_KEYS = ("l1_loss", "confidence_loss", "confidence_abs_error", "confidence_bias",
               "confidence_cumprod_bias")


def _compare_scalars(kind: str, ours: dict[str, float], theirs: dict[str, float]
                     ) -> dict[str, float]:
    """The loss terms and metrics DeepSpec logs, the pre-clip gradient norm and the lr the step
    ran with; returns each relative difference."""
    keys = LOSS_KEYS + (DSPARK_KEYS if kind == "dspark" else ())
    rel = {}
    for k in keys:
        assert k in ours and k in theirs, k
        rel[k] = abs(ours[k] - theirs[k]) / max(abs(theirs[k]), 1e-12)
        np.testing.assert_allclose(ours[k], theirs[k], rtol=SCALAR_RTOL, atol=1e-9, err_msg=k)
    return rel


def _compare_tensors(ours: Tensors, theirs: Tensors, what: str,
                     rtol: float = TENSOR_RTOL, atol: float = TENSOR_ATOL) -> float:
    """Per tensor |ours − theirs| ≤ rtol·max|theirs| + atol; returns the worst ratio of the
    error to max|theirs|."""
    assert sorted(ours) == sorted(theirs), (what, sorted(set(ours) ^ set(theirs)))
    worst = 0.0
    for name, ref in theirs.items():
        got = ours[name]
        assert got.shape == ref.shape, (what, name, got.shape, ref.shape)
        scale = float(np.abs(ref).max())
        err = float(np.abs(got - ref).max())
        assert err <= rtol * scale + atol, f"{what} {name}: max|Δ| {err:.3g}, max|ref| {scale:.3g}"
        worst = max(worst, err / max(scale, 1e-30))
    return worst


def _compare_updates(ours_before: Tensors, ours_after: Tensors, theirs_before: Tensors,
                     theirs_after: Tensors, nu_theirs: Tensors, t: int, what: str
                     ) -> tuple[float, float]:
    """θ_after − θ_before of both sides, |Δ| ≤ UPDATE_ATOL (1e-3 of lr) on every entry whose
    bias-corrected RMS gradient √v̂ (step t) is ≥ 100·ε. Adam moves an entry by
    lr·m̂/(√v̂ + ε), whose sensitivity to the gradient, lr·ε/(|g| + ε)², approaches lr/ε where
    |g| ≲ ε = 1e-8: there a 1e-10 rounding difference of the gradient (fp32 sums whose largest
    terms are ~1e-2) moves the update by a visible fraction of lr. Those entries are checked
    through the gradients and moments instead. Returns (worst |Δ| / lr, fraction of entries
    left to the moments)."""
    worst, skipped, total = 0.0, 0, 0
    for name in theirs_after:
        du_ours = ours_after[name] - ours_before[name]
        du_theirs = theirs_after[name] - theirs_before[name]
        resolved = np.sqrt(nu_theirs[name] / (1 - B2 ** t)) >= 1e2 * EPS
        err = float(np.abs(du_ours - du_theirs)[resolved].max(initial=0.0))
        assert err <= UPDATE_ATOL, f"{what} {name}: max|Δ update| {err:.3g}"
        worst = max(worst, err / LR)
        skipped += int((~resolved).sum())
        total += resolved.size
    return worst, skipped / total


@pytest.fixture(scope="module", params=sorted(DRAFTS))
def single(request, ds, drafters, target_dir, process_group, tmp_path_factory):
    """Two optimizer steps, one micro-batch each, on both trainers, for a drafter kind."""
    kind = request.param
    target, draft = drafters(kind)
    with pytest.MonkeyPatch.context() as mp:
        ours = _build_ours(draft, 1, mp)
        seen, checked = [], []
        theirs = _build_theirs(ds, kind, tmp_path_factory.mktemp(kind), target_dir, draft, 1,
                               ours.drawn, mp, seen, checked)
        out = dict(kind=kind, seen=seen, p0_ours=ours.tensors(ours.state.params),
                   p0_theirs=theirs.params(), steps=[])
        samples = _samples(target, seed=10, n=2 * LOCAL_BATCH)
        for i in range(2):
            items = samples[i * LOCAL_BATCH: (i + 1) * LOCAL_BATCH]
            m_ours = ours.step(_our_batch(items))
            m_theirs = theirs.step([{k: torch.from_numpy(v) for k, v in it.items()}
                                    for it in items])
            out["steps"].append(dict(
                replayed=len(checked), m_ours=m_ours, m_theirs=m_theirs,
                clipped=theirs.clipped[-1],
                p_ours=ours.tensors(ours.state.params), p_theirs=theirs.params(),
                mu_ours=ours.adam("mu"), mu_theirs=theirs.adam("mu"),
                nu_ours=ours.adam("nu"), nu_theirs=theirs.adam("nu")))
    return out


@pytest.fixture(scope="module")
def accumulated(ds, drafters, target_dir, process_group, tmp_path_factory):
    """One DSpark optimizer step over two micro-batches on both trainers."""
    target, draft = drafters("dspark")
    with pytest.MonkeyPatch.context() as mp:
        ours = _build_ours(draft, 2, mp)
        seen, checked = [], []
        theirs = _build_theirs(ds, "dspark", tmp_path_factory.mktemp("accum"), target_dir,
                               draft, 2, ours.drawn, mp, seen, checked)
        p0_ours, p0_theirs = ours.tensors(ours.state.params), theirs.params()
        samples = _samples(target, seed=20, n=2 * LOCAL_BATCH)
        # DeepSpec's micro-step i takes items [2i, 2i + 1]; our micro-batch i is rows i, i + 2
        rows = [samples[j] for j in (0, 2, 1, 3)]
        m_ours = ours.step(_our_batch(rows))
        m_theirs = theirs.step([{k: torch.from_numpy(v) for k, v in it.items()}
                                for it in samples])
        return dict(checked=checked, p0_ours=p0_ours, p0_theirs=p0_theirs, m_ours=m_ours,
                    m_theirs=m_theirs, clipped=theirs.clipped[-1],
                    p_ours=ours.tensors(ours.state.params), p_theirs=theirs.params(),
                    mu_ours=ours.adam("mu"), mu_theirs=theirs.adam("mu"),
                    nu_ours=ours.adam("nu"), nu_theirs=theirs.adam("nu"))


@pytest.fixture(scope="module")
def accumulated_longest(ds, drafters, target_dir, process_group, tmp_path_factory):
    """One DSpark optimizer step over two micro-batches of different longest samples: DeepSpec's
    collator pads each micro-batch to its own longest (24 and 18 tokens); our data pipeline with
    `pad_to="longest"`, `pad_multiple=16` pads the global batch to 32 (its longest, 24, rounded
    up; max_length 64)."""
    target, draft = drafters("dspark")
    with pytest.MonkeyPatch.context() as mp:
        ours = _build_ours(draft, 2, mp)
        seen, checked = [], []
        theirs = _build_theirs(ds, "dspark", tmp_path_factory.mktemp("longest"), target_dir,
                               draft, 2, ours.drawn, mp, seen, checked)
        p0_ours, p0_theirs = ours.tensors(ours.state.params), theirs.params()
        samples = _samples(target, seed=30, n=2 * LOCAL_BATCH, lengths=(S, S - 3, S - 6, S - 8))
        items = [{k: torch.from_numpy(v) for k, v in it.items()} for it in samples]
        collate = theirs.trainer.data_collator_cls()
        widths_theirs = [collate(items[i: i + LOCAL_BATCH])["input_ids"].shape[1]
                         for i in range(0, len(items), LOCAL_BATCH)]
        # DeepSpec's micro-step i takes items [2i, 2i + 1]; our micro-batch i is rows i, i + 2
        records = [dict(input_ids=s["input_ids"].astype(np.int32),
                        loss_mask=s["loss_mask"].astype(np.int32),
                        features=s["target_hidden_states"],
                        target_hidden=s["target_last_hidden_states"])
                   for s in (samples[j] for j in (0, 2, 1, 3))]
        pc = PipelineConfig(batch_size=2 * LOCAL_BATCH, max_length=64, shuffle=False,
                            micro_batches=2, pad_to="longest", pad_multiple=16)
        batch = next(iter(make_dataset(records, pc, shard_index=0, shard_count=1)))
        m_ours = ours.step(batch)
        m_theirs = theirs.step(items)
        return dict(checked=checked, width_ours=batch["input_ids"].shape[1],
                    widths_theirs=widths_theirs, p0_ours=p0_ours, p0_theirs=p0_theirs,
                    m_ours=m_ours, m_theirs=m_theirs, clipped=theirs.clipped[-1],
                    p_ours=ours.tensors(ours.state.params), p_theirs=theirs.params(),
                    mu_ours=ours.adam("mu"), mu_theirs=theirs.adam("mu"),
                    nu_ours=ours.adam("nu"), nu_theirs=theirs.adam("nu"))


def _recast(draft: Any, target: Any, dtype: str) -> Any:
    """`draft`'s weights in a drafter of the same kind that computes in `dtype`."""
    other = init_draft(target, draft.config, seed=1, dtype=dtype)
    graphdef, state = nnx.split(other.model)
    nnx.replace_by_pure_dict(state, nnx.to_pure_dict(draft.state))
    return type(other).from_model(nnx.merge(graphdef, state))


@pytest.fixture(scope="module")
def bf16(ds, drafters, target_dir, process_group, tmp_path_factory):
    """Two DSpark optimizer steps, one micro-batch each, with `precision` bf16 on both trainers
    from the same bf16-representable fp32 master weights; and, as a control, our first step of
    the same weights with `precision` fp32 and an fp32 drafter."""
    target, draft = drafters("dspark", "bf16")
    with pytest.MonkeyPatch.context() as mp:
        ours = _build_ours(draft, 1, mp, precision="bf16")
        seen, checked = [], []
        theirs = _build_theirs(ds, "dspark", tmp_path_factory.mktemp("bf16"), target_dir, draft,
                               1, ours.drawn, mp, seen, checked, precision="bf16")
        assert all(p.dtype == torch.bfloat16 for p in theirs.trainer.optimizer.model_params)
        assert all(p.dtype == torch.float32 for p in theirs.trainer.optimizer.fp32_params)
        out = dict(seen=seen, p0_ours=ours.tensors(ours.state.params),
                   p0_theirs=theirs.params(), steps=[])
        samples = _samples(target, seed=10, n=2 * LOCAL_BATCH)
        batches = [samples[i * LOCAL_BATCH: (i + 1) * LOCAL_BATCH] for i in range(2)]
        for items in batches:
            m_ours = ours.step(_our_batch(items))
            m_theirs = theirs.step([{k: torch.from_numpy(v) for k, v in it.items()}
                                    for it in items])
            out["steps"].append(dict(
                replayed=len(checked), m_ours=m_ours, m_theirs=m_theirs,
                clipped=theirs.clipped[-1],
                p_ours=ours.tensors(ours.state.params), p_theirs=theirs.params(),
                mu_ours=ours.adam("mu"), mu_theirs=theirs.adam("mu"),
                nu_ours=ours.adam("nu"), nu_theirs=theirs.adam("nu")))
        # the control draws the anchors of the first step (the same key, masks and sampler)
        fp32 = _build_ours(_recast(draft, target, "float32"), 1, mp, precision="fp32")
        out["fp32_first"] = fp32.step(_our_batch(batches[0]))
    return out


def _rel_l2(ours: Tensors, theirs: Tensors, what: str, rtol: float) -> float:
    """Per tensor ‖ours − theirs‖₂ ≤ rtol·‖theirs‖₂; returns the worst ratio."""
    assert sorted(ours) == sorted(theirs), (what, sorted(set(ours) ^ set(theirs)))
    worst = 0.0
    for name, ref in theirs.items():
        err = float(np.linalg.norm(ours[name] - ref) / max(np.linalg.norm(ref), 1e-30))
        assert err <= rtol, f"{what} {name}: ‖Δ‖/‖ref‖ {err:.3g} > {rtol}"
        worst = max(worst, err)
    return worst


def _compare_bf16_scalars(ours: dict[str, float], theirs: dict[str, float]) -> float:
    """DeepSpec's logged loss terms and metrics within BF16_SCALAR_RTOL, the gradient norm
    within BF16_NORM_RTOL, the lr within 1e-6; returns the worst relative difference."""
    worst = 0.0
    for k in LOSS_KEYS + DSPARK_KEYS:
        rtol = {"grad_norm": BF16_NORM_RTOL, "lr": 1e-6}.get(k, BF16_SCALAR_RTOL)
        np.testing.assert_allclose(ours[k], theirs[k], rtol=rtol, atol=1e-9, err_msg=k)
        if k not in ("grad_norm", "lr"):
            worst = max(worst, abs(ours[k] - theirs[k]) / max(abs(theirs[k]), 1e-12))
    return worst


def _compare_bf16_first_update(p0: Tensors, p1: Tensors, p0_theirs: Tensors,
                               p1_theirs: Tensors, clipped: Tensors) -> float:
    """θ₁ − θ₀ of both fp32 masters, |Δ| ≤ UPDATE_ATOL on every entry whose clipped gradient
    is ≥ BF16_RESOLVED of its tensor's largest: there the bf16 gradients of the two sides
    (a few % of that largest apart) share their sign, and Adam's first step moves the entry by
    exactly ∓lr. Returns the worst |Δ| / lr."""
    worst = 0.0
    for name, g in clipped.items():
        resolved = np.abs(g) >= BF16_RESOLVED * np.abs(g).max()
        assert resolved.any(), name
        du = (p1[name] - p0[name]) - (p1_theirs[name] - p0_theirs[name])
        err = float(np.abs(du)[resolved].max())
        assert err <= UPDATE_ATOL, f"bf16 step 1 {name}: max|Δ update| {err:.3g}"
        worst = max(worst, err / LR)
    return worst


def test_bf16_first_step_equal(bf16):
    """`precision` bf16 against DeepSpec's bf16 recipe (module docstring: tolerances), first
    step: the same start, loss terms, gradient norm, lr, clipped gradients, Adam's second
    moment and the fp32 master's update; the dense attention stand-in is flex's bf16 forward."""
    q, k, v, block_mask, scale, out = bf16["seen"][0]
    assert q.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(out, flex_attention(q, k, v, block_mask=block_mask, scale=scale))
    s = bf16["steps"][0]
    assert s["replayed"] == 1
    for name, p0 in bf16["p0_theirs"].items():
        np.testing.assert_array_equal(bf16["p0_ours"][name], p0, err_msg=name)
    assert s["m_theirs"]["grad_norm"] > MAX_GRAD_NORM, "the step must clip"
    rel = _compare_bf16_scalars(s["m_ours"], s["m_theirs"])
    np.testing.assert_allclose(s["m_ours"]["l1_loss"], s["m_theirs"]["l1_loss"],
                               rtol=BF16_FIRST_L1_RTOL)
    grads = {n: mu / (1 - B1) for n, mu in s["mu_ours"].items()}
    g_err = _rel_l2(grads, s["clipped"], "bf16 clipped gradient", BF16_GRAD_RTOL)
    nu_err = _rel_l2(s["nu_ours"], s["nu_theirs"], "bf16 Adam second moment", BF16_MOMENT_RTOL)
    u_err = _compare_bf16_first_update(bf16["p0_ours"], s["p_ours"], bf16["p0_theirs"],
                                       s["p_theirs"], s["clipped"])
    _report("dspark bf16 step 1", scalars=rel, grad=g_err, nu=nu_err, update=u_err)


def test_bf16_second_step_equal(bf16):
    s = bf16["steps"][1]
    assert s["replayed"] == 2
    rel = _compare_bf16_scalars(s["m_ours"], s["m_theirs"])
    np.testing.assert_allclose(s["m_ours"]["lr"], LR, rtol=1e-6)
    mu_err = _rel_l2(s["mu_ours"], s["mu_theirs"], "bf16 Adam first moment", BF16_MOMENT_RTOL)
    nu_err = _rel_l2(s["nu_ours"], s["nu_theirs"], "bf16 Adam second moment", BF16_MOMENT_RTOL)
    _report("dspark bf16 step 2", scalars=rel, mu=mu_err, nu=nu_err)


def test_bf16_tolerances_reject_other_recipes(bf16):
    """The bf16 comparisons fail for recipes that differ from DeepSpec's: an fp32 forward (the
    first step's L1 term), a master kept in bf16 (its update rounded to the bf16 grid), and
    unclipped gradients."""
    s = bf16["steps"][0]
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(bf16["fp32_first"]["l1_loss"], s["m_theirs"]["l1_loss"],
                                   rtol=BF16_FIRST_L1_RTOL)
    to_bf16 = lambda t: {n: x.astype(np.float32).astype(jax.numpy.bfloat16).astype(np.float64)
                         for n, x in t.items()}
    with pytest.raises(AssertionError, match="bf16 step 1"):
        _compare_bf16_first_update(bf16["p0_ours"], to_bf16(s["p_ours"]), bf16["p0_theirs"],
                                   s["p_theirs"], s["clipped"])
    unclipped = {n: mu / (1 - B1) * s["m_ours"]["grad_norm"] / MAX_GRAD_NORM
                 for n, mu in s["mu_ours"].items()}
    with pytest.raises(AssertionError, match="clipped gradient"):
        _rel_l2(unclipped, s["clipped"], "bf16 clipped gradient", BF16_GRAD_RTOL)


def _report(what: str, **errs: float) -> None:
    print(f"\n{what}: " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()))


# ---------------------------------------------------------------------------- tests
def test_dense_attention_is_flex_forward(single):
    """The stand-in's output on DeepSpec's first training call equals flex_attention's eager
    forward on the same inputs and BlockMask, bit for bit."""
    q, k, v, block_mask, scale, out = single["seen"][0]
    with torch.no_grad():
        ref = flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    assert torch.equal(out, ref)


def test_first_step_equal(single):
    s = single["steps"][0]
    assert s["replayed"] == 1                   # DeepSpec's forward took our anchors
    for name, p0 in single["p0_theirs"].items():   # the same fp32 start, bit for bit
        np.testing.assert_array_equal(single["p0_ours"][name], p0, err_msg=name)
    assert s["m_theirs"]["grad_norm"] > MAX_GRAD_NORM, "the step must clip"
    rel = _compare_scalars(single["kind"], s["m_ours"], s["m_theirs"])
    np.testing.assert_allclose(s["m_ours"]["lr"], LR / 2, rtol=1e-6)    # warmup: lr · 1/W
    grads = {n: mu / (1 - B1) for n, mu in s["mu_ours"].items()}
    g_err = _compare_tensors(grads, s["clipped"], "clipped gradient")
    nu_err = _compare_tensors(s["nu_ours"], s["nu_theirs"], "Adam second moment", atol=1e-14)
    u_err, left = _compare_updates(single["p0_ours"], s["p_ours"], single["p0_theirs"],
                                   s["p_theirs"], s["nu_theirs"], 1, "step 1")
    _report(f"{single['kind']} step 1", scalars=max(rel.values()), grad=g_err, nu=nu_err,
            update=u_err, left_to_moments=left)


def test_second_step_equal(single):
    s = single["steps"][1]
    assert s["replayed"] == 2
    rel = _compare_scalars(single["kind"], s["m_ours"], s["m_theirs"])
    np.testing.assert_allclose(s["m_ours"]["lr"], LR, rtol=1e-6)        # warmup: lr · 2/W
    mu_err = _compare_tensors(s["mu_ours"], s["mu_theirs"], "Adam first moment")
    nu_err = _compare_tensors(s["nu_ours"], s["nu_theirs"], "Adam second moment", atol=1e-14)
    first = single["steps"][0]
    u_err, left = _compare_updates(first["p_ours"], s["p_ours"], first["p_theirs"],
                                   s["p_theirs"], s["nu_theirs"], 2, "step 2")
    _report(f"{single['kind']} step 2", scalars=max(rel.values()), mu=mu_err, nu=nu_err,
            update=u_err, left_to_moments=left)


def test_accumulated_step_equal(accumulated):
    a = accumulated
    assert len(a["checked"]) == 2               # two micro-steps, each with our anchors
    rel = _compare_scalars("dspark", a["m_ours"], a["m_theirs"])
    grads = {n: mu / (1 - B1) for n, mu in a["mu_ours"].items()}
    g_err = _compare_tensors(grads, a["clipped"], "clipped gradient")
    nu_err = _compare_tensors(a["nu_ours"], a["nu_theirs"], "Adam second moment", atol=1e-14)
    u_err, left = _compare_updates(a["p0_ours"], a["p_ours"], a["p0_theirs"], a["p_theirs"],
                                   a["nu_theirs"], 1, "accumulated step")
    _report("dspark accumulated", scalars=max(rel.values()), grad=g_err, nu=nu_err, update=u_err,
            left_to_moments=left)


def test_accumulated_step_on_longest_padding_equal(accumulated_longest):
    """`data.pad_to="longest"`: our step on the global batch padded to its rounded longest
    equals DeepSpec's accumulated step on micro-batches each padded to its own longest."""
    a = accumulated_longest
    assert (a["width_ours"], a["widths_theirs"]) == (32, [S, S - 6])
    assert len(a["checked"]) == 2
    rel = _compare_scalars("dspark", a["m_ours"], a["m_theirs"])
    grads = {n: mu / (1 - B1) for n, mu in a["mu_ours"].items()}
    g_err = _compare_tensors(grads, a["clipped"], "clipped gradient")
    nu_err = _compare_tensors(a["nu_ours"], a["nu_theirs"], "Adam second moment", atol=1e-14)
    u_err, left = _compare_updates(a["p0_ours"], a["p_ours"], a["p0_theirs"], a["p_theirs"],
                                   a["nu_theirs"], 1, "accumulated step, longest padding")
    _report("dspark accumulated, longest padding", scalars=max(rel.values()), grad=g_err,
            nu=nu_err, update=u_err, left_to_moments=left)
