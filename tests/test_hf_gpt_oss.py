"""Hugging Face interop of the gpt_oss family (GptOssForCausalLM), checked against transformers
itself (CPU torch, float32).

One random tiny GPT-OSS (shared by the tests) alternates sliding-window and full layers with a
window shorter than the sequences, has non-zero sinks and biases everywhere (q/k/v/o, router,
experts), YaRN rope with fractional ramp ends (truncate: false), head_dim apart from
d_model / heads and a SwiGLU limit low enough to clamp: kiln's logits of the imported model
agree with transformers' within 1e-4 (float32, whole model, as tests/test_hf.py), greedy
decoding past the window agrees token for token, export(import(x)) is x bit for bit, and a
random kiln model exports, loads in transformers with kiln's logits and imports back bit for
bit.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import make_config
from kiln.cli import main
from kiln.config import config_from_dict, load_config
from kiln.errors import KilnError
from kiln.model.gpt_oss import GptOssMlp
from kiln.model.interop import hf_config
from kiln.parallel.mesh import make_mesh, use_mesh
from kiln.runs.runmodel import load_run_model
from test_hf import B, S, all_tensors, edited_copy, kiln_logits, trained_run, write_tokenizer
from test_hf_moe import greedy, kiln_greedy
from test_moe import rel_err

TOL = 1e-4  # whole-model float32 logits, kiln vs transformers (as tests/test_hf.py)
V = 128
ARCH = "GptOssForCausalLM"
WINDOW = 4  # < S = 16 and < the decoded length
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
# YaRN whose ramp ends (1.6 and 5.2 of 8 rotary pairs) are not whole: truncate matters.
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 100.0,
    "factor": 4.0,
    "beta_fast": 4.0,
    "beta_slow": 0.5,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
LIMIT = 0.3  # the gate and up projections of these weights reach past it


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, S))


def random_gpt_oss(path: Path) -> Path:
    """A random GPT-OSS of 3 layers (sliding, full, sliding; window 4), GQA 4/2 heads of 16
    (d_model 32), 4 experts of width 24, top 2; every parameter 0.2 x normal (norm weights
    1 + that); saved in shards with a tokenizer.json."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=TYPES,
        rope_parameters=dict(ROPE),
        swiglu_limit=LIMIT,
        max_position_embeddings=64,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    model = GptOssForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.2 * torch.randn_like(p)
            p.copy_(1 + noise if "norm" in name else noise)
    model.save_pretrained(path, max_shard_size="40KB")
    write_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return random_gpt_oss(tmp_path_factory.mktemp("hf") / "gpt_oss")


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    """The transformers model of `hf_dir`, loaded once (float32, eval)."""
    return load_hf(hf_dir)


def load_hf(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == ARCH
    return model


def logits_of(model, inputs):
    import torch

    with torch.no_grad():
        return model(torch.tensor(inputs)).logits.numpy()


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpt_oss") / "imported"
    assert main(["import-hf", str(hf_dir), "--out", str(run_dir)]) == 0
    return run_dir


def test_import_matches_transformers_and_round_trips_bitwise(hf_dir, hf_model, imported, tmp_path):
    from transformers import AutoConfig

    m = load_config(imported / "config.yaml").model
    assert (m.family, m.attention_sinks, m.tie_embeddings, m.head_dim) == (
        "gpt_oss",
        True,
        False,
        16,
    )
    assert (m.layer_types, m.sliding_window, m.rope_theta) == (tuple(TYPES), WINDOW, 100.0)
    assert (m.moe.num_experts, m.moe.experts_per_token, m.moe.d_ff_expert) == (4, 2, 24)
    assert (m.gpt_oss.swiglu_limit, m.gpt_oss.yarn.truncate, m.gpt_oss.yarn.factor) == (
        LIMIT,
        False,
        4.0,
    )
    inputs = tokens(1)
    ours = kiln_logits(load_run_model(imported, context="test").model, inputs)
    np.testing.assert_allclose(ours, logits_of(hf_model, inputs), atol=TOL, rtol=0)

    out = tmp_path / "exported"
    assert main(["export-hf", str(imported), "--out", str(out)]) == 0
    original, exported = all_tensors(hf_dir), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, x in original.items():
        assert exported[name].tobytes() == x.tobytes(), name
    hf_in, hf_out = AutoConfig.from_pretrained(hf_dir), AutoConfig.from_pretrained(out)
    keys = ["layer_types", "sliding_window", "head_dim", "rope_parameters", "swiglu_limit"]
    for key in [*keys, "swiglu_alpha", "num_local_experts", "num_experts_per_tok"]:
        assert getattr(hf_out, key) == getattr(hf_in, key), key
    np.testing.assert_allclose(logits_of(load_hf(out), inputs), ours, atol=TOL, rtol=0)


def test_the_hubs_config_form_imports_as_the_same_model(hf_dir, imported, tmp_path):
    """The Hub's GPT-OSS config.json files give rope_theta and a legacy rope_scaling instead of
    rope_parameters; without layer_types, GptOssConfig's default (even layers sliding) is this
    model's."""
    raw = json.loads((hf_dir / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    scaling = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    legacy |= {"rope_theta": ROPE["rope_theta"], "rope_scaling": scaling}
    src = edited_copy(hf_dir, tmp_path / "legacy")
    (src / "config.json").write_text(json.dumps(legacy))
    run_dir = tmp_path / "run"
    assert main(["import-hf", str(src), "--out", str(run_dir)]) == 0
    assert load_config(run_dir / "config.yaml").model == load_config(imported / "config.yaml").model


def test_greedy_generate_past_the_window_matches_transformers(hf_model, imported, tmp_path):
    """kiln generate's cache (the sliding layers keep their window only) and transformers':
    the same tokens over prompts plus 12 new tokens, longer than the window."""
    got, encoded, eos = kiln_greedy(imported, tmp_path)
    wanted = greedy(hf_model, encoded, 12, eos)
    for record, want, prompt in zip(got, wanted, encoded, strict=True):
        assert record["tokens"] == want[: len(record["tokens"])]
        assert len(record["tokens"]) == 12 or record["finish"] == "eos"
        assert len(prompt) + len(record["tokens"]) > 2 * WINDOW


GPT_OSS = dict(
    family="gpt_oss",
    vocab_size=V,
    d_model=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    d_ff=24,  # unused (no dense MLP); import reads it from intermediate_size as d_ff_expert
    attention_sinks=True,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    rope_theta=100.0,
    moe={"num_experts": 4, "experts_per_token": 2, "d_ff_expert": 24},
    gpt_oss={
        "swiglu_limit": LIMIT,
        "yarn": {k: v for k, v in ROPE.items() if k not in ("rope_type", "rope_theta")},
    },
    max_seq_len=64,
)


def test_a_trained_run_exports_with_equal_logits_and_imports_back_bitwise(tmp_path):
    """A gpt_oss run trained 2 steps (every parameter, biases and sinks included, moved by the
    optimizer) exports, loads in transformers with kiln's logits, and imports back bit for
    bit."""
    tok = write_tokenizer(tmp_path / "tok.json")
    raw = {
        "model": GPT_OSS,
        "mesh": {"fsdp": -1},
        "data": {"seq_len": S, "tokenizer": str(tok)},
        "train": {"output_dir": str(tmp_path), "run_name": "r", "global_batch_size": B},
    }
    config, run_dir = config_from_dict(raw), trained_run(raw)

    out = tmp_path / "hf"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "gpt_oss" and hf["layer_types"] == [*TYPES[:2], TYPES[0]]
    assert hf["rope_parameters"]["rope_type"] == "yarn" and hf["attention_bias"] is True
    run = load_run_model(run_dir, context="test")
    inputs = tokens(2)
    ours = kiln_logits(run.model, inputs)
    np.testing.assert_allclose(logits_of(load_hf(out), inputs), ours, atol=TOL, rtol=0)

    back = tmp_path / "back"
    assert main(["import-hf", str(out), "--out", str(back)]) == 0
    got_cfg = load_config(back / "config.yaml").model
    want_cfg = config.model.model_copy(update={"layer_types": tuple(hf["layer_types"])})
    assert got_cfg == want_cfg
    want = nnx.to_flat_state(nnx.state(run.model, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(load_run_model(back, context="test").model, nnx.Param)))
    for path, var in want:
        assert np.asarray(got[path].get_value()).tobytes() == np.asarray(var.get_value()).tobytes()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"attention_bias": False}, "attention_bias is False; kiln imports only true"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            "rope_parameters is {'rope_type': 'llama3'",
        ),
        (
            {"rope_parameters": {**ROPE, "attention_factor": 2.0}},
            "rope_parameters is {'rope_type': 'yarn'",
        ),
        (
            {"quantization_config": {"quant_method": "mxfp4"}},
            "quantization_config is 'mxfp4'; kiln imports only unquantized",
        ),
    ],
    ids=["attention_bias", "rope_type", "attention_factor", "mxfp4"],
)
def test_import_refusals_name_the_field(hf_dir, tmp_path, capsys, config, message):
    src = edited_copy(hf_dir, tmp_path / "edited", config=config)
    out = tmp_path / "run"
    assert main(["import-hf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"attention_sinks": False}, "model.attention_sinks is False with model.family gpt_oss"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "model.rope_scaling is rope_type='linear'",
        ),
        (
            {"moe": {**GPT_OSS["moe"], "first_dense_layers": 1}},
            "model.moe.first_dense_layers is 1 with model.family gpt_oss; allowed: 0",
        ),
        (
            {"moe": {**GPT_OSS["moe"], "norm_topk_prob": False}},
            "model.moe.norm_topk_prob: false, but Hugging Face GptOssForCausalLM",
        ),
        (
            {"moe": {**GPT_OSS["moe"], "score": "sigmoid"}},
            "model.moe.score: sigmoid, but Hugging Face GptOssForCausalLM",
        ),
        ({"logit_softcap": 30.0}, "model.logit_softcap: 30.0, but"),
    ],
    ids=["sinks", "rope_scaling", "dense_layers", "norm_topk", "sigmoid", "softcap"],
)
def test_config_and_export_refusals_name_the_field(edit, message):
    """Refused by the config (a training run would be) or by export (GptOssForCausalLM cannot
    hold it), in one line naming the field."""
    raw = {"model": {**GPT_OSS, **edit}, "data": {"seq_len": S}, "train": {"run_name": "r"}}
    with pytest.raises(KilnError) as e:
        hf_config(config_from_dict(raw).model, 0, 0)
    assert len(str(e.value).splitlines()) == 1 and message in str(e.value), str(e.value)


def layer_run(layer, x, g, segment_ids, mesh=None, rules=None):
    """(y, dL/dx, dL/dparam for every parameter) of a routed layer, L = sum(g * y), on `mesh`
    or unsharded."""
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, segment_ids)
        return jnp.sum(y * g), y

    with use_mesh(mesh, rules):
        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, y), (d_state, dx) = jax.jit(grad)(state, x)
    flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(d_state)}
    return y, dx, flat


@pytest.mark.parametrize(
    "mesh",
    [{"expert": 4, "fsdp": 2}, {"expert": 2, "tensor": 2, "fsdp": 2}],
    ids=["expert4", "expert2_tensor2"],
)
def test_expert_biases_through_expert_parallelism_equal_one_device(mesh):
    """GPT-OSS's routed layer (router, gate/up and down biases, the clamped gate) with its
    experts split over mesh.expert, and their d_ff also over tensor (each device's partial
    sums meet once, the down bias added once): the unsharded layer's outputs and gradients,
    biases' included; ragged_dot's grouped matmul (checked once) gives blocked's."""

    def config_of(**moe):
        return make_config(
            model={**GPT_OSS, "moe": {**GPT_OSS["moe"], "num_experts": 8, **moe}},
            data={"seq_len": S},
            mesh=mesh,
            train={"global_batch_size": 8},
        )

    config = config_of()
    graphdef, state = nnx.split(GptOssMlp(config.model, rngs=nnx.Rngs(1)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    state = jax.tree.unflatten(
        treedef, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )
    layer = nnx.merge(graphdef, state)
    ragged = config_of(grouped_matmul="ragged_dot").model
    ragged_layer = nnx.merge(nnx.graphdef(GptOssMlp(ragged, rngs=nnx.Rngs(1))), state)
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal((8, S, 32)).astype(np.float32) for _ in range(2))
    segments = np.ones((8, S), np.int32)
    want = layer_run(layer, x, g, segments)
    assert {"gate_bias", "up_bias", "down_bias", "router_bias"} <= set(want[2])
    results = [layer_run(layer, x, g, segments, make_mesh(config), config.mesh.rules)]
    if "tensor" not in mesh:
        results.append(layer_run(ragged_layer, x, g, segments))
    for result in results:
        assert rel_err(result[0], want[0]) <= 1e-5  # tolerance: 1e-5 relative (float32)
        assert rel_err(result[1], want[1]) <= 1e-5  # tolerance: 1e-5 relative (float32)
        for name in want[2]:
            assert rel_err(result[2][name], want[2][name]) <= 1e-5, name  # 1e-5 (float32)


def test_bfloat16_round_trips_bitwise(hf_dir, tmp_path):
    """The test's model saved in bfloat16 (sinks included, as GPT-OSS's checkpoints hold them)
    imports as a bfloat16 model and exports back bit for bit, in the same dtypes."""
    import torch
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(src)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    assert main(["import-hf", str(src), "--out", str(run_dir)]) == 0
    assert load_config(run_dir / "config.yaml").model.param_dtype == "bfloat16"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    original, exported = all_tensors(src), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, x in original.items():
        assert exported[name].dtype == x.dtype, name
        assert exported[name].tobytes() == x.tobytes(), name
