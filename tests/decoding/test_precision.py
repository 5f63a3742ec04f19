"""The matmul precision policy follows the dtype each model's dots compute in
(`decoding.precision`): every decoding program the engine compiles — prefill, the plain steps,
drafting, the chain round and the tree round, and `autoregressive_generate`'s programs — is
lowered under the backend's default precision, and every fp32 `dot_general` in its StableHLO
must carry HIGHEST and every bf16 one the default. The models are tiny; what is checked is the
lowered text, so this runs on a CPU."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from dspark_jax.decoding import autoregressive as AR
from dspark_jax.decoding import autoregressive_generate
from dspark_jax.decoding import plain_steps as PS
from dspark_jax.decoding import speculative_round as SR
from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import Engine, Request, run_loop, speculative_generate
from hf_tiny import save_tiny_hf

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
DRAFT = dict(block_size=4, num_draft_layers=1, target_layer_ids=(0, 1), mask_token_id=96,
             markov_rank=8)
# `dot_general` ops: their operand types and their precision attribute (none: the default)
_DOT = re.compile(r"stablehlo\.dot_general.*?(?:precision\s*=\s*\[([^\]]*)\])?\s*:\s*"
                  r"\(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("prec"), "qwen3", head_dim=16, layers=3,
                        seed=1)


def _jitted(module) -> dict[str, object]:
    return {name: fn for name, fn in vars(module).items()
            if callable(getattr(fn, "lower", None)) and not name.startswith("_")}


@pytest.fixture
def lowered(monkeypatch):
    """Every call of a jitted decoding program (speculative_round, plain_steps,
    autoregressive; the serving loop's imports of the plain steps) is also lowered;
    → {program name: [StableHLO texts]}."""
    texts: dict[str, list[str]] = {}
    plain = {n: getattr(PS, n) for n in ("plain_prefill", "plain_steps")}
    for module, fns in ((SR, _jitted(SR)), (PS, _jitted(PS)), (AR, _jitted(AR)),
                        (run_loop, plain)):
        for name, fn in fns.items():
            def recording(*args, _fn=fn, _name=name, **kwargs):
                texts.setdefault(_name, []).append(_fn.lower(*args, **kwargs).as_text())
                return _fn(*args, **kwargs)

            monkeypatch.setattr(module, name, recording)
    return texts


def _dots(text: str) -> list[tuple[str, str]]:
    """(operand dtype, precision) of every dot_general; the operands must agree."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        m = _DOT.search(line)
        assert m, line
        precision, lhs, rhs = m.group(1) or "", m.group(2), m.group(3)
        out.append((lhs if lhs == rhs else f"{lhs}x{rhs}", precision))
    return out


def _check(texts: dict[str, list[str]], want: set[str], expect: dict[str, str]) -> None:
    """Each program in `want` was lowered; every dot computing in dtype d is at `expect[d]`."""
    assert want <= set(texts), sorted(texts)
    seen = set()
    for name, programs in texts.items():
        for text in programs:
            for dtype, precision in _dots(text):
                seen.add(dtype)
                got = "highest" if "HIGHEST" in precision else "default"
                assert dtype in expect, (name, dtype, precision)
                assert got == expect[dtype], (name, dtype, precision)
    assert seen == set(expect), seen


def _run_everything(target, draft) -> None:
    """Prefill, plain steps, drafting, chain and tree rounds, adaptive anchor rounds, and the
    autoregressive baseline."""
    autoregressive_generate(target, PROMPTS, max_new_tokens=4, stop_token_ids=[])
    speculative_generate(target, draft, PROMPTS, max_new_tokens=6, stop_token_ids=[])
    speculative_generate(target, draft, PROMPTS, max_new_tokens=6, stop_token_ids=[],
                         tree_budget=4, tree_branching=2)
    plain = Engine(target, None, scheduler="none", max_len=64, stop_token_ids=[])
    plain.serve([Request(np.asarray(p, np.int32), np.zeros(2, np.uint32)) for p in PROMPTS],
                max_new_tokens=4)


WANT = {"ar_prefill_rows", "ar_decode", "prefill_prompts", "speculative_rounds",
        "plain_prefill", "plain_steps"}


@pytest.mark.parametrize("dtype,param_dtype", [("float32", "float32"),
                                               ("float32", "bfloat16")])
def test_fp32_compute_runs_every_dot_at_highest(path, lowered, dtype, param_dtype):
    """fp32 compute, weights stored in fp32 or in bf16 (cast to fp32 before every dot): every
    dot of every program at HIGHEST, although the backend default is in force."""
    target = load_target(path, dtype=dtype, param_dtype=param_dtype, with_tokenizer=False)
    draft = init_draft(target, DRAFT, seed=3, dtype=dtype, param_dtype=param_dtype)
    with jax.default_matmul_precision("default"):   # conftest sets "highest" for every test
        _run_everything(target, draft)
    _check(lowered, WANT, {"f32": "highest"})


def test_each_model_takes_its_own_compute_dtype(path, lowered):
    """An fp32 drafter beside a bf16 target: the drafter's dots (and the fp32 arithmetic
    around the models) at HIGHEST, the target's bf16 dots at the default."""
    target = load_target(path, dtype="bfloat16", with_tokenizer=False)
    draft = init_draft(target, DRAFT, seed=3, dtype="float32", param_dtype="float32")
    with jax.default_matmul_precision("default"):
        speculative_generate(target, draft, PROMPTS, max_new_tokens=6, stop_token_ids=[])
    _check(lowered, {"prefill_prompts", "speculative_rounds"},
           {"f32": "highest", "bf16": "default"})
