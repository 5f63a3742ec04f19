"""The training job's configuration: `--config=FILE` + `--config.key=value` overrides
(ml_collections over `train/config_base.py`, locked, so a misspelt key is an error naming the
key) and the checks of the values the job itself interprets; the DraftConfig built from
`config.draft` (SPEC §3–5 fields).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from typing import Any, Sequence

import ml_collections

FEATURE_MODES = ("online", "offline")
DATA_ORDERS = ("grain", "deepspec")
PAD_TO = ("max_length", "longest")
PRECISIONS = ("fp32", "bf16")


class UsageError(ValueError):
    """A bad command line or config value; the message names the key."""


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


def parse_config(argv: Sequence[str], require_target: bool = True) -> ml_collections.ConfigDict:
    """Loads `--config=FILE` and applies `--config.key=value` overrides (ml_collections).
    `require_target=False` (ahead-of-time compilation) accepts an empty `config.target`."""
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
    # experiment files import the package's config base; the repo's configs/*.py also import
    # each other (`from configs.qwen3 import …`): make the config directory's parent importable
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
    validate_config(config, require_target=require_target)
    return config


def _starts_from_target(model_type: str | None) -> bool:
    """Whether drafters of this kind may start from the target's layers
    (`DrafterKind.init_from_target`)."""
    from dspark_jax.models.drafters.kind import drafter_kinds

    kind = drafter_kinds().get(model_type)
    return bool(kind and kind.init_from_target)


def validate_config(c: ml_collections.ConfigDict, require_target: bool = True) -> None:
    """Checks the values the job itself interprets (the drafter fields are DraftConfig's)."""
    from dspark_jax.train.config_base import get_base_config

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

    if require_target and not c.target:
        bad("target", "required: an embedded target name (smollm2-135m-instruct) or a Hugging "
            "Face directory, e.g. --config.target=/path/to/Qwen3-4B")
    if c.data.features not in FEATURE_MODES:
        bad("data.features", f"{c.data.features!r} is not one of {FEATURE_MODES}")
    if c.data.heldout < 0 or (c.data.heldout >= 1 and c.data.heldout != int(c.data.heldout)):
        bad("data.heldout", f"{c.data.heldout!r} must be a fraction in [0, 1) or a whole count "
            "of prompts ≥ 1")
    if c.data.max_prompts == 0 or c.data.max_prompts < -1:
        bad("data.max_prompts", f"{c.data.max_prompts!r} must be ≥ 1 (or -1: every prompt)")
    if c.data.regen_batch_size < 1:
        bad("data.regen_batch_size", "must be ≥ 1")
    if c.data.max_new_tokens < 1:
        bad("data.max_new_tokens", "must be ≥ 1")
    from dspark_jax.decoding.sampling import check_sampling

    for key in ("temperature", "top_k", "top_p"):   # regeneration's sampling, before it runs
        try:
            check_sampling(**{key: c.data[key]})
        except ValueError as exc:
            bad(f"data.{key}", str(exc).split(" ", 1)[1])
    if c.data.max_length < 2:
        bad("data.max_length", "must be ≥ 2")
    if c.data.order not in DATA_ORDERS:
        bad("data.order", f"{c.data.order!r} is not one of {DATA_ORDERS}")
    if c.data.order == "deepspec" and c.data.pack:
        bad("data.order", "'deepspec' orders one sample per row, as DeepSpec's sampler does; "
            "set data.pack=False")
    if c.data.pad_to not in PAD_TO:
        bad("data.pad_to", f"{c.data.pad_to!r} is not one of {PAD_TO}")
    if (isinstance(c.data.pad_multiple, bool) or not isinstance(c.data.pad_multiple, int)
            or c.data.pad_multiple < 1):
        bad("data.pad_multiple", f"{c.data.pad_multiple!r} must be an integer ≥ 1 (1: each "
            "batch padded to its exact longest sample)")
    if c.data.pad_to == "longest" and c.data.pack:
        bad("data.pad_to", "'longest' pads one sample a row to its batch's longest, packed rows "
            "fill data.max_length; set data.pack=False or data.pad_to=max_length")
    t = c.train
    if t.global_batch_size < 1:
        bad("train.global_batch_size", "must be ≥ 1")
    if t.micro_batches < 1 or t.global_batch_size % t.micro_batches:
        bad("train.micro_batches", f"{t.micro_batches} must divide global_batch_size "
            f"{t.global_batch_size}")
    if t.epochs < 1 and t.max_steps < 0:
        bad("train.epochs", "must be ≥ 1 (or set train.max_steps)")
    positive, at_least_0 = (lambda v: v > 0, "must be > 0"), (lambda v: v >= 0, "must be ≥ 0")
    below_1 = (lambda v: 0 <= v < 1, "must be in [0, 1)")
    for key, (ok, rule) in {"lr": positive, "eps": positive, "clip_norm": positive,
                            "weight_decay": at_least_0, "b1": below_1, "b2": below_1,
                            "warmup_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]")
                            }.items():
        if not ok(float(t[key])):   # NaN fails every rule
            bad(f"train.{key}", f"{t[key]!r} {rule}")
    for key in ("compute_dtype", "target_dtype"):
        if t[key] not in ("float32", "fp32", "bfloat16", "bf16"):
            bad(f"train.{key}", f"{t[key]!r} is not float32 or bfloat16")
    if t.precision not in PRECISIONS:
        bad("train.precision", f"{t.precision!r} is not one of {PRECISIONS}")
    if t.precision == "bf16" and t.compute_dtype not in ("bfloat16", "bf16"):
        bad("train.precision", f"'bf16' runs the drafter in bfloat16 as DeepSpec does; set "
            f"train.compute_dtype=bfloat16 too (it is {t.compute_dtype!r})")
    if t.attn_key_chunk < 0:
        bad("train.attn_key_chunk", "must be ≥ 1 (keys per chunk) or 0 (dense scores)")
    if not isinstance(t.get("attn_kernel", True), bool):
        bad("train.attn_kernel", f"{t.attn_kernel!r} is not True or False")
    if t.log_every < 1:
        bad("train.log_every", "must be ≥ 1")
    if t.max_nonfinite_steps < 1:
        bad("train.max_nonfinite_steps", f"{t.max_nonfinite_steps} must be ≥ 1 (non-finite "
            "steps in a row that stop the run)")
    if t.init_from_target and not _starts_from_target(c.draft.get("model_type")):
        bad("train.init_from_target", f"only DSpark / DFlash drafters start from the target's "
            f"layers, not draft.model_type={c.draft.get('model_type')!r}")
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
    if c.eval.every_steps < 0:
        bad("eval.every_steps", "must be ≥ 0 (0: held-out evaluation only after training)")
    if c.eval.deepspec_check_samples < 0:
        bad("eval.deepspec_check_samples", "must be ≥ 0 (0: no DeepSpec-loop check)")
    if c.eval.deepspec_check_max_new_tokens < 1:
        bad("eval.deepspec_check_max_new_tokens", "must be ≥ 1")
    temps = c.eval.speculative_temperatures
    if isinstance(temps, (int, float)):
        bad("eval.speculative_temperatures", f"{temps!r} must be a tuple, e.g. '(0.0, 1.0)'")
    if any(float(x) < 0 for x in temps) or (c.eval.speculative and not temps):
        bad("eval.speculative_temperatures", f"{tuple(temps)!r}: give one or more temperatures ≥ 0")


def attn_key_chunk(c: ml_collections.ConfigDict) -> int | None:
    """`train.attn_key_chunk` (0: the dense block attention)."""
    return int(c.train.attn_key_chunk) or None


def attn_kernel(c: ml_collections.ConfigDict) -> bool:
    """`train.attn_kernel` (True where a config predates it)."""
    return bool(c.train.get("attn_kernel", True))


def maybe_initialize_distributed(c: ml_collections.ConfigDict) -> None:
    """`jax.distributed.initialize()` for `config.distributed` / DSPARK_DISTRIBUTED=1.

    On a cluster (TPU pod, SLURM) JAX finds the coordinator and the process ids itself. Set
    explicitly, JAX_COORDINATOR_ADDRESS=host:port with JAX_NUM_PROCESSES and JAX_PROCESS_ID
    (launch/multi_gpu.sh's manual mode, launch/local_multiprocess.sh) are passed on, since JAX
    reads only the address from the environment. On CPU the cross-process collectives run over
    gloo.
    """
    want = c.distributed or os.environ.get("DSPARK_DISTRIBUTED", "").lower() in ("1", "true")
    if not want:
        return
    import jax

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw: dict[str, Any] = {}
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and os.environ.get("JAX_NUM_PROCESSES"):
        try:
            kw = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ["JAX_PROCESS_ID"]))
        except (KeyError, ValueError):
            raise UsageError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers (with "
                             "JAX_COORDINATOR_ADDRESS)") from None
    jax.distributed.initialize(**kw)


def build_draft_config(c: ml_collections.ConfigDict, target: Any):
    """DraftConfig from `config.draft` (DraftConfig's ConfigError names a bad field)."""
    from dspark_jax.models.config import ConfigError
    from dspark_jax.models.drafters.config import DraftConfig, validate_against_target

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
