"""A GGUF target written as a Hugging Face directory, for tools that read only that format
(llama.cpp's `convert_hf_to_gguf.py`, vLLM, SGLang, DeepSpec, transformers): `config.json`,
`model.safetensors` with the fp32 tensors our target loads (`gguf.read_gguf_checkpoint`,
dequantized, llama.cpp's Q/K row permutation undone) and our target's own tokenizer
(`models.tokenizer.tokenizer_from_gguf`): `tokenizer.json` is its `tokenizers` pipeline, so
SmolLM2's `Digits(individual_digits=True)` pre-tokenizer travels with it, and
`tokenizer_config.json` / `chat_template.jinja` carry its special tokens, length and chat
template. Every file is written to a temporary name and renamed into place.

    from dspark_jax.models.io.gguf_to_hf import write_target_hf
    write_target_hf(pathlib.Path("target-hf"))          # the embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from dspark_jax.models.io.gguf import locate_smollm2_gguf, read_gguf_checkpoint

EMBEDDED_NAME = "smollm2-135m-instruct"

# The tokenizer class named in tokenizer_config.json: every transformers version (4.x's
# `PreTrainedTokenizerFast`, 5.x's alias of `TokenizersBackend`) loads it straight from
# tokenizer.json, where a model-specific class (GPT2Tokenizer, ...) may rebuild the pipeline
# from the vocabulary and merges and lose the pre-tokenizer.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _write_atomic(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """`write(tmp)` to a temporary name beside `path`, then renamed to `path`; the temporary
    file is removed if writing fails."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_text_atomic(path: pathlib.Path, text: str) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def tokenizer_files(hf: Any) -> dict[str, str]:
    """The Hugging Face tokenizer files (name -> text) of a transformers fast tokenizer `hf`:
    `tokenizer.json` (its `tokenizers` pipeline as is), `tokenizer_config.json` (class
    `TOKENIZER_CLASS`, its special tokens, `model_max_length`, BOS/EOS insertion, no clean-up
    of decoded spaces, the chat template) and `chat_template.jinja` when it has a template."""
    config: dict[str, Any] = {"tokenizer_class": TOKENIZER_CLASS}
    config.update({k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)})
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(getattr(hf, key, None), bool):
            config[key] = getattr(hf, key)
    config["clean_up_tokenization_spaces"] = False
    config["model_max_length"] = int(hf.model_max_length)
    files = {"tokenizer.json": hf.backend_tokenizer.to_str(pretty=True)}
    if hf.chat_template is not None:
        config["chat_template"] = hf.chat_template
        files["chat_template.jinja"] = hf.chat_template
    files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False)
    return files


def write_target_hf(out: pathlib.Path, gguf: str | os.PathLike | None = None) -> pathlib.Path:
    """A Hugging Face LlamaForCausalLM directory at `out` of `gguf` (default: the embedded target's
    GGUF): the fp32 tensors our target loads and the tokenizer our target uses
    (`load_tokenizer` of the same GGUF, see `tokenizer_files`), so `AutoTokenizer` on `out`
    gives our target's ids and chat prompts, and llama.cpp's Llama `set_vocab` recognises the
    pre-tokenizer (`pre = smollm`). Each file is replaced atomically. Returns `out`."""
    from safetensors.numpy import save_file

    from dspark_jax.models.tokenizer import load_tokenizer

    path = locate_smollm2_gguf() if gguf is None else pathlib.Path(gguf)
    name = EMBEDDED_NAME if gguf is None else path.stem
    config, tensors = read_gguf_checkpoint(path)
    tokenizer = load_tokenizer(EMBEDDED_NAME if gguf is None else path)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config, torch_dtype="float32",
               _name_or_path=f"{name} (fp32 from {path.name}, dspark_jax models.io.gguf)")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    _write_text_atomic(out / "config.json", json.dumps(cfg, indent=2))
    arrays = {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
    _write_atomic(out / "model.safetensors",
                  lambda tmp: save_file(arrays, str(tmp), metadata={"format": "pt"}))
    files = tokenizer_files(tokenizer.hf)
    for file_name, text in files.items():
        _write_text_atomic(out / file_name, text)
    if "chat_template.jinja" not in files:  # transformers would read a stale one over the config
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out
