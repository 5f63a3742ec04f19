"""`python -m dspark_jax.calibrate` (SPEC §7): STS fitted on one prompt split of real speculative
rounds and reported on the other, the drafter-side file, and `load_draft` picking it up.

Reuses the tiny target/drafter of test_evaluate (`tiny_models`: random 3-layer target with the
SmolLM2 tokenizer, random 1-layer DSpark with a confidence head, γ = 4; no evaluation run).
The command runs once (`done`, one batch of all 12 prompts: one compilation of the decoding
loop); the tests read its files and its printed table. At T = 1 both are close to
uniform, so most drafts are accepted; the copy calibrated here gets a confidence head that is
deliberately under-confident (bias +1 on logits within ±0.05 of 0: σ ≈ 0.73 per slot), which
STS must fix on the held-out split. The shared drafter directory stays uncalibrated.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest

from dspark_jax.calibrate import main, split_by_prompt
from dspark_jax.eval.calibration import (CALIBRATION_FILE, CALIBRATION_FORMAT,
                                         CalibrationFileError, calibration_report,
                                         load_temperatures, prefix_labels,
                                         sequential_temperature_scaling,
                                         verified_mask)
from dspark_jax.models import Draft, load_draft

from tests.eval.test_evaluate import tiny_models

PROMPTS = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to three.", "Why is grass green?",
           "Tell me a joke.", "What is the capital of France?", "Spell 'cat'.", "Add 3 and 4.",
           "Name a fruit.", "Is ice cold?", "Say bye."]
GAMMA = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    env = tiny_models(tmp_path_factory)
    base = tmp_path_factory.mktemp("calibrate")
    draft_dir = base / "draft"
    model = env["draft"].model
    model.confidence.b.set_value(model.confidence.b.get_value() + 1.0)
    Draft.from_model(model).save(draft_dir)
    data = base / "data"
    data.mkdir()
    (data / "held.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in PROMPTS))
    out = base / "out"
    argv = ["--target", str(env["target_dir"]), "--draft", str(draft_dir), "--data-dir",
            str(data), "--max-new-tokens", "24", "--batch-size", "12", "--seed", "3",
            "--out-dir", str(out)]
    return dict(env=env, draft_dir=draft_dir, data=data, out=out, argv=argv)


@pytest.fixture(scope="module")
def done(run):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(run["argv"]) == 0
    return dict(run, stdout=stdout.getvalue())


def test_writes_the_drafter_file_and_the_report(done, capsys):
    doc = json.loads((done["draft_dir"] / CALIBRATION_FILE).read_text())
    assert doc["format"] == CALIBRATION_FORMAT and doc["gamma"] == GAMMA
    temps = doc["temperatures"]
    assert len(temps) == GAMMA and all(t > 0 for t in temps)
    assert set(doc) >= {"before", "after", "num_rounds", "data"}
    assert not list(done["draft_dir"].glob("*.tmp*"))  # the atomic write left nothing behind
    full = json.loads((done["out"] / "calibration.json").read_text())
    assert full["temperatures"] == temps and full["after"] == doc["after"]
    assert (done["out"] / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_numbers_follow_from_the_saved_rounds(done):
    """Re-fit and re-score from rounds.npz: the split is disjoint, STS is fitted on the fit part
    only, and before/after are the report part at T = 1 / at the temperatures."""
    doc = json.loads((done["draft_dir"] / CALIBRATION_FILE).read_text())
    z = np.load(done["out"] / "rounds.npz")
    logits, prop, acc, prompt, split = (z[k] for k in ("logits", "proposed", "accepted",
                                                       "prompt", "split"))
    assert logits.shape[1] == GAMMA and logits.shape[0] == doc["num_rounds"]["total"]
    assert np.all(np.isfinite(logits)) and np.any(logits != 0)
    assert np.all((acc >= 0) & (acc <= prop) & (prop <= GAMMA))
    assert set(prompt[split == 0]).isdisjoint(prompt[split == 1])
    assert doc["data"]["num_prompts"] == len(PROMPTS) and set(prompt) <= set(range(len(PROMPTS)))
    # both labels occur (prefix survival falls with the slot), so there is something to fit
    labels = prefix_labels(acc, GAMMA)[verified_mask(prop, GAMMA)]
    assert 0 < labels.mean() < 1
    fit, rep = split == 0, split == 1
    assert doc["num_rounds"]["fit"] == fit.sum() and doc["num_rounds"]["report"] == rep.sum()
    temps = sequential_temperature_scaling(logits[fit], acc[fit],
                                           mask=verified_mask(prop[fit], GAMMA))
    np.testing.assert_allclose(doc["temperatures"], temps)
    for key, t in (("before", None), ("after", temps)):
        want = calibration_report(logits[rep], acc[rep], mask=verified_mask(prop[rep], GAMMA),
                                  temperatures=t)
        got = doc[key]
        np.testing.assert_allclose([s["ece"] for s in got["slots"]], want.ece, atol=1e-12)
        assert [s["n"] for s in got["slots"]] == [s.n for s in want.slots]
    full = json.loads((done["out"] / "calibration.json").read_text())
    # STS minimises slot 0's ECE on the fit rounds over a grid containing T = 1
    assert full["fit_after"]["slots"][0]["ece"] <= full["fit_before"]["slots"][0]["ece"] + 1e-12
    # and the under-confident head is much better calibrated on the held-out prompts
    assert doc["after"]["mean_ece"] < 0.5 * doc["before"]["mean_ece"]
    assert doc["temperatures"][0] < 1.0  # sharpened: slot 0 was under-confident


def test_prints_the_per_slot_table(done):
    text = done["stdout"]
    assert "ECE before" in text and "AUROC after" in text
    assert sum(line.split()[0] in {"1", "2", "3", "4"} for line in text.splitlines()
               if line.strip()) == GAMMA


def test_load_draft_attaches_the_temperatures(done):
    target = done["env"]["target"]
    d = load_draft(done["draft_dir"], target=target)
    assert d.confidence_temperatures == load_temperatures(done["draft_dir"], GAMMA)
    assert len(d.confidence_temperatures) == GAMMA
    assert load_draft(done["env"]["draft_dir"], target=target).confidence_temperatures is None


def test_bad_calibration_file_is_named(done, tmp_path):
    target = done["env"]["target"]
    bad = tmp_path / "draft"
    shutil.copytree(done["draft_dir"], bad)
    doc = json.loads((bad / CALIBRATION_FILE).read_text())
    cases = [
        (dict(doc, temperatures=doc["temperatures"][:-1], gamma=GAMMA - 1), "γ = 4"),
        (dict(doc, temperatures=[1.0, -1.0, 1.0, 1.0]), "temperatures\\[1\\]"),
        (dict(doc, format="other"), "'format'"),
        (dict(doc, gamma=7), "'gamma'"),
    ]
    for payload, match in cases:
        (bad / CALIBRATION_FILE).write_text(json.dumps(payload))
        with pytest.raises(CalibrationFileError, match=match) as e:
            load_draft(bad, target=target)
        assert CALIBRATION_FILE in str(e.value)
    (bad / CALIBRATION_FILE).write_text("{not json")
    with pytest.raises(CalibrationFileError, match="JSON"):
        load_draft(bad, target=target)


def test_bad_input(run, tmp_path, capsys):
    argv = list(run["argv"])
    i = argv.index("--data-dir")
    one = tmp_path / "one"
    one.mkdir()
    (one / "x.jsonl").write_text(json.dumps({"turns": ["hi"]}) + "\n")
    assert main(argv[:i + 1] + [str(one)] + argv[i + 2:]) == 2
    assert "at least 2 prompts" in capsys.readouterr().err
    assert main(argv + ["--fit-fraction", "1.5"]) == 2
    assert "fit_fraction" in capsys.readouterr().err
    assert main(argv + ["--datasets", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fit_fraction"):
        split_by_prompt(4, 1.0, 0)
    fit, rep = split_by_prompt(5, 0.5, 0)
    assert len(fit) + len(rep) == 5 and not set(fit) & set(rep)


def test_drafter_without_confidence_head_is_refused(run):
    import dataclasses

    from dspark_jax.calibrate import collect_rounds

    d = run["env"]["draft"]
    no_head = dataclasses.replace(d, config=d.config.replace(enable_confidence_head=False))
    with pytest.raises(ValueError, match="no confidence head"):
        collect_rounds(run["env"]["target"], no_head, run["data"])


def test_rounds_follow_the_decoding_order_and_seed_rule(run, monkeypatch):
    """collect_rounds decodes all datasets' prompts together, shortest first; batch k samples
    with seed (seed·1000003 + k·batch_size) mod 2³¹ and the rows come in decoding order."""
    import dspark_jax.serving.generation as spec_mod
    from dspark_jax.calibrate import collect_rounds

    seeds, lens = [], []

    def fake_generate(target, draft, prompts, *, seed, **kw):
        seeds.append(seed)
        lens.extend(len(p) for p in prompts)
        n = len(prompts)
        return spec_mod.SpecResult(
            tokens=[[5]] * n, proposed=[[GAMMA, GAMMA]] * n, accepted=[[1, 2]] * n, rounds=2,
            confidence=[np.full((2, GAMMA), len(p), np.float32) for p in prompts])

    monkeypatch.setattr(spec_mod, "speculative_generate", fake_generate)
    r = collect_rounds(run["env"]["target"], run["env"]["draft"], run["data"], batch_size=5,
                       seed=3, max_new_tokens=8)
    assert seeds == [(3 * 1_000_003 + b) % 2 ** 31 for b in (0, 5, 10)]
    assert lens == sorted(lens) and len(lens) == len(PROMPTS)
    assert r.prompt_ids == tuple(f"held-{i}" for i in range(len(PROMPTS)))
    np.testing.assert_array_equal(r.logits[::2, 0], lens)  # two rounds a prompt, shortest first
    assert sorted(set(r.prompt.tolist())) == list(range(len(PROMPTS)))
    assert r.proposed.tolist() == [GAMMA] * 2 * len(PROMPTS)
