"""Drafters that travel: Qwen3 draft layers for every non-Gemma target, the draft
vocabulary carried by the speculators format (DSpark / DFlash) or EAGLE-3's layout (Eagle3) and
refused by DeepSpec's DSpark format, legacy Llama-layer exports loading as what they are,
and `python -m dspark_jax.export`."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest

from dspark_jax import export as export_cli
from dspark_jax.models import init_draft, load_draft, load_target
from dspark_jax.models.io.deepspec import ExportError, LegacyDrafterWarning
from dspark_jax.models.io.hf import read_safetensors_dir, write_safetensors
from dspark_jax.models.io.errors import CheckpointError
from hf_tiny import save_tiny_hf

BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96,
            markov_rank=8)
VOCAB = tuple(range(0, 96, 2))
PRUNED = dict(BASE, draft_vocab_size=len(VOCAB), draft_vocab=VOCAB)
PREV = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "llama", head_dim=16,
                                    layers=4))


@pytest.fixture(scope="module")
def feats(target):
    return target.hidden_states(np.arange(3, 15)[None], [0, 1])[0]


def _same_block(a, b, feats):
    x, y = a.block_logits(feats, 7, prev_tokens=PREV), b.block_logits(feats, 7, prev_tokens=PREV)
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_llama_target_gets_qwen3_layers(target, tmp_path):
    draft = init_draft(target, BASE, seed=1)
    assert draft.config.layer_family == "qwen3" and draft.config.layer_config().qk_norm
    draft.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["head_dim"] == 16
    names = set(read_safetensors_dir(tmp_path / "d"))
    assert {"layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"} <= names


def test_legacy_llama_layer_export_loads_as_it_was(target, feats, tmp_path):
    """A legacy Llama-layer export (LlamaDSparkModel, no q/k norms) loads as a
    Llama-layer drafter — no q/k normalisation — with a warning naming the file."""
    draft = init_draft(target, dict(BASE, layer_family="llama"), seed=2)
    assert not draft.config.layer_config().qk_norm
    draft.save(tmp_path / "old")
    cfg_file = tmp_path / "old" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    assert cfg["architectures"] == ["LlamaDSparkModel"]
    cfg["dspark_jax"].pop("layer_family")            # what legacy exports hold
    cfg["model_type"] = "llama"
    cfg_file.write_text(json.dumps(cfg))
    assert not any("q_norm" in k for k in read_safetensors_dir(tmp_path / "old"))
    with pytest.warns(LegacyDrafterWarning, match=str(cfg_file)):
        again = load_draft(tmp_path / "old", target=target)
    assert again.config.layer_family == "llama"
    _same_block(draft, again, feats)
    # a ones q/k norm is a different drafter: the legacy one must not be given one
    qwen = init_draft(target, BASE, seed=2)
    assert not np.allclose(qwen.block_logits(feats, 7, prev_tokens=PREV)["logits"],
                           again.block_logits(feats, 7, prev_tokens=PREV)["logits"])


def test_deepspec_format_refuses_a_draft_vocabulary(target, tmp_path):
    draft = init_draft(target, PRUNED, seed=3)
    with pytest.raises(ExportError, match="draft_vocab_size.*speculators.*full-vocab-fallback"):
        export_cli.write_export(draft, tmp_path / "ds", "deepspec")
    assert not (tmp_path / "ds").exists()
    with pytest.warns(UserWarning, match="full-vocabulary fallback"):
        export_cli.write_export(draft, tmp_path / "ds", "deepspec", full_vocab_fallback=True)
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    rec = cfg["dspark_jax"]["export"]
    assert rec["full_vocab_fallback"] and rec["trained_draft_vocab_size"] == len(VOCAB)
    assert "different tau" in rec["note"]
    back = load_draft(tmp_path / "ds", target=target)      # the drafter DeepSpec runs
    assert not back.config.pruned_vocab
    assert read_safetensors_dir(tmp_path / "ds")["lm_head.weight"].shape[0] == 97


@pytest.mark.parametrize("kw", [BASE, PRUNED,
                                dict(BASE, model_type="dflash", markov_rank=0,
                                     enable_confidence_head=False)],
                         ids=["dspark", "dspark-draft-vocab", "dflash"])
def test_speculators_round_trip_carries_the_draft_vocabulary(target, feats, tmp_path, kw):
    draft = init_draft(target, kw, seed=4)
    export_cli.write_export(draft, tmp_path / "s", "speculators", verifier="some/target")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark"
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2]          # DeepSpec's ids + 1
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "some/target"
    t = read_safetensors_dir(tmp_path / "s")
    K = len(VOCAB) if draft.config.pruned_vocab else 97
    assert cfg["draft_vocab_size"] == K and t["lm_head.weight"].shape == (K, 32)
    if draft.config.pruned_vocab:
        np.testing.assert_array_equal(np.arange(K) + t["d2t"], VOCAB)
        assert t["t2d"].dtype == bool and np.flatnonzero(t["t2d"]).tolist() == list(VOCAB)
        assert t["markov_head.markov_w2.weight"].shape == (K, 8)
        assert t["markov_head.markov_w1.weight"].shape == (97, 8)
    else:
        assert "d2t" not in t
    again = load_draft(tmp_path / "s", target=target)
    assert again.config == draft.config
    x = draft.block_logits(feats, 7, prev_tokens=PREV)
    y = again.block_logits(feats, 7, prev_tokens=PREV)
    for k in x:
        if x[k] is None:
            assert y[k] is None
            continue
        if draft.config.pruned_vocab and k != "confidence_logits":
            # ids outside the vocabulary are at -1e9 either way; the K proposable ones exact
            np.testing.assert_array_equal(x[k][..., list(VOCAB)], y[k][..., list(VOCAB)])
            assert (y[k][..., 1::2] <= -1e8).all()
        else:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("kw,field", [
    (dict(BASE, markov_head_type="gated"), "markov_head_type"),
    (dict(BASE, markov_head_type="rnn"), "markov_head_type"),
    (dict(block_size=4, target_layer_ids=(0, 1), model_type="eagle3", ttt_length=3), "model_type"),
    (dict(BASE, layer_family="llama"), "layer_family"),      # speculators' layers are Qwen3's
])
def test_speculators_refuses_what_its_consumers_cannot_run(target, tmp_path, kw, field):
    draft = init_draft(target, kw, seed=5)
    with pytest.raises(ExportError, match=f"^{field}:"):
        export_cli.write_export(draft, tmp_path / "s", "speculators")
    assert not (tmp_path / "s").exists() and not list(tmp_path.iterdir())


def test_export_cli(target, feats, tmp_path, capsys):
    draft = init_draft(target, PRUNED, seed=6)
    work = tmp_path / "work"
    draft.save(work / "export")                   # a training workdir's primary export
    out = export_cli.main([str(work), "--format", "speculators", "--out", str(tmp_path / "o"),
                           "--no-progress"])
    _same_block(load_draft(out, target=target), load_draft(work / "export", target=target),
                feats)
    # a training workdir loads its export/ (`generate --draft`, `evaluate --draft`)
    _same_block(load_draft(work, target=target), load_draft(work / "export", target=target),
                feats)
    with pytest.raises(CheckpointError, match="nothing: neither a drafter directory"):
        load_draft(tmp_path / "nothing", target=target)
    # an existing export is replaced whole; a refused one leaves the old in place
    before = (tmp_path / "o" / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as e:
        export_cli.main([str(work), "--format", "deepspec", "--out", str(tmp_path / "o"),
                         "--no-progress"])
    assert e.value.code == 2 and "draft_vocab_size" in capsys.readouterr().err
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "work"]
    for bad, msg in ([str(work), "--format", "gguf"], "--format: 'gguf'"), \
                    ([str(tmp_path / "nothing"), "--format", "deepspec"], "neither a drafter"):
        with pytest.raises(SystemExit) as e:
            export_cli.main(bad + ["--out", str(tmp_path / "x"), "--no-progress"])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_export_cli_writes_a_pruned_eagle3_in_eagle3_layout(target, tmp_path):
    """`--format deepspec` holds an Eagle3 draft vocabulary (EAGLE-3's layout, no fallback and no
    warning), while a DSpark one is still refused without --full-vocab-fallback."""
    e3 = dict(block_size=4, target_layer_ids=(0, 1), model_type="eagle3", ttt_length=3,
              draft_vocab_size=len(VOCAB), draft_vocab=VOCAB)
    draft = init_draft(target, e3, seed=8)
    draft.save(tmp_path / "src")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_cli.main([str(tmp_path / "src"), "--format", "deepspec", "--out",
                               str(tmp_path / "o"), "--no-progress"])
    assert not [w for w in caught if "fallback" in str(w.message)]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3Eagle3Model"] and cfg["draft_vocab_size"] == len(VOCAB)
    t = read_safetensors_dir(out)
    assert t["lm_head.weight"].shape == (len(VOCAB), 32)
    np.testing.assert_array_equal(np.arange(len(VOCAB)) + t["d2t"], VOCAB)
    assert load_draft(out, target=target).config == draft.config
    init_draft(target, PRUNED, seed=8).save(tmp_path / "dspark")
    with pytest.raises(SystemExit) as e:
        export_cli.main([str(tmp_path / "dspark"), "--format", "deepspec", "--out",
                         str(tmp_path / "o2"), "--no-progress"])
    assert e.value.code == 2


def test_speculators_library_loads_the_export(target, tmp_path):
    """`speculators==0.9.0` itself (vLLM's format library) loads our export with no missing or
    unexpected tensor, its config validates, and the tensors arrive unchanged."""
    pytest.importorskip("speculators", reason="speculators not installed (README test command)")
    import torch
    from speculators import SpeculatorModel, SpeculatorModelConfig

    for kw in (BASE, PRUNED):
        d = tmp_path / f"s{len(kw)}"
        init_draft(target, kw, seed=7).save(d, "speculators")
        cfg = SpeculatorModelConfig.from_pretrained(str(d), local_files_only=True)
        assert type(cfg).__name__ == "DSparkSpeculatorConfig"
        assert cfg.draft_vocab_size == (len(VOCAB) if kw is PRUNED else 97)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = SpeculatorModel.from_pretrained(str(d), local_files_only=True)
        sd = model.state_dict()
        files = read_safetensors_dir(d)
        ignorable = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
        assert not sorted(set(files) - set(sd)), "unexpected tensors"
        missing = [k for k in sd if k not in files
                   and not any(__import__("re").fullmatch(p, k) or p == k for p in ignorable)]
        assert not missing, f"missing tensors {missing}"
        for k, v in files.items():
            np.testing.assert_array_equal(sd[k].to(torch.float32).numpy()
                                          if v.dtype != bool and v.dtype != np.int64
                                          else sd[k].numpy(), v, err_msg=k)


def test_options_of_the_other_format_are_refused(target, tmp_path, capsys):
    draft = init_draft(target, BASE, seed=9)
    with pytest.raises(ExportError, match="--verifier applies to --format speculators only"):
        export_cli.write_export(draft, tmp_path / "o", "deepspec", verifier="some/target")
    with pytest.raises(ExportError, match="--full-vocab-fallback applies to --format deepspec"):
        export_cli.write_export(draft, tmp_path / "o", "speculators", full_vocab_fallback=True)
    assert not list(tmp_path.iterdir())
    draft.save(tmp_path / "src")
    for bad, msg in ((["--format", "deepspec", "--verifier", "t"], "--verifier"),
                     (["--format", "speculators", "--full-vocab-fallback"],
                      "--full-vocab-fallback")):
        with pytest.raises(SystemExit) as e:
            export_cli.main([str(tmp_path / "src"), *bad, "--out", str(tmp_path / "o"),
                             "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {msg}") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["deepspec", "speculators"])
def test_progress_follows_each_tensor_written(target, tmp_path, fmt):
    draft = init_draft(target, BASE, seed=10)
    calls = []
    out = export_cli.write_export(draft, tmp_path / "o", fmt,
                                  progress=lambda *a: calls.append(a))
    tensors = read_safetensors_dir(out)
    assert sorted(c[0] for c in calls) == sorted(tensors)        # one call per tensor
    total = (out / "model.safetensors").stat().st_size
    assert {c[2] for c in calls} == {sum(c[1] for c in calls)}   # the bytes of every tensor
    assert 0 < calls[0][2] < total                                 # (without the header)


def _dir(path, text):
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_replace_dir_swaps_in_one_step(tmp_path, monkeypatch):
    """Where the file system swaps two directories in one step, OUT is never missing: no
    rename that would leave it absent is made."""
    a, b = _dir(tmp_path / "a", "a"), _dir(tmp_path / "b", "b")
    if not export_cli.exchange_paths(a, b):
        pytest.skip("this file system cannot swap two directories in one step")
    assert (a / "f").read_text() == "b" and (b / "f").read_text() == "a"
    old, new = _dir(tmp_path / "out", "old"), _dir(tmp_path / "new", "new")

    def no_rename(*args):
        raise AssertionError("a rename that leaves OUT missing")

    monkeypatch.setattr(export_cli.os, "replace", no_rename)
    export_cli.replace_dir(new, old)
    assert (tmp_path / "out" / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]


def test_two_phase_swap_recovers_on_the_next_export(target, tmp_path, monkeypatch):
    """Without the one-step swap: a process that dies between the two renames leaves the old
    export aside; the next export puts it back before writing, then replaces it."""
    out = tmp_path / "o"
    draft = init_draft(target, BASE, seed=11)
    export_cli.write_export(draft, out, "deepspec")
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(export_cli, "exchange_paths", lambda a, b: False)
    real_replace = export_cli.os.replace

    class Killed(BaseException):
        pass

    def dies_moving_the_new_one_in(src, dst):
        if str(dst) == str(out):
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(export_cli.os, "replace", dies_moving_the_new_one_in)
    with pytest.raises(Killed):
        export_cli.write_export(init_draft(target, BASE, seed=12), out, "deepspec")
    assert not out.exists() and export_cli.aside_path(out).is_dir()
    monkeypatch.setattr(export_cli.os, "replace", real_replace)
    export_cli.recover_dir(out)                     # what the next export does first
    assert (out / "model.safetensors").read_bytes() == before
    assert not export_cli.aside_path(out).exists()
    shutil.copytree(out, export_cli.aside_path(out))    # died after the second rename
    export_cli.write_export(init_draft(target, BASE, seed=12), out, "deepspec")
    assert (out / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
