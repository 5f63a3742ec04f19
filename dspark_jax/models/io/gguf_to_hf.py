"""A GGUF target written as a Hugging Face directory, for tools that read only that format
(llama.cpp's `convert_hf_to_gguf.py`, vLLM, transformers): `config.json`, `model.safetensors`
with the fp32 tensors our target loads (`gguf.read_gguf_checkpoint`, dequantized, llama.cpp's
Q/K row permutation undone) and the GGUF's tokenizer as transformers reads it (`gguf_file=`).

    from dspark_jax.models.io.gguf_to_hf import write_target_hf
    write_target_hf(pathlib.Path("target-hf"))          # the embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from dspark_jax.models.io.gguf import locate_smollm2_gguf, read_gguf_checkpoint

EMBEDDED_NAME = "smollm2-135m-instruct"


def write_target_hf(out: pathlib.Path, gguf: str | os.PathLike | None = None) -> pathlib.Path:
    """A Hugging Face LlamaForCausalLM directory at `out` of `gguf` (default: the embedded target's
    GGUF): the fp32 tensors our target loads and the GGUF's tokenizer, which llama.cpp's Llama
    `set_vocab` accepts (`pre = smollm`). Returns `out`."""
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    path = locate_smollm2_gguf() if gguf is None else pathlib.Path(gguf)
    name = EMBEDDED_NAME if gguf is None else path.stem
    config, tensors = read_gguf_checkpoint(path)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config, torch_dtype="float32",
               _name_or_path=f"{name} (fp32 from {path.name}, dspark_jax models.io.gguf)")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    return out
