"""DeepSpec's own DSpark trainer (`deepspec.trainer.dspark_trainer.Qwen3DSparkTrainer`), run
in this process on CPU for `bench.peers_train`: its `__init__` (draft config builder, model init,
FSDP `no_shard` wrapper, `BF16Optimizer` with fp32 master weights, AdamW and
`CosineAnnealingWarmupLR`) and its `train()` loop (forward, masks, anchor sampler,
`compute_dspark_loss`, `FSDP.clip_grad_norm_`, the optimizer step), unchanged. DeepSpec's source is
imported from its directory at run time (never copied here); only the environment around the
trainer is replaced:

  * gloo at world size 1 on a local FileStore instead of NCCL (`init_dist`), "local main
    process" answered from the rank (DeepSpec asks `torch.cuda.current_device()`);
  * `device_id=cpu` added to its FSDP arguments;
  * an in-memory dataset with a cache manifest instead of its on-disk target cache
    (`validate_train_cache` still checks the manifest), and the micro-batches handed to it,
    collated by its own `CacheCollator`, instead of its DataLoader and CUDA prefetcher;
  * a dense attention for `flex_attention`, which has no backward on CPU: DeepSpec's own
    BlockMask materialised with `create_mask`, masked scores and `torch._safe_softmax`, the
    operations of flex's eager forward in its order and precision;
  * no checkpoint writes (`save_and_eval_checkpoint` returns) and no console summary per step;
  * import-time: `torch.utils.tensorboard` falls back to tensorboardX's SummaryWriter where the
    `tensorboard` package is missing, and `deepspec.trainer` is registered bare so that its
    Eagle3 trainer (a Triton loss, no CPU backend) is not imported.

tests/train/test_deepspec_trainer_step.py checks the same trainer under the same environment
step for step against ours.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import types
from typing import Any, Callable, Sequence

import numpy as np

from dspark_jax.models.drafters.config import DraftConfig


def deepspec_source_problem(src: pathlib.Path) -> str | None:
    """Why DeepSpec's trainer cannot run from `src` (its source missing, torch missing), or
    None."""
    if not (src / "deepspec" / "trainer" / "dspark_trainer.py").is_file():
        return f"DeepSpec's source is not at {src} (no deepspec/trainer/dspark_trainer.py)"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (DeepSpec's trainer is PyTorch)"
    return None


def import_deepspec(src: pathlib.Path) -> types.SimpleNamespace:
    """DeepSpec's trainer modules from the source directory `src` (the one holding `deepspec/`),
    with the two import-time shims of the module docstring."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        import tensorboardX

        sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(
            SummaryWriter=tensorboardX.SummaryWriter)
    root = str(src.resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    import deepspec

    if not hasattr(sys.modules.get("deepspec.trainer"), "__path__"):
        trainer_pkg = types.ModuleType("deepspec.trainer")
        trainer_pkg.__path__ = [str(src.resolve() / "deepspec" / "trainer")]
        sys.modules["deepspec.trainer"] = trainer_pkg
        deepspec.trainer = trainer_pkg
    import deepspec.trainer.base_trainer as base
    import deepspec.utils.distributed as distributed
    import deepspec.utils.training_logger as logger
    from deepspec.data.cuda_prefetcher import move_batch_to_device
    from deepspec.trainer.dspark_trainer import Qwen3DSparkTrainer
    from deepspec.utils import seed_all
    from deepspec.utils.config import to_config_node

    return types.SimpleNamespace(base=base, distributed=distributed, logger=logger,
                                 move_batch_to_device=move_batch_to_device,
                                 Qwen3DSparkTrainer=Qwen3DSparkTrainer, seed_all=seed_all,
                                 to_config_node=to_config_node)


def start_process_group(store: pathlib.Path) -> None:
    """gloo, world size 1, on a FileStore at `store` (what DeepSpec's `init_dist` sets up with
    NCCL); nothing when a group is already up."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store.parent.mkdir(parents=True, exist_ok=True)
        dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0,
                                world_size=1)


def dense_flex_attention() -> Callable:
    """`flex_attention` for DeepSpec's drafter, differentiable on CPU: the BlockMask's own
    `mask_mod` materialised by `create_mask`, scaled scores set to −inf where masked and
    `torch._safe_softmax` (a fully masked row, a padding block, gives zeros); scores and softmax
    in fp32, the probabilities cast back to the input dtype before the product with the
    values, as flex's eager forward does. DeepSpec repeats the K/V heads for GQA itself."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        del module, kwargs
        B, _, Q, _ = query.shape
        mask = create_mask(attention_mask.mask_mod, B, 1, Q, key.shape[-2], device=query.device)
        scores = (query.float() @ key.float().transpose(-2, -1)) * scaling
        scores = torch.where(mask, scores, torch.tensor(-float("inf"), dtype=scores.dtype))
        out = torch._safe_softmax(scores, dim=-1).to(query.dtype) @ value
        return out.transpose(1, 2).contiguous(), None

    return attend


class _MemoryCache:
    """Stands in for DeepSpec's on-disk `CacheDataset` where the trainer's `__init__` reads it:
    its length (the epoch arithmetic) and its manifest (`validate_train_cache`)."""

    def __init__(self, size: int, manifest: dict[str, Any]):
        self.size, self.manifest = size, manifest

    def __len__(self) -> int:
        return self.size


def patch_environment(ds: types.SimpleNamespace, dataset_size: int, manifest: dict[str, Any],
                      summaries: list) -> None:
    """The run-time shims of the module docstring, on DeepSpec's modules (for this process);
    each optimizer step's logged summary is appended to `summaries`."""
    import torch
    import torch.distributed as dist
    from transformers.models.qwen3.modeling_qwen3 import ALL_ATTENTION_FUNCTIONS

    build_fsdp_kwargs = ds.base._build_fsdp_kwargs
    if not getattr(build_fsdp_kwargs, "cpu_shim", False):
        def fsdp_kwargs(**kw):
            return dict(build_fsdp_kwargs(**kw), device_id=torch.device("cpu"))

        fsdp_kwargs.cpu_shim = True
        ds.base._build_fsdp_kwargs = fsdp_kwargs
    real_on_step = getattr(ds.logger.on_optimizer_step, "real", ds.logger.on_optimizer_step)

    def on_optimizer_step(**kw):
        summaries.append(real_on_step(**kw))
        return summaries[-1]

    on_optimizer_step.real = real_on_step

    def init_dist(local_rank):
        assert dist.is_initialized() and dist.get_world_size() == 1
        return torch.device("cpu"), 0, 1

    ds.base.init_dist = init_dist
    ds.distributed.is_local_main_process = lambda: dist.get_rank() == 0
    ds.base.CUDAPrefetcher = lambda loader, device: (ds.move_batch_to_device(b, device)
                                                     for b in loader)
    ds.logger.on_optimizer_step = on_optimizer_step
    ds.logger._print_summary = lambda **kw: None
    ds.base.CacheDataset = lambda cache_dir: _MemoryCache(dataset_size, manifest)
    ALL_ATTENTION_FUNCTIONS["flex_attention"] = dense_flex_attention()


def deepspec_model_args(cfg: DraftConfig, target_hf: pathlib.Path) -> dict[str, Any]:
    """DeepSpec's `model` section for the DSpark drafter `cfg` (its config/dspark/*.py keys)."""
    return dict(target_model_name_or_path=str(target_hf), block_size=cfg.block_size,
                num_draft_layers=cfg.num_draft_layers,
                target_layer_ids=[int(i) for i in cfg.target_layer_ids],
                mask_token_id=cfg.mask_token_id, num_anchors=cfg.num_anchors,
                markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                confidence_head_alpha=cfg.confidence_head_alpha if cfg.has_confidence else 0.0,
                confidence_head_with_markov=cfg.confidence_head_with_markov,
                loss_decay_gamma=cfg.loss_decay_gamma, ce_loss_alpha=cfg.ce_loss_alpha,
                l1_loss_alpha=cfg.l1_loss_alpha)


@dataclasses.dataclass
class DeepSpecRun:
    """DeepSpec's trainer, fed one optimizer step at a time (`step`)."""

    trainer: Any
    feed: list
    summaries: list
    names: list[str]

    def step(self, items: Sequence[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step of DeepSpec's `train()` over `items` (cache items: `input_ids`,
        `loss_mask`, `target_hidden_states`, `target_last_hidden_states` as torch tensors of
        each sample's own length); returns its logged summary (without the `train/` prefix)."""
        self.feed[:] = items
        n = len(self.summaries)
        self.trainer.train()
        assert len(self.summaries) == n + 1, "one optimizer step per call"
        return {k.removeprefix("train/"): float(v) for k, v in self.summaries[-1].items()}

    def master_tensors(self) -> dict[str, np.ndarray]:
        """The drafter's tensors under DeepSpec's names: the fp32 master weights of the trained
        parameters, the frozen embedding and LM head as the model holds them (fp32)."""
        out = {k: v.detach().float().numpy() for k, v in self.trainer.draft_model.state_dict()
               .items()}
        for name, p in zip(self.names, self.trainer.optimizer.fp32_params):
            out[name] = p.detach().float().numpy().copy()
        return out


def build_dspark_trainer(ds: types.SimpleNamespace, cfg: DraftConfig, target_hf: pathlib.Path,
                         workdir: pathlib.Path, *, seed: int, lr: float, warmup_ratio: float,
                         weight_decay: float, max_grad_norm: float, total_steps: int,
                         batch_size: int, precision: str, dataset_size: int) -> DeepSpecRun:
    """DeepSpec's `Qwen3DSparkTrainer` for the drafter `cfg` with the given optimizer settings,
    its model initialised by DeepSpec itself after `seed_all(seed)`; local batch = global batch
    = `batch_size` (no accumulation), `precision` "fp32" or "bf16"."""
    feed: list = []
    summaries: list = []
    manifest = dict(target_layer_ids=[int(i) for i in cfg.target_layer_ids],
                    hidden_size=cfg.target.hidden_size,
                    target_model_name_or_path=str(target_hf))
    patch_environment(ds, dataset_size, manifest, summaries)

    class Trainer(ds.Qwen3DSparkTrainer):
        def _build_train_dataloader(self, start_offset_samples=0, num_samples=None):
            collate = self.data_collator_cls()
            b = int(self.args.train.local_batch_size)
            return [collate(feed[i: i + b]) for i in range(0, len(feed), b)]

        def save_and_eval_checkpoint(self):
            return None

    args = ds.to_config_node(dict(
        exp_name="peers_train",
        model=deepspec_model_args(cfg, target_hf),
        train=dict(lr=lr, warmup_ratio=warmup_ratio, weight_decay=weight_decay,
                   precision=precision, local_batch_size=batch_size,
                   global_batch_size=batch_size, num_train_epochs=1,
                   max_train_steps=total_steps, max_grad_norm=max_grad_norm,
                   sharding_strategy="no_shard", torch_compile=False),
        logging=dict(logging_steps=1, checkpointing_steps=10 ** 9,
                     checkpoint_dir=str(workdir / "ckpt"), tensorboard_dir=None),
        data=dict(target_cache_path=str(workdir / "cache"), num_workers=0)))
    ds.seed_all(seed)
    trainer = Trainer(0, args)
    names = [n for n, p in trainer.draft_model.named_parameters() if p.requires_grad]
    assert len(names) == len(trainer.optimizer.model_params)
    return DeepSpecRun(trainer=trainer, feed=feed, summaries=summaries, names=names)
