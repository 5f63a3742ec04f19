"""Helpers for the CLI / checkpoint tests: a tiny random Qwen3 target WITH a character-level
ChatML tokenizer (so the whole job — regeneration, rendering, loss masks — runs on it), and
small prompt files in both supported formats."""

from __future__ import annotations

import json
import pathlib

from hf_tiny import save_tiny_hf

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY_CONFIG = str(REPO / "configs" / "tiny.py")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 128   # the tokenizer uses ids 0..98; rows 99..127 are unused (auto mask token = 99)


def save_char_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", chat_template=CHATML,
                                 clean_up_tokenization_spaces=False)
    hf.save_pretrained(path)


def make_tiny_target(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    save_tiny_hf(path, "qwen3", seed=seed, head_dim=16, layers=4, vocab=VOCAB)
    save_char_tokenizer(path)
    return path


WORDS = ["rain", "code", "tea", "maps", "jazz", "snow", "bees", "salt", "kites", "moss", "ink",
         "owls", "fog", "gears", "clay", "dunes", "wax", "reefs", "hail", "yarn", "ferns", "lava",
         "moths", "tides"]


def write_prompt_files(d: pathlib.Path) -> list[str]:
    """One DeepSpec eval file ({"turns"}) and one training-conversation file."""
    d.mkdir(parents=True, exist_ok=True)
    evalf = d / "tiny-eval.jsonl"
    evalf.write_text("".join(json.dumps({"turns": [f"Tell me about {w}."]}) + "\n"
                             for w in WORDS[:12]))
    conv = d / "tiny-train.jsonl"
    conv.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"role": "user", "content": f"Why {w}?"},
        {"role": "assistant", "content": "old answer, replaced by regeneration"}]}) + "\n"
        for i, w in enumerate(WORDS[12:])))
    return [str(evalf), str(conv)]


def write_regenerated(path: pathlib.Path, n: int = 12, seed: int = 0) -> pathlib.Path:
    """A stand-in for a regeneration output (`{"id", "conversations"}` JSONL) for tests that are
    about training, not regeneration."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    alphabet = "abcdefghij klmnop.,"
    lines = []
    for i in range(n):
        reply = "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 40)))
        lines.append(json.dumps({"id": f"r{i}", "conversations": [
            {"role": "user", "content": f"Say something about {WORDS[i % len(WORDS)]}."},
            {"role": "assistant", "content": reply}]}) + "\n")
    path.write_text("".join(lines))
    return path


def cli_args(target: pathlib.Path, workdir: pathlib.Path, prompts: list[str], *extra: str) -> list[str]:
    return ["dspark_jax.train", f"--config={TINY_CONFIG}", f"--config.target={target}",
            f"--config.workdir={workdir}", f"--config.data.prompts=({','.join(map(repr, prompts))},)",
            *extra]
