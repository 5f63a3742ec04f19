"""Ahead-of-time compilation for a TPU topology on CPU (python -m dspark_jax.aot): the
training step, the serving round, and the CLI's errors and verdict."""

import json

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.aot import command as cli, memory, topology
from dspark_jax.jaxpr_flops import matmul_flops
from hf_tiny import save_tiny_gemma4, save_tiny_hf

KEYS = ("topology", "num_chips", "hbm_bytes_per_chip", "peak_bytes_per_chip", "fits",
        "flops_per_step")


def _slice_decode(tmp_path, target, *flags: str) -> tuple[int, dict | None]:
    """`aot --decode` of the tiny config on v5e:2x2, 4 request slots × 64 tokens →
    (exit status, the JSON report when it succeeded)."""
    out = tmp_path / "decode.json"
    rc = cli.main(["aot", "--decode", "--config", "configs/tiny.py", "--topology", "v5e:2x2",
                   "--requests", "4", "--max-len", "64", "--json", str(out),
                   f"--config.target={target}", *flags])
    return rc, json.loads(out.read_text()) if rc == 0 else None


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


def test_flops_count_the_branch_the_platform_compiles():
    """A `lax.platform_dependent` choice counts the branch of the platform compiled for (the
    decoding kernels on a GPU, XLA's ops elsewhere); with no platform named, the costliest."""
    def f(x):
        return jax.lax.platform_dependent(x, cuda=lambda x: x @ x @ x, default=lambda x: x @ x)

    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    one = 2 * 8 * 8 * 8
    assert matmul_flops(f, x, platform="cuda") == 2 * one
    assert matmul_flops(f, x, platform="tpu") == matmul_flops(f, x, platform="cpu") == one
    assert matmul_flops(f, x) == 2 * one


def test_flops_count_kernel_grids_and_shard_map_bodies():
    """A Pallas kernel's body counts once per grid step and a shard_map body once per device:
    the flash kernel, alone or mapped over 8 devices, counts what the dense attention does."""
    from dspark_jax.models import layers as L
    from dspark_jax.sharding import make_mesh, use_mesh

    q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((8, 256, 2, 64), jnp.float32)
    dense = matmul_flops(lambda q, k, v: L.attend(q, k, v, L.causal_mask(8, 256)), q, k, k)
    assert dense == 2 * 2 * 8 * 4 * 256 * 256 * 64
    assert matmul_flops(lambda q, k, v: L.flash_attention_tpu(q, k, v), q, k, k) == dense
    mesh = make_mesh(data=2, fsdp=2, tensor=2)

    def sharded(q, k, v):
        with use_mesh(mesh):
            return L.causal_attention(q, k, v)

    assert "shard_map" in str(jax.make_jaxpr(sharded)(q, k, k))
    assert matmul_flops(sharded, q, k, k) == dense


def test_collectives_feeding_a_kernel_are_found_through_data_movement_only():
    """An all-gather that reaches a kernel's operand through a copy and a bitcast is reported;
    one whose result passes through arithmetic first (a projection) is not."""
    from dspark_jax.aot.hlo_traffic import collectives_feeding_kernels, pallas_kernels

    text = """HloModule m, entry_computation_layout={()->f32[4,8]{1,0}}

ENTRY %main (p0: f32[1,8], p1: f32[4,8]) -> f32[4,8] {
  %p0 = f32[1,8]{1,0} parameter(0)
  %p1 = f32[4,8]{1,0} parameter(1)
  %all-gather.1 = f32[4,8]{1,0} all-gather(%p0), dimensions={0}
  %copy.1 = f32[4,8]{0,1} copy(%all-gather.1)
  %bitcast.1 = f32[4,8]{1,0} bitcast(%copy.1)
  %all-gather.2 = f32[4,8]{1,0} all-gather(%p0), dimensions={0}
  %add.1 = f32[4,8]{1,0} add(%all-gather.2, %p1)
  ROOT %k = f32[4,8]{1,0} custom-call(%bitcast.1, %add.1), custom_call_target="tpu_custom_call"
}
"""
    assert [i.name for i in pallas_kernels(text)] == ["k"]
    found = collectives_feeding_kernels(text)
    assert [(f["kernel"], f["operand"]) for f in found] == [("k", "bitcast.1")]
    assert found[0]["collective"].startswith("all-gather all-gather.1")
    assert collectives_feeding_kernels(text.replace("tpu_custom_call", "cublas")) == []


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


@pytest.mark.parametrize("topo,mesh,min_kernels", [
    pytest.param("v5p:2x2x2", (2, 2, 2), 1, marks=pytest.mark.tpu),
    pytest.param("h200:4", (2, 2, 1), 4, marks=pytest.mark.gpu)])
def test_training_step_with_kernels_compiles_for_several_chips(topo, mesh, min_kernels,
                                                               tmp_path):
    """The training step with its Pallas kernels (the target's flash attention over 128-token
    rows; on GPUs also the drafter's context attention, forward and backward) compiles for a
    multi-chip slice with data parallelism and FSDP both 2 (and tensor 2 on the TPU), and
    every kernel reads its own shards: no collective feeds one."""
    from dspark_jax.aot import gpu

    if topo.startswith("v5p") and not topology.has_libtpu():
        pytest.skip("needs libtpu: pip install -e '.[tpu]'")
    if topo.startswith("h200") and not gpu.has_cuda_plugin():
        pytest.skip(f"needs the CUDA plugin: {gpu.GPU_INSTALL_HINT}")
    target = save_tiny_hf(tmp_path / "target", "qwen3", head_dim=16, layers=2)
    out = tmp_path / "aot.json"
    data, fsdp, tensor = mesh
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--topology", topo, "--no-preset",
                   "--json", str(out), f"--config.target={target}",
                   "--config.data.max_length=128", "--config.draft.num_draft_layers=1",
                   f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
                   f"--config.mesh.tensor={tensor}", "--config.mesh.num_devices=-1",
                   "--config.train.global_batch_size=8", "--config.train.micro_batches=2"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["mesh"] == {"data": data, "fsdp": fsdp, "tensor": tensor}
    assert r["num_chips"] == data * fsdp * tensor and r["fits"] is True
    assert r["pallas_kernels"] >= min_kernels
    assert r["kernel_gathers"] == []


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
    rc, r = _slice_decode(tmp_path, target)
    assert rc == 0
    assert set(KEYS) <= set(r) and r["mode"] == "decode" and r["fits"] is True
    gamma = r["gamma"]
    assert gamma == 4 and r["capacity"] == 4 * (gamma + 1) and r["scheduler"] == "adaptive"
    # tensor parallel over the 2 KV heads, fsdp over the other 2 chips
    assert r["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    # the engine's layout on a TPU, its weights resident once (within 2% of the parameters)
    assert r["layout"] == "per-layer"
    # the drafter's embedding and LM head are the target's own (held once)
    V, D = hf["vocab_size"], hf["hidden_size"]
    for p in (r["draft_step"], r["verify_step"], r["round_call"]):
        assert p["draft_shared_bytes"] == 2 * V * D * 4
        assert p["target_weights_bytes"] == pytest.approx(r["target_param_bytes"], rel=0.02)
        assert p["draft_weights_bytes"] + p["draft_shared_bytes"] == pytest.approx(
            r["draft_param_bytes"], rel=0.02)
        assert p["kv_cache_bytes"] > 0 and 0 < p["weights_bytes_per_chip"] < (
            r["target_param_bytes"] + r["draft_param_bytes"] + p["draft_vocab_rows_bytes"])
    d, v = r["draft_step"], r["verify_step"]
    # the engine's other programs on the same weights and caches: its largest join and, for
    # `adaptive`, the rounds that skip drafting
    programs = ("draft_step", "verify_step", "round_call", "anchor_call", "prefill_call")
    for p in (r[k] for k in programs):
        assert 0 < p["argument_bytes_per_chip"] <= p["peak_bytes_per_chip"] <= r[
            "peak_bytes_per_chip"]
        assert p["compile_error"] == ""
    assert max(r[k]["peak_bytes_per_chip"] for k in programs) == r["peak_bytes_per_chip"]
    assert r["prefill_rows"] == 4 and r["prefill_tokens"] == 64
    # the verification step runs at least the target's forward over the K tokens: every
    # layer's weights and the LM head once per token, attention over the 64-token cache
    K, S, D, F = r["capacity"], 64, hf["hidden_size"], hf["intermediate_size"]
    N, Kh, H, L = (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
                   hf["num_hidden_layers"])
    weights = L * (2 * D * N * H + 2 * D * Kh * H + 3 * D * F) + D * hf["vocab_size"]
    target_flops = 2 * K * weights + L * 4 * K * S * N * H
    assert target_flops <= v["flops_per_step"] <= 1.5 * target_flops
    # the prefill runs the target's layers over every slot's 64 prompt tokens
    assert r["prefill_call"]["flops_per_step"] >= 2 * 4 * 64 * (weights - D * V)
    assert 0 < d["flops_per_step"] < v["flops_per_step"]
    assert r["flops_per_step"] == d["flops_per_step"] + v["flops_per_step"]
    assert r["step_time_lower_bound_s"] == pytest.approx(
        d["step_time_lower_bound_s"] + v["step_time_lower_bound_s"])
    printed = capsys.readouterr().out
    assert all(k in printed for k in programs)
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
def test_v5e_drafting_at_a_real_layer_shape_copies_no_weight(tmp_path):
    """At Qwen3-4B's layer shape (hidden 2560, 32 heads over 8, MLP 9728; a config alone, two
    target and two drafter layers) the draft and the round compiled for a v5e copy no weight:
    XLA:TPU lays out each drafter product's weight as it lies (at tiny shapes it would not
    relay one out either way)."""
    from hf_tiny import tiny_hf_config

    cfg = tiny_hf_config("qwen3", head_dim=128, layers=2).to_dict()
    cfg.update(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
               num_key_value_heads=8)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "v5e.json"
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--chip", "v5e", "--decode",
                   "--programs", "draft,round", "--max-len", "256", "--json", str(out),
                   f"--config.target={tmp_path / 't'}", "--config.train.target_dtype=bfloat16",
                   "--config.draft.num_draft_layers=2"])
    assert rc == 0
    for name, p in json.loads(out.read_text())["programs"].items():
        assert p["weight_copy_bytes"] == 0, (name, p["weight_copies"])


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
    assert r["tree_branching"] == 16      # the engine's default, as `evaluate` runs it
    assert set(r["programs"]) == {"draft", "round"}
    for name, p in r["programs"].items():   # no weight matrix copied (a scalar bias may be)
        assert p["weight_copy_bytes"] < 64, (name, p["weight_copies"])
        assert p["weights_bytes"] > 0 and p["kernels_per_step"] > 0


def test_tree_round_compiles_for_a_v5e_slice_with_the_vocabulary_split(tmp_path):
    """`--decode --tree-budget N` on a TPU slice: the tree round compiles with the vocabulary
    split over the tensor axis. The sampled rule gathers each node's row of the target's
    probabilities as it reaches it; gathering every request's [N + 1, V] rows first stops
    libtpu's compiler (a gather split it cannot lay out)."""
    target = save_tiny_hf(tmp_path / "target", "qwen3", head_dim=16, layers=2, vocab=2048)
    rc, r = _slice_decode(tmp_path, target, "--tree-budget", "8", "--tree-branching", "4",
                          "--programs", "round")
    assert rc == 0
    assert r["mesh"]["tensor"] == 2 and r["fits"] is True
    assert r["tree_budget"] == 8 and r["tree_branching"] == 4
    assert r["round_call"]["compile_error"] == ""
    # `--programs round`: the round alone, its peak and bound the report's
    assert not {"draft_step", "verify_step", "prefill_call", "anchor_call"} & set(r)
    assert r["peak_bytes_per_chip"] == r["round_call"]["peak_bytes_per_chip"]
    assert r["step_time_lower_bound_s"] == r["round_call"]["step_time_lower_bound_s"]
    rc = cli.main(["aot", "--decode", "--config", "configs/tiny.py", "--topology", "v5e:2x2",
                   f"--config.target={target}", "--programs", "round,prefil"])
    assert rc == 2


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu for TPU topologies on CPU: "
                    "pip install -e '.[tpu]'")
def test_gemma4_serving_compiles_for_a_v5e_slice(tmp_path):
    """A Gemma4 target (sliding and full layers, k = v, KV-shared layers, a softcapped tied
    head, each layer's scalar) served on a TPU slice with its KV heads split over the tensor
    axis: the round, its parts, the joins' prefill and the rounds that skip drafting all
    compile. The residual kernel's scale is one value, replicated into its `shard_map`."""
    target = save_tiny_gemma4(tmp_path / "target", "all_features", vocab=512,
                              hidden_size_per_layer_input=0)
    rc, r = _slice_decode(tmp_path, target)
    assert rc == 0
    assert r["mesh"]["tensor"] == 2 and r["fits"] is True and r["compile_error"] == ""
    for k in ("draft_step", "verify_step", "round_call", "anchor_call", "prefill_call"):
        assert r[k]["flops_per_step"] > 0 and r[k]["compile_error"] == "", k


def test_what_the_engine_refuses_aot_refuses_with_its_words(tmp_path, capsys):
    """`aot --decode` checks the target and drafter as the engine does (`check_models`):
    trees asked of an Eagle3 drafter or of a Gemma4 target are usage errors naming
    `tree_budget` and the model that cannot, not crashes."""
    trees = ["aot", "--decode", "--config", "configs/tiny.py", "--chip", "h200", "--requests",
             "2", "--max-len", "64", "--tree-budget", "8"]
    qwen3 = save_tiny_hf(tmp_path / "qwen3", "qwen3", head_dim=16, layers=2)
    rc = cli.main([*trees, f"--config.target={qwen3}", "--config.draft.model_type=eagle3",
                   "--config.draft.draft_num_hidden_layers=1", "--config.draft.ttt_length=3",
                   "--config.draft.markov_rank=0",
                   "--config.draft.enable_confidence_head=False"])
    err = capsys.readouterr().err
    assert rc == 2 and "tree_budget" in err and "eagle3 drafter drafts one chain" in err
    gemma4 = save_tiny_gemma4(tmp_path / "gemma4", "untied_plain")
    rc = cli.main([*trees, f"--config.target={gemma4}"])
    err = capsys.readouterr().err
    assert rc == 2 and "tree_budget: a gemma4 target cannot verify a tree" in err


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


def test_a_drafters_floor_counts_what_its_slots_read_again():
    """The floor of a drafting program: the weights once less the tables it gathers a row from,
    plus a Markov head's W2 once per further slot, or, for a drafter that runs a pass of its
    layers and LM head a token (Eagle3), its weights less those tables once per further pass."""
    from dspark_jax.aot.decode_floor import must_read_bytes

    p = {"arrays.target_state['layers']": 100.0, "arrays.target_state['embed']": 8.0,
         "arrays.target_state['lm_head']": 8.0, "arrays.draft_state['layers']": 10.0,
         "arrays.draft_state['lm_head']": 6.0, "arrays.draft_state['embed']": 6.0,
         "arrays.draft_state['markov']['w1']": 2.0, "arrays.draft_state['markov']['w2']": 3.0}
    weights = sum(p.values())
    gathered = 8.0 + 6.0 + 2.0   # the untied embeddings and W1
    assert must_read_bytes(p, weights, 5.0) == (weights - gathered + 5.0, gathered, 0.0)
    assert must_read_bytes(p, weights, 5.0, draft_slots=4) == (
        weights - gathered + 5.0 + 3 * 3.0, gathered, 9.0)
    per_pass = 10.0 + 6.0 + 3.0   # the drafter's weights less its embedding and W1
    assert must_read_bytes(p, weights, 5.0, draft_slots=4, stepwise_drafter=True) == (
        weights - gathered + 5.0 + 3 * per_pass, gathered, 3 * per_pass)
