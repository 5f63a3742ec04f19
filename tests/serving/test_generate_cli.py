"""`python -m dspark_jax.generate --draft CKPT` honours `--top-k` / `--top-p` on the speculative
path: at temperature 1, top-k 1 (or a nucleus of one token) is greedy decoding, while plain
temperature-1 sampling with the same seed is not (so a dropped flag fails the test); and
`--tree-budget` drafts trees."""

from __future__ import annotations

import re

import pytest

from dspark_jax import generate
from dspark_jax.models import init_draft, load_target
from hf_tiny import save_tiny_gemma4_tokenizer, save_tiny_hf

VOCAB = 107   # the tiny character tokenizer's ids (Gemma4 special tokens + 96 characters)
NEW = 12


@pytest.fixture(scope="module")
def cli_args(tmp_path_factory):
    """--target (a tiny Qwen3 with a chat tokenizer) and --draft (a random DSpark drafter saved in
    DeepSpec's format) plus the common flags."""
    path = tmp_path_factory.mktemp("target")
    save_tiny_hf(path, "qwen3", vocab=VOCAB, head_dim=16, layers=2, seed=1)
    save_tiny_gemma4_tokenizer(path, generation_eos=None)   # stops: the tokenizer's eos only
    target = load_target(path)
    draft_dir = tmp_path_factory.mktemp("draft")
    init_draft(target, dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1, 0),
                            mask_token_id=4, markov_rank=8), seed=3).save(draft_dir)
    return ["--target", str(path), "--draft", str(draft_dir), "--prompt", "Hi, who are you?",
            "--max-new-tokens", str(NEW), "--seed", "5", "--no-progress"]


def _reply(capsys, args):
    replies = generate.main(args)
    err = capsys.readouterr().err
    assert "τ = " in err, "not the speculative path"
    return replies[0], int(re.search(r"\[(\d+) tokens", err).group(1))


def test_speculative_cli_honours_top_k_and_top_p(cli_args, capsys):
    greedy, n = _reply(capsys, cli_args)
    assert n >= 4, "the test needs a reply of a few tokens"
    sampled, _ = _reply(capsys, cli_args + ["--temperature", "1"])
    assert sampled != greedy, "T = 1 sampling should leave greedy decoding (else no test)"
    assert _reply(capsys, cli_args + ["--temperature", "1", "--top-k", "1"]) == (greedy, n)
    assert _reply(capsys, cli_args + ["--temperature", "1", "--top-p", "0.01"]) == (greedy, n)


def test_speculative_cli_drafts_trees(cli_args, capsys):
    """--tree-budget: the greedy reply is the chain's (both lossless), and a budget below the
    drafter's block is refused by name."""
    greedy = _reply(capsys, cli_args)
    assert _reply(capsys, cli_args + ["--tree-budget", "8", "--tree-branching", "3"]) == greedy
    with pytest.raises(ValueError, match="tree_budget 2"):
        generate.main(cli_args + ["--tree-budget", "2"])


@pytest.mark.parametrize("flag,value,message", [
    ("--top-p", "1.5", r"--top-p must be in \(0, 1\]"), ("--top-k", "-3", "--top-k must be"),
    ("--temperature", "-1", "--temperature must be finite and ≥ 0"),
    ("--max-new-tokens", "0", "--max-new-tokens must be ≥ 1"),
    ("--tree-budget", "8", "--tree-budget and --tree-branching .* need --draft")])
def test_bad_sampling_flags_are_usage_errors_before_any_model_loads(flag, value, message,
                                                                     capsys):
    """A setting that would fall silently into greedy decoding or no filter, or trees without
    a drafter, is refused by its flag's name (exit 2), before the target (here a directory
    that does not exist) is read."""
    with pytest.raises(SystemExit) as exc:
        generate.main(["--target", "/nonexistent", "--prompt", "hi", flag, value])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
