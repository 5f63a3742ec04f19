"""DeepSpec's own evaluation loop run on a dspark_jax drafter export (SPEC §6).

The consumer check of an export: DeepSpec's `Qwen3DSparkEvaluator.generate_one_sample` (its
`generate_decoding_sample` loop, batch 1) drafts with DeepSpec's `Qwen3DSparkModel` /
`Gemma4DSparkModel` loaded from the export directory and verifies with a PyTorch copy of the
target, so τ here is DeepSpec's τ of exactly what a DeepSpec user would run.

DeepSpec is an installed `deepspec` package or a source directory the user names
(`eval.deepspec_src`, `$DEEPSPEC_SRC`; its MIT source is never part of this package). It
needs PyTorch (`pip install -e '.[interop]'`). `locate_deepspec()` says why not
when either is missing, so callers can skip with that reason.

Two adaptations, both of the environment, not of the loop: its evaluator's `__init__` starts
NCCL, so it is built with `__new__` and given its models; and transformers 5's
`DynamicCache.crop(n)` takes a negative count where DeepSpec passes the absolute length to keep
(transformers < 5), so that meaning is restored while the loop runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pathlib
import sys
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

def locate_deepspec(source: str | os.PathLike | None = None) -> tuple[bool, str]:
    """(True, where) when DeepSpec and PyTorch can be imported, else (False, why not).

    DeepSpec is an installed `deepspec` package, or the source directory the user names
    (`source`, else `$DEEPSPEC_SRC`): the directory that holds `deepspec/`. Nothing else is
    searched."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return False, "PyTorch is not installed (pip install -e '.[interop]')"
    try:
        mod = importlib.import_module("deepspec")
        return True, str(pathlib.Path(mod.__file__).parent)
    except ImportError:
        pass
    src = source or os.environ.get("DEEPSPEC_SRC")
    if not src:
        return False, ("DeepSpec is not installed and no source directory was given "
                       "(eval.deepspec_src or $DEEPSPEC_SRC)")
    c = pathlib.Path(src).resolve()
    if not (c / "deepspec" / "__init__.py").exists():
        return False, f"{c}: no deepspec/ package there (eval.deepspec_src / $DEEPSPEC_SRC)"
    sys.path.insert(0, str(c))
    importlib.invalidate_caches()
    try:
        importlib.import_module("deepspec.eval.dspark.evaluator")
    except ImportError as e:
        sys.path.remove(str(c))
        return False, f"DeepSpec at {c} does not import: {e}"
    return True, str(c)


@contextlib.contextmanager
def absolute_cache_crop() -> Iterator[None]:
    """`DynamicCache.crop(n)` as DeepSpec calls it: n ≥ 0 is the number of positions to keep
    (transformers < 5: its loop passes `start`, its Eagle3 evaluator crops "back to" the length
    before a proposal, which may be 0), so `crop(0)` empties the cache and `crop(n)` past the
    length does nothing; a negative n still removes -n positions (transformers 5's meaning, where
    `crop(0)` does nothing and a positive n is an error)."""
    from transformers import DynamicCache

    orig = DynamicCache.crop

    def crop(self: Any, n: int) -> Any:
        if n >= 0:
            cur = self.get_seq_length()
            if n >= cur:
                return None
            n = n - cur
        return orig(self, n)

    DynamicCache.crop = crop
    try:
        yield
    finally:
        DynamicCache.crop = orig


def torch_target(name_or_path: str | os.PathLike) -> Any:
    """The target as a float32 transformers model with our exact weights: the embedded GGUF's
    dequantized tensors (`models.io.gguf.read_gguf_checkpoint`, the same arrays our target
    loads) or a Hugging Face directory."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from dspark_jax.models.target import EMBEDDED_TARGETS

    if str(name_or_path) in EMBEDDED_TARGETS:
        from dspark_jax.models.io.gguf import locate_smollm2_gguf, read_gguf_checkpoint

        config, tensors = read_gguf_checkpoint(locate_smollm2_gguf())
        cfg = CONFIG_MAPPING[config["model_type"]](
            **{k: v for k, v in config.items() if k != "model_type"})
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        state = {k: torch.as_tensor(v) for k, v in tensors.items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=not cfg.tie_word_embeddings)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=torch.float32)
    return model.to(torch.float32).eval()


@dataclasses.dataclass
class LoopResult:
    """One prompt through DeepSpec's loop; `sample` is what its `generate_one_sample` returned
    (the object DeepSpec's own metrics, `allreduce_response_metrics`, read)."""

    tokens: list[int]                       # generated ids (the prompt excluded)
    acceptance_lengths: list[int]           # per round: accepted drafts + 1 (stop round: + 0)
    proposal_lengths: list[int]
    accepted_draft_lengths: list[int]
    sample: Any = dataclasses.field(default=None, repr=False, compare=False)


def deepspec_evaluator(torch_target_model: Any, draft_dir: str | os.PathLike, *,
                       max_new_tokens: int, temperature: float = 0.0) -> Any:
    """DeepSpec's DSpark evaluator (Qwen3 or Gemma4 drafter class by config.json), fp32, CPU,
    its drafter loaded strictly (a missing or unexpected tensor is an error)."""
    import torch
    from deepspec.eval.dspark.evaluator import Gemma4DSparkEvaluator, Qwen3DSparkEvaluator

    from dspark_jax.models.io.hf import CheckpointError, read_config_json

    arch = (read_config_json(draft_dir).get("architectures") or [""])[0]
    cls = {"Qwen3DSparkModel": Qwen3DSparkEvaluator,
           "Gemma4DSparkModel": Gemma4DSparkEvaluator}.get(arch)
    if cls is None:
        raise CheckpointError(f"{draft_dir}: architectures {arch!r} has no DeepSpec DSpark "
                              "evaluator (Qwen3DSparkModel, Gemma4DSparkModel)")
    draft, info = cls.draft_model_cls.from_pretrained(
        str(draft_dir), dtype=torch.float32, attn_implementation="sdpa",
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                   "mismatched_keys") and v}
    if bad:
        raise CheckpointError(f"{draft_dir}: DeepSpec's {arch} does not load it strictly: {bad}")
    ev = cls.__new__(cls)
    ev.args = SimpleNamespace(temperature=float(temperature), max_new_tokens=int(max_new_tokens),
                              confidence_threshold=0.0, tensorboard_dir=None, step=None,
                              draft_name_or_path=str(draft_dir))
    ev.target_model = torch_target_model
    ev.draft_model = draft.to(torch.float32).eval()
    ev.device = torch.device("cpu")
    ev.confidence_head_recorder = None
    return ev


def run_deepspec_loop(evaluator: Any, prompts: Sequence[Sequence[int]],
                      stop_token_ids: Sequence[int], seed: int = 0) -> list[LoopResult]:
    """`generate_one_sample` on each prompt (token ids), in order."""
    import torch

    torch.manual_seed(seed)
    out = []
    with absolute_cache_crop(), torch.no_grad():
        for ids in prompts:
            x = torch.as_tensor([list(ids)], dtype=torch.long)
            r = evaluator.generate_one_sample(input_ids=x, stop_token_ids=list(stop_token_ids))
            out.append(LoopResult(
                tokens=r.output_ids[0, r.num_input_tokens:].tolist(),
                acceptance_lengths=[int(a) for a in r.acceptance_lengths],
                proposal_lengths=[int(a) for a in r.proposal_lengths],
                accepted_draft_lengths=[int(a) for a in r.accepted_draft_lengths], sample=r))
    return out


def deepspec_tau(results: Sequence[LoopResult]) -> float:
    """DeepSpec's τ: acceptance_length_sum / proposal_count over every round of every prompt."""
    n = sum(len(r.acceptance_lengths) for r in results)
    return sum(sum(r.acceptance_lengths) for r in results) / max(n, 1)
