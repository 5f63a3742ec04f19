"""`EvalConfig`: every setting of an offline evaluation (DeepSpec's protocol, SPEC §6/§7), one
frozen, validated object that `dspark_jax.evaluate.evaluate` runs and its command line builds.

The defaults are the protocol's: DeepSpec's datasets, per-dataset sample caps and seeded
subsampling (seed 980406), the first turn only with thinking off, T = 1.0, 2048 new tokens, the
"fixed" scheduler (all γ drafts verified every round) and DeepSpec's token-budget rule. The
serving settings of the run are one `EngineSettings` (:meth:`EvalConfig.engine_settings`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dspark_jax.data.prompts import DEEPSPEC_EVAL_SEED, DEFAULT_EVAL_SAMPLES
from dspark_jax.decoding.tree import DEFAULT_BRANCHING
from dspark_jax.eval.paper_table import PAPER_DATASETS, paper_reference_for

if TYPE_CHECKING:
    from dspark_jax.serving.settings import EngineSettings

__all__ = ["EvalConfig", "config_from_fields", "DEFAULT_DATASETS", "DEFAULT_MAX_NEW_TOKENS",
           "DEFAULT_TEMPERATURE", "DEFAULT_BATCH_SIZE", "DEFAULT_OUT_DIR"]

#: The DeepSpec protocol's datasets in the column order of the paper's Table 1.
DEFAULT_DATASETS: tuple[str, ...] = PAPER_DATASETS
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_TEMPERATURE = 1.0
DEFAULT_BATCH_SIZE = 8
DEFAULT_OUT_DIR = "eval_results"

MaxSamples = int | str | None | Mapping[str, int | None]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """One offline evaluation of `draft` on `target` over `<data_dir>/<name>.jsonl` prompts.

    `target`: a loaded `Target` or a name/directory for `load_target`, loaded in `dtype` (None:
    float32); a loaded `Target` runs in its own dtype, so `dtype` must then be None or that
    dtype. `draft`: a `Draft` or a DeepSpec/speculators checkpoint directory. `tokenizer`: None
    = the target's. `datasets`: names or one comma-separated string; None = the protocol's
    datasets present. `max_samples`: "default" (DeepSpec's caps), None/"all", an int for every
    dataset or {name: int}. `max_cache_len`: the cache limit in tokens (None: the target's
    max_position_embeddings); a prompt that cannot hold the output under it is skipped and
    counted. `scheduler`, `verifier`, `tree_budget` (> 0: draft trees of that many nodes, at
    most `tree_branching` children a node; τ is then the tree's accepted length + 1, and no
    calibration is reported) and `stop_token_ids` are the serving engine's settings.
    `paper_reference`: the paper's Table 1 row shown beside ours ("auto", "none" or
    "TARGET/DRAFTER"). `out_dir`: where the files are written (None: nowhere). `baseline`: also
    decode plainly and report the speedup. `save_outputs`: the generated ids and text in
    records.jsonl.

    Construction raises ValueError naming the first bad field.
    """

    target: Any
    draft: Any
    data_dir: str | os.PathLike
    datasets: Sequence[str] | str | None = None
    max_samples: MaxSamples = "default"
    seed: int = DEEPSPEC_EVAL_SEED
    temperature: float = DEFAULT_TEMPERATURE
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = DEFAULT_BATCH_SIZE
    out_dir: str | os.PathLike | None = None
    baseline: bool = False
    verifier: str = "jax"
    max_cache_len: int | None = None
    enable_thinking: bool = False
    system_prompt: str | None = None
    stop_token_ids: Sequence[int] | None = None
    tokenizer: Any = None
    dtype: str | None = None
    paper_reference: str | None = "auto"
    save_outputs: bool = False
    progress: bool = True
    plots: bool = True
    scheduler: str = "fixed"
    tree_budget: int = 0
    tree_branching: int = DEFAULT_BRANCHING

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        self.engine_settings().validate()   # scheduler, verifier, tree_budget, tree_branching
        _check_max_samples(self.max_samples)
        paper_reference_for("", "dspark", self.paper_reference)   # ValueError for a bad row

    def engine_settings(self) -> EngineSettings:
        """The serving engine's settings of the run (`serving.generation_settings`: DeepSpec's
        token-budget rule)."""
        from dspark_jax.serving.generation import generation_settings

        return generation_settings(
            scheduler=self.scheduler, verifier=self.verifier, tree_budget=int(self.tree_budget),
            tree_branching=int(self.tree_branching), stop_token_ids=self.stop_token_ids)

    def samples_for(self, name: str) -> int | None:
        """The most prompts to evaluate of dataset `name` (None: all of them)."""
        m = self.max_samples
        if isinstance(m, Mapping):
            return m.get(name, DEFAULT_EVAL_SAMPLES.get(name))
        if m == "default":
            return DEFAULT_EVAL_SAMPLES.get(name)
        return None if m is None or m == "all" else int(m)


def config_from_fields(args: Sequence[Any], named: Mapping[str, Any]) -> EvalConfig:
    """`EvalConfig(*args, **named)` for the deprecated call `evaluate(target, draft, data_dir,
    **fields)`: TypeError naming every keyword that is not a field, else a `DeprecationWarning`
    naming the call to write, `evaluate(EvalConfig(...))`."""
    names = [f.name for f in dataclasses.fields(EvalConfig)]
    unknown = sorted(set(named) - set(names))
    if unknown:
        raise TypeError(f"evaluate() got unexpected keyword argument(s) "
                        f"{', '.join(map(repr, unknown))}: not EvalConfig fields")
    shown = ", ".join(names[:len(args)] + [f"{k}=..." for k in named])
    warnings.warn(f"evaluate() with EvalConfig fields as arguments is deprecated: pass "
                  f"evaluate(EvalConfig({shown}))", DeprecationWarning, stacklevel=3)
    return EvalConfig(*args, **named)


def _check_max_samples(m: Any) -> None:
    """ValueError unless `m` is "default", None/"all", an int ≥ 0 or a {name: int ≥ 0 | None}."""
    values = list(m.values()) if isinstance(m, Mapping) else [m]
    for v in values:
        if v is None or (v in ("default", "all") and not isinstance(m, Mapping)):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"max_samples must be 'default', None/'all', an int ≥ 0 or a "
                             f"mapping of them; got {m!r}")
