"""The serving engine's settings (paper §3.2.2, §5.2–5.4; SPEC §8, §9): one frozen, validated
object (`EngineSettings`), the one way serving settings reach `Engine(target, draft,
settings=...)` and `speculative_generate(..., settings=...)`.

`validate()` checks what the settings say by themselves; `check_models(target, draft)` what
they ask of the target and the drafter (a drafter for every mode but `none`, a confidence head
for the modes that schedule on confidences, the vanilla Markov head for `sampler="pallas"`).
`with_fields` is the deprecated keyword form of both callers: settings fields given as keywords
are folded into one `EngineSettings` with a `DeprecationWarning` naming the call to write.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Sequence

from dspark_jax.decoding.acceptance_rule import VERIFIERS
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.pallas_backend import check_offered
from dspark_jax.decoding.prefill_plan import PREFILL_TOKENS
from dspark_jax.decoding.round_types import BUDGET_RULES, SAMPLERS
from dspark_jax.decoding.tree import DEFAULT_BRANCHING
from dspark_jax.models.drafters.config import validate_against_target
from dspark_jax.models.families import family_of
from dspark_jax.serving.modes import BUILTIN_MODES, SchedulerMode, scheduler_mode


def check_verifier(verifier: str) -> None:
    """Raises ValueError for a verifier that is not in `acceptance_rule.VERIFIERS`, and for
    "pallas" where this backend offers no Pallas kernel (`pallas_backend.check_offered`)."""
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; choose from {sorted(VERIFIERS)}")
    if verifier == "pallas":
        check_offered("verifier='pallas'")


@dataclasses.dataclass(frozen=True, eq=False)
class EngineSettings:
    """Every setting of `Engine` (`Engine(target, draft, settings=EngineSettings(...))`).

    Costs of the `adaptive` drafting choice (`serving.policy`): `draft_seconds` (the drafter's
    time per round) and `plain_seconds` (a plain decoding step), in the units of `sps`; when
    None they are profiled with SPS (cached on disk in `sps_cache_dir`, `serving.cost_profile`),
    except that with `sps` passed in the drafter counts as free and a plain step as the
    verification step at n tokens (the paper's rule: always draft). `probe_interval` /
    `max_probe_interval`: the least rounds between probes while plain decoding wins (doubling at
    each probe); `explore`: the fraction of plain decoding time that probes may cost (None: no
    limit). `plain_steps_per_call`: the most plain steps (`none`) or plain rounds (`adaptive`'s
    rounds that skip drafting) one device call runs; `rounds_per_call` the most drafting rounds.
    `production` (the paper's §5.2 schedule without that choice) profiles SPS only, never reads
    these costs and always drafts.

    Joining requests are prefilled `prefill_chunk` tokens of each at a time, in calls of at
    most `prefill_tokens` padded tokens (`prefill_plan.PREFILL_TOKENS`; one longer prompt has
    a call to itself; on a mesh, that many for each part the slots are split into): a call
    holds a fresh cache of its rows until it moves them into the slots, so this bounds the
    memory a join takes beside the slots' own caches.

    `layer_buffers`: the target layout prefill, decoding steps and verification run on
    (`Target.decoding_layout`): True one buffer per decoder layer, so the dots read the
    weights where they lie (on GPUs and TPUs a scanned stack has them copied out every step);
    False the stacked layers, several times faster to compile; None (default): one buffer per
    layer on accelerators, the stacked layers on CPU, where the engine's steps and rounds run
    as fast on either (docs/benchmark-log/serving-2026-12-03.md) and a short job's time is
    mostly compilation.
    Both layouts compute the same logits bit for bit.

    Draft trees (`tree_budget` N > 0, docs/TREES.md): every round drafts a tree of N nodes a
    request (at most `tree_branching` children a node, the chain of γ drafts always among
    them) and verifies it in one target forward: all of it (`fixed`), or the prefix the
    scheduler admits (the modes with `SchedulerMode.schedules_trees`); N ≥ γ, the "jax"
    sampler and verifier, and a DSpark or DFlash drafter.

    Token budget: `budget_rule="serving"` (default) ends a request as soon as it has emitted
    `max_new_tokens`, and `cap_to_budget` (default True) never verifies drafts past that budget.
    `budget_rule="deepspec"` is the rule of DeepSpec's evaluation loop (`while start <
    max_length`): every round verifies the full block (`cap_to_budget` defaults to False and
    cannot be True), a request runs another round while it has emitted at most
    `max_new_tokens` tokens, and its output is cut at the budget, so the rounds, their counts
    and τ are DeepSpec's (`speculative_generate` and `dspark_jax.evaluate` use it).
    """

    max_requests: int = 16                  # R: request slots decoded together
    max_len: int = 2048                     # the longest a request (prompt + output) may be
    scheduler: str | SchedulerMode = "adaptive"   # a `serving.modes` name, or a mode
    threshold: float = 0.5                  # `threshold` mode's cut on σ(c)
    capacity_buckets: Sequence[int] | None = None   # verification capacities K (default R…R(γ+1))
    prefill_chunk: int = 128                # prompt tokens a prefill forward takes at a time
    prefill_tokens: int = PREFILL_TOKENS    # a prefill call's most tokens a slot shard
    sps: Any = None                         # SPS(B): a table [B + 1] or {bucket: steps/s}
    sps_cache_dir: str | None = None        # the profiles' disk cache (`cost_profile`)
    profile_repeats: int = 3
    confidence_temperatures: Sequence[float] | None = None   # [γ] calibration (default: draft's)
    verifier: str = "jax"                   # `acceptance_rule.VERIFIERS`
    sampler: str = "jax"                    # `round_types.SAMPLERS`
    stop_token_ids: Sequence[int] | None = None   # default: the tokenizer's / config's
    cap_to_budget: bool | None = None       # default: budget_rule == "serving"
    budget_rule: str = "serving"            # `round_types.BUDGET_RULES`
    draft_seconds: float | None = None      # t_d (adaptive; default profiled)
    plain_seconds: float | None = None      # t_plain (adaptive; default profiled)
    probe_interval: int = 4
    max_probe_interval: int = 64
    explore: float | None = 0.01
    plain_steps_per_call: int = 16
    rounds_per_call: int = 8
    len_bucket: int = 64
    layer_buffers: bool | None = None       # decoding layout (`Target.decoding_layout`)
    tree_budget: int = 0                    # draft trees of N nodes (`decoding.tree`); 0: chain
    tree_branching: int = DEFAULT_BRANCHING  # a tree node's most children

    @property
    def caps_budget(self) -> bool:
        """Whether drafts past a request's token budget are never verified."""
        if self.cap_to_budget is None:
            return self.budget_rule == "serving"
        return bool(self.cap_to_budget)

    @property
    def mode(self) -> SchedulerMode:
        """The scheduler mode `scheduler` names (`serving.modes.scheduler_mode`)."""
        return scheduler_mode(self.scheduler)

    def validate(self) -> "EngineSettings":
        """Raises ValueError naming the first bad setting; → self."""
        self._check_names()
        if self.cap_to_budget and self.budget_rule == "deepspec":
            raise ValueError("budget_rule='deepspec' verifies full blocks up to the end (as "
                             "DeepSpec's loop); it cannot be combined with cap_to_budget=True")
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be ≥ 1, got {self.max_requests}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be ≥ 2 (a prompt token and a new one), got "
                             f"{self.max_len}")
        if self.stop_token_ids is not None and any(int(i) < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids ≥ 0 ([]: no stop token), got "
                             f"{list(self.stop_token_ids)}")
        if self.layer_buffers not in (None, True, False):
            raise ValueError(f"layer_buffers must be True, False or None (the devices' "
                             f"layout), got {self.layer_buffers!r}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be ≥ 1, got {self.prefill_chunk}")
        if self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be ≥ 1, got {self.prefill_tokens}")
        if min(self.plain_steps_per_call, self.rounds_per_call, self.len_bucket) < 1:
            raise ValueError(f"plain_steps_per_call, rounds_per_call and len_bucket must be "
                             f"≥ 1, got {self.plain_steps_per_call}, {self.rounds_per_call} "
                             f"and {self.len_bucket}")
        if self.tree_budget < 0 or self.tree_branching < 1:
            raise ValueError(f"tree_budget must be ≥ 0 and tree_branching ≥ 1, got "
                             f"{self.tree_budget} and {self.tree_branching}")
        if self.tree_budget and (not self.mode.schedules_trees
                                 or self.sampler != "jax" or self.verifier != "jax"):
            trees = [m.name for m in BUILTIN_MODES if m.schedules_trees]
            raise ValueError(f"tree_budget: trees are scheduled by {trees} "
                             f"and sampled and verified by 'jax', got scheduler "
                             f"{self.scheduler!r}, sampler {self.sampler!r} and verifier "
                             f"{self.verifier!r}")
        if self.mode.reads_threshold and not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        self._check_costs()
        return self

    def _check_names(self) -> None:
        scheduler_mode(self.scheduler)   # raises naming the field and the built-in modes
        for name, value, known in (("budget_rule", self.budget_rule, BUDGET_RULES),
                                   ("sampler", self.sampler, SAMPLERS)):
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}; choose from {list(known)}")
        check_verifier(self.verifier)
        if self.sampler == "pallas":
            check_offered("sampler='pallas'")

    def _check_costs(self) -> None:
        if self.draft_seconds is not None and not float(self.draft_seconds) >= 0:
            raise ValueError(f"draft_seconds must be ≥ 0, got {self.draft_seconds}")
        if self.plain_seconds is not None and not float(self.plain_seconds) > 0:
            raise ValueError(f"plain_seconds must be > 0, got {self.plain_seconds}")
        if not 1 <= int(self.probe_interval) <= int(self.max_probe_interval):
            raise ValueError(f"probe_interval must be ≥ 1 and ≤ max_probe_interval, got "
                             f"probe_interval={self.probe_interval}, "
                             f"max_probe_interval={self.max_probe_interval}")
        if self.explore is not None and not 0.0 <= float(self.explore) <= 1.0:
            raise ValueError(f"explore must be in [0, 1] or None, got {self.explore}")

    def check_models(self, target: Any, draft: Any) -> None:
        """Raises ValueError when the target and the drafter cannot serve these settings."""
        if not self.mode.drafts:
            return
        if draft is None:
            raise ValueError(f"scheduler={self.scheduler!r} needs a drafter (draft=None only "
                             "works with scheduler='none')")
        validate_against_target(draft.config, target.config, source="draft")
        model_type = draft.config.model_type
        if self.mode.needs_confidence and not draft.config.has_confidence:
            raise ValueError(f"scheduler={self.scheduler!r} needs the drafter's confidence "
                             f"head, but this {model_type} drafter has none; use "
                             "scheduler='fixed' (or 'none')")
        if self.tree_budget:
            self._check_tree(target, draft)
        adapter = adapter_for(model_type)
        if self.sampler == "pallas" and not (adapter.markov_kernel
                                             and adapter.supports_markov_kernel(draft.model)):
            raise ValueError(
                "sampler='pallas' runs the vanilla Markov-head sampling kernel, but this "
                f"{model_type} drafter has markov_head_type="
                f"{getattr(draft.config, 'markov_head_type', None)!r} (rank "
                f"{getattr(draft.config, 'markov_rank', 0)}); use sampler='jax'")

    def _check_tree(self, target: Any, draft: Any) -> None:
        model_type, gamma = draft.config.model_type, int(draft.config.num_drafts)
        if not adapter_for(model_type).drafts_trees:
            raise ValueError(f"tree_budget: a {model_type} drafter drafts one chain (a tree "
                             "would cost a drafter pass per level and branch); use a DSpark "
                             "or DFlash drafter, or tree_budget=0")
        if self.tree_budget < gamma:
            raise ValueError(f"tree_budget {self.tree_budget} is below the drafter's block "
                             f"of {gamma} drafts (the tree holds its chain)")
        if not family_of(target.config).defers_writes:
            raise ValueError(f"tree_budget: a {target.config.family} target cannot verify "
                             "a tree (its ragged forward takes no tree mask)")

    def confidence_temperatures_for(self, draft: Any, gamma: int) -> list[float] | None:
        """The calibration temperatures [γ] (these settings', else the drafter's), checked."""
        temps = self.confidence_temperatures
        if temps is None and draft is not None:
            temps = getattr(draft, "confidence_temperatures", None)
        if temps is None:
            return None
        temps = [float(t) for t in temps]
        if len(temps) != gamma or min(temps) <= 0:
            raise ValueError(f"confidence_temperatures must be {gamma} positive floats (one "
                             f"per draft slot), got {temps}")
        return temps


def with_fields(settings: EngineSettings | None, fields: Mapping[str, Any], *, caller: str,
                default: Callable[[], EngineSettings] = EngineSettings,
                spelled: str = "EngineSettings") -> EngineSettings:
    """`settings` (None: `default()`) with `fields` replaced: the deprecated keyword form of
    `caller` (`Engine`, `speculative_generate`), whose users pass `EngineSettings` fields as
    keywords. Raises TypeError for `settings` that are no `EngineSettings` and naming every
    keyword that is not a field; otherwise warns with a `DeprecationWarning` naming the call to
    write instead (`spelled`: how the replacement's constructor is written, e.g.
    "generation_settings"). No `fields`: `settings` unchanged."""
    if settings is not None and not isinstance(settings, EngineSettings):
        raise TypeError(f"{caller}(settings=...) takes an EngineSettings, got "
                        f"{type(settings).__name__}")
    if not fields:
        return settings if settings is not None else default()
    known = {f.name for f in dataclasses.fields(EngineSettings)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) "
                        f"{', '.join(map(repr, unknown))}: neither a parameter of {caller}() "
                        "nor an EngineSettings field")
    shown = ", ".join(f"{k}={_short_repr(v)}" for k, v in fields.items())
    call = (f"{spelled}({shown})" if settings is None
            else f"dataclasses.replace(settings, {shown})")
    warnings.warn(f"{caller}() with settings fields as keywords ({', '.join(fields)}) is "
                  f"deprecated: pass settings={call}", DeprecationWarning, stacklevel=3)
    return dataclasses.replace(settings if settings is not None else default(), **fields)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else "..."
