"""Ahead-of-time compilation for a TPU topology on CPU (python -m dspark_jax.aot): the
training step, the serving round, and the CLI's errors and verdict."""

import json

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.aot import cli, memory, topology
from dspark_jax.jaxpr_flops import matmul_flops
from hf_tiny import save_tiny_hf

KEYS = ("topology", "num_chips", "hbm_bytes_per_chip", "peak_bytes_per_chip", "fits",
        "flops_per_step")


def test_flops_count_loop_trips_and_gradients():
    def f(x, w):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w @ w.T), None), x, None, length=5)
        return y.sum()

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    fwd = 5 * 2 * (2 * 8 * 16 * 32)                       # 5 trips × 2 matmuls of 2·M·N·K
    assert matmul_flops(f, x, w) == fwd
    # backward: one matmul per forward matmul for d/dx, one more for d/dw
    assert matmul_flops(jax.grad(f), x, w) == 2 * fwd
    assert matmul_flops(jax.grad(f, argnums=(0, 1)), x, w) == 3 * fwd
    # remat recompute is counted where it runs
    assert matmul_flops(jax.grad(jax.checkpoint(f), argnums=(0, 1)), x, w) == 4 * fwd


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu for TPU topologies on CPU: "
                    "pip install -e '.[tpu]'")
def test_tiny_config_compiles_for_v5e_2x2(tmp_path, capsys):
    target = save_tiny_hf(tmp_path / "target", "qwen3", head_dim=16, layers=2)
    out = tmp_path / "aot.json"
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--topology", "v5e:2x2",
                   "--json", str(out), f"--config.target={target}",
                   "--config.data.max_length=64", "--config.draft.num_draft_layers=1"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(KEYS) <= set(r)
    assert r["topology"] == "v5e:2x2" and r["num_chips"] == 4 and r["chip"] == "v5e"
    assert r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}          # the v5e:2x2 preset
    assert r["hbm_bytes_per_chip"] == 16 * topology.GiB and r["fits"] is True
    for k in ("argument_bytes_per_chip", "temp_bytes_per_chip", "peak_bytes_per_chip",
              "flops_per_step", "model_flops_per_step", "step_time_lower_bound_s"):
        assert r[k] > 0, k
    assert r["model_flops_per_step"] <= r["flops_per_step"]
    assert 0 < r["mfu_ceiling"] <= 1
    assert "fits" in capsys.readouterr().out


def test_shortfall_is_reported():
    code, msg = memory.verdict({"peak_bytes_per_chip": 20 * topology.GiB,
                             "hbm_bytes_per_chip": 16 * topology.GiB})
    assert code == 1 and "short by 4.00 GiB" in msg
    assert memory.verdict({"peak_bytes_per_chip": 1, "hbm_bytes_per_chip": 2})[0] == 0


def test_without_libtpu_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "has_libtpu", lambda: False)
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--topology", "v5e:2x2"])
    assert rc == 2
    assert "pip install -e '.[tpu]'" in capsys.readouterr().err


@pytest.mark.tpu
def test_unknown_topology_and_target_are_clear_errors(capsys):
    if not topology.has_libtpu():
        pytest.skip("needs libtpu")
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--topology", "v9x:1x1"])
    assert rc == 2 and "v9x:1x1" in capsys.readouterr().err
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--topology", "v5e:2x2",
                   "--config.target=nowhere"])
    assert rc == 2 and "config.target 'nowhere'" in capsys.readouterr().err


def test_compile_time_oom_becomes_a_shortfall():
    msg = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
           "memory required for HLO temporaries (47.84G) exceeds available HBM (31.24G).")
    mem = memory._compile_time_oom(msg)
    assert mem["temp"] == int(47.84 * topology.GiB) and "CompileTimeHbmOom" in mem["error"]
    assert memory._compile_time_oom("INVALID_ARGUMENT: something else") is None


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu for TPU topologies on CPU: "
                    "pip install -e '.[tpu]'")
def test_decode_round_compiles_for_v5e_2x2(tmp_path, capsys):
    """--decode: the draft step, the ragged verification step and the fused round call the
    engine runs (`speculative_rounds`) of the tiny DSpark config for 4 request slots × 64
    tokens at the top capacity bucket R·(γ+1), on the serving mesh."""
    target = save_tiny_hf(tmp_path / "target", "qwen3", head_dim=16, layers=2)
    hf = json.loads((target / "config.json").read_text())
    out = tmp_path / "decode.json"
    rc = cli.main(["aot", "--decode", "--config", "configs/tiny.py", "--topology", "v5e:2x2",
                   "--requests", "4", "--max-len", "64", "--json", str(out),
                   f"--config.target={target}"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(KEYS) <= set(r) and r["mode"] == "decode" and r["fits"] is True
    gamma = r["gamma"]
    assert gamma == 4 and r["capacity"] == 4 * (gamma + 1) and r["scheduler"] == "adaptive"
    # tensor parallel over the 2 KV heads, fsdp over the other 2 chips
    assert r["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    d, v = r["draft_step"], r["verify_step"]
    for p in (d, v, r["round_call"]):
        assert 0 < p["argument_bytes_per_chip"] <= p["peak_bytes_per_chip"] <= r[
            "peak_bytes_per_chip"]
        assert p["compile_error"] == ""
    # the verification step runs at least the target's forward over the K tokens: every
    # layer's weights and the LM head once per token, attention over the 64-token cache
    K, S, D, F = r["capacity"], 64, hf["hidden_size"], hf["intermediate_size"]
    N, Kh, H, L = (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
                   hf["num_hidden_layers"])
    weights = L * (2 * D * N * H + 2 * D * Kh * H + 3 * D * F) + D * hf["vocab_size"]
    target_flops = 2 * K * weights + L * 4 * K * S * N * H
    assert target_flops <= v["flops_per_step"] <= 1.5 * target_flops
    assert 0 < d["flops_per_step"] < v["flops_per_step"]
    assert r["flops_per_step"] == d["flops_per_step"] + v["flops_per_step"]
    assert r["step_time_lower_bound_s"] == pytest.approx(
        d["step_time_lower_bound_s"] + v["step_time_lower_bound_s"])
    printed = capsys.readouterr().out
    assert "verify_step" in printed and "round_call" in printed
    # a capacity below one anchor per slot is a usage error naming the flag
    rc = cli.main(["aot", "--decode", "--config", "configs/tiny.py", "--topology", "v5e:2x2",
                   "--requests", "4", "--capacity", "3", f"--config.target={target}"])
    assert rc == 2 and "--capacity 3" in capsys.readouterr().err


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu for TPU topologies on CPU: "
                    "pip install -e '.[tpu]'")
def test_v5e_plain_step_and_round_read_the_weights_where_they_lie(tmp_path):
    """`--chip v5e --decode`: the engine's plain step and round compiled for one TPU v5e chip
    copy no weight in HBM (weights XLA prefetches into VMEM cost their one HBM read), and the
    report names the programs' traffic against their floor."""
    target = save_tiny_hf(tmp_path / "target", "qwen3")
    out = tmp_path / "v5e.json"
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--chip", "v5e", "--decode",
                   "--programs", "plain_step,round", "--max-len", "200", "--json", str(out),
                   f"--config.target={target}", "--config.train.target_dtype=bfloat16"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["chip"] == "v5e" and r["max_len"] == 256   # the engine's cache: 128-aligned
    assert set(r["programs"]) == {"plain_step", "round"}
    for name, p in r["programs"].items():
        assert p["weight_copy_bytes"] == 0, (name, p["weight_copies"])
        assert p["weights_bytes"] > 0 and p["cache_bytes"] > 0 and p["kernels_per_step"] > 0
        assert p["bytes_accessed"] >= p["floor_bytes"] * 0.5, name


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu for TPU topologies on CPU: "
                    "pip install -e '.[tpu]'")
def test_v5e_tree_round_compiles(tmp_path):
    """`--decode --tree-budget N`: the round that drafts and verifies trees compiles for one
    TPU v5e chip and copies no weight matrix; the chain's separate verification step is not
    compiled."""
    target = save_tiny_hf(tmp_path / "target", "qwen3")
    out = tmp_path / "tree.json"
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--chip", "v5e", "--decode",
                   "--programs", "draft,verify,round", "--max-len", "200", "--tree-budget",
                   "8", "--json", str(out), f"--config.target={target}",
                   "--config.train.target_dtype=bfloat16"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["tree_budget"] == 8 and r["capacity"] == 9 and r["scheduler"] == "fixed"
    assert set(r["programs"]) == {"draft", "round"}
    for name, p in r["programs"].items():   # no weight matrix copied (a scalar bias may be)
        assert p["weight_copy_bytes"] < 64, (name, p["weight_copies"])
        assert p["weights_bytes"] > 0 and p["kernels_per_step"] > 0


def test_optimized_text_falls_back_to_the_compilers_dump(monkeypatch):
    """Where `compiled.as_text()` cannot read the program's HLO proto back (a RET_CHECK in
    libtpu), `compile_with_text` compiles again with XLA's text dump and reads the program's
    module: the same traffic as the normal path (compiled here for the CPU); any other error
    is raised."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.aot.hlo_traffic import Program, compile_with_text

    lowered = jax.jit(lambda w, x: jnp.tanh(x @ w).sum()).lower(
        jnp.zeros((64, 32)), jnp.zeros((8, 64)))
    _, text = compile_with_text(lowered)
    want = Program(text, lambda name: None).summary()["bytes_accessed"]

    def ret_check(self):
        raise jax.errors.JaxRuntimeError("INTERNAL: RET_CHECK failure: async-update arity")

    monkeypatch.setattr(jax.stages.Compiled, "as_text", ret_check)
    _, dumped = compile_with_text(lowered)
    assert "jit__lambda" in dumped.splitlines()[0]
    assert Program(dumped, lambda name: None).summary()["bytes_accessed"] == want

    def other(self):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(jax.stages.Compiled, "as_text", other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        compile_with_text(lowered)
