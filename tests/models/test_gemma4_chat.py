"""Gemma4 data conventions as DeepSpec uses them, on a tiny character tokenizer with Gemma4's
special tokens at their real ids: the end-of-turn marker `<turn|>` (and generation_config.json's
eos ids) stop generation; a generation prompt carries the empty thought channel, so it is exactly
the training render of the conversation up to where the reply's loss starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark_jax.data import chat as C
from dspark_jax.models.tokenizer import load_tokenizer
from hf_tiny import (GEMMA4_GENERATION_EOS, GEMMA4_SPECIAL_IDS, build_tiny_gemma4,
                     save_tiny_gemma4_tokenizer)

TURN_END = GEMMA4_SPECIAL_IDS["<turn|>"]
THOUGHT = "<|channel>thought\n<channel|>"   # DeepSpec's gemma4 `assistant_loss_prefix`


@pytest.fixture(scope="module", params=[True, False], ids=["preseeding", "plain"])
def tok(request, tmp_path_factory):
    """Both kinds of Gemma4 template: one whose generation prompt pre-seeds the empty thought
    channel (31B/26B), one that stops at `<|turn>model\\n` (E2B)."""
    return load_tokenizer(save_tiny_gemma4_tokenizer(
        tmp_path_factory.mktemp("g4tok"), preseed_thought_channel=request.param))


def test_gemma4_stop_ids_are_eos_end_of_turn_and_generation_config(tmp_path):
    with_gc = load_tokenizer(save_tiny_gemma4_tokenizer(tmp_path / "a"))
    assert with_gc.eos_token_id == GEMMA4_SPECIAL_IDS["<eos>"]
    assert with_gc.stop_token_ids == tuple(GEMMA4_GENERATION_EOS)      # (1, 106, 50)
    bare = load_tokenizer(save_tiny_gemma4_tokenizer(tmp_path / "b", generation_eos=None))
    assert bare.stop_token_ids == (1, TURN_END)      # <turn|> even without generation_config
    (tmp_path / "b" / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match=r"generation_config.json: field 'eos_token_id'"):
        load_tokenizer(tmp_path / "b")


def _deepspec_text(turns: list[tuple[str, str]], generation_prompt: bool) -> str:
    """DeepSpec's gemma4 rendering written out by hand: bos, `<|turn>role\\n…<turn|>\\n`, every
    assistant content behind the empty thought channel (`GeneralParser`), no system prompt."""
    out = "<bos>"
    for role, content in turns:
        if role == "assistant":
            out += "<|turn>model\n" + THOUGHT + content + "<turn|>\n"
        else:
            out += f"<|turn>{role}\n{content}<turn|>\n"
    return out + ("<|turn>model\n" + THOUGHT if generation_prompt else "")


def _text(tok, ids) -> str:
    return tok.decode(np.asarray(ids).tolist())


def test_gemma4_generation_prompt_carries_the_empty_thought_channel(tok):
    one = [{"role": "user", "content": "What is two plus two?"}]
    assert _text(tok, C.render_prompt(one, tok)) == _deepspec_text([("user", one[0]["content"])],
                                                                  True)
    # with thinking on, the model opens its own channel: the prompt ends at the turn header
    assert _text(tok, C.render_prompt(one, tok, enable_thinking=True)).endswith(
        "<|turn>model\n")
    conv = [("user", "What is two plus two?"), ("assistant", "Four, as everyone knows."),
            ("user", "And three plus three, please?"), ("assistant", "Six, which is easy too.")]
    msgs = [{"role": r, "content": c} for r, c in conv]
    # earlier assistant turns in a prompt are rendered as training renders them
    assert _text(tok, C.render_prompt(msgs[:3], tok)) == _deepspec_text(conv[:3], True)
    sample = C.render_for_training(msgs, tok, 512, min_loss_tokens=1)
    assert _text(tok, sample["input_ids"]) == _deepspec_text(conv, False)
    for k in (1, 3):   # the prompt for reply k is the training ids up to that reply's loss
        prompt = C.render_prompt(msgs[:k], tok)
        P = len(prompt)
        np.testing.assert_array_equal(sample["input_ids"][:P], prompt)
        runs = np.flatnonzero(np.diff(np.concatenate([[0], sample["loss_mask"]])) == 1)
        assert P in runs.tolist()
        m = sample["loss_mask"][P:]
        run = len(m) if m.all() else int(m.argmin())
        assert _text(tok, sample["input_ids"][P:P + run]) == conv[k][1] + "<turn|>\n"


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny Gemma4 (vocab 128, untied head) with the Gemma4 tokenizer, whose `<turn|>` row of
    the LM head is raised so greedy decoding ends a turn after a few tokens; the reference
    continuation is transformers' greedy argmax loop on the same weights."""
    path = tmp_path_factory.mktemp("g4chat")
    save_tiny_gemma4_tokenizer(path)
    tok = load_tokenizer(path)
    prompt = C.render_prompt([{"role": "user", "content": "Hi, who are you?"}], tok).tolist()
    model = build_tiny_gemma4("untied_plain", seed=4, vocab=128)

    def greedy(n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    first = greedy(4)
    k = next(i for i in (3, 2, 1) if first[i] not in first[:i])
    with torch.no_grad():     # <turn|> just outscores the token greedy picks at step k
        model.lm_head.weight[TURN_END] = 1.001 * model.lm_head.weight[first[k]]
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id":
                                                             GEMMA4_GENERATION_EOS}))
    return path, tok, prompt, greedy(8)


@pytest.mark.slow   # a torch greedy loop, a load and a decode compile
def test_gemma4_chat_stops_at_end_of_turn(chat_target, capsys):
    """`python -m dspark_jax.generate` on a Gemma4 target stops at `<turn|>` by default and
    prints transformers' greedy reply up to it."""
    from dspark_jax import generate

    path, tok, prompt, free = chat_target
    stop = free.index(TURN_END)
    assert 0 < stop < 7 and not {1, 50} & set(free[:stop])   # the test's premise
    replies = generate.main(["--target", str(path), "--prompt", "Hi, who are you?",
                             "--max-new-tokens", "8", "--no-progress"])
    assert replies == [tok.decode(free[:stop]).strip()]
    assert "[%d tokens" % (stop + 1) in capsys.readouterr().err   # stopped at <turn|>
