"""Generation with a KV cache: decode logits against the full forward pass, sampling against
numpy, greedy continuations against transformers' `generate` on the exported model, and the
`kiln generate` command's refusals."""

import json

import jax
import numpy as np
import pytest

from conftest import kiln_main, make_config
from kiln.cli import main
from kiln.commands.generate import Sampling, generate, sample
from kiln.model import create_model
from kiln.parallel.mesh import make_mesh
from test_hf import kiln_run

RTOL = 1e-5  # float32 logits, cache decode vs full forward: max |a - b| / max |b| per step
MODEL = dict(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64)
# Different lengths in one batch: rows are left-padded to a common prompt length.
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 1]]


def full_forward_logits(model, rows):
    """float32 logits [rows, len, V] of right-padded rows by the training forward pass (one jit)."""
    length = max(len(r) for r in rows)
    x = np.zeros((len(rows), length), np.int32)
    segment_ids = np.zeros_like(x)
    for i, r in enumerate(rows):
        x[i, : len(r)], segment_ids[i, : len(r)] = r, 1
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), x.shape)

    @jax.jit
    def forward(x, positions, segment_ids):
        return model.logits(model.hidden_states(x, positions, segment_ids).hidden)

    return np.asarray(forward(x, positions, segment_ids))


# A sliding window shorter than the prompts, between full layers, with sinks: the sliding
# layer's cache keeps its last 4 slots only (a rolling cache), the full layer's every slot.
WINDOW = dict(
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    local_rope_theta=100.0,
    attention_sinks=True,
)


@pytest.mark.parametrize(
    ("mesh", "extra"),
    [(None, {}), (dict(fsdp=4, tensor=2), WINDOW), (None, WINDOW)],
    ids=["one_device", "fsdp4_tensor2-window_sinks", "window_sinks"],
)
def test_cache_decode_logits_equal_full_forward(mesh, extra):
    config = make_config(
        model=dict(MODEL, max_seq_len=32, init_std=0.3, **extra),
        data=dict(seq_len=16),
        mesh=mesh or {},
    )
    device_mesh = make_mesh(config) if mesh else None
    model = create_model(config, device_mesh, seed=0)
    n = 8
    out = generate(
        model,
        PROMPTS,
        max_new_tokens=n,
        mesh=device_mesh,
        rules=config.mesh.rules,
        return_logits=True,
    )
    assert out.finish == ["length"] * 3
    # Causal: the logits at position len(prompt)-1+i are those of new token i given its prefix.
    ref = full_forward_logits(model, [p + t for p, t in zip(PROMPTS, out.tokens)])
    for prompt, tokens, logits, ref_row in zip(PROMPTS, out.tokens, out.logits, ref):
        assert len(tokens) == n
        ref_row = ref_row[len(prompt) - 1 : len(prompt) - 1 + n]
        for i in range(n):
            err = np.abs(logits[i] - ref_row[i]).max() / np.abs(ref_row[i]).max()
            assert err <= RTOL, (i, err)
        assert tokens == np.argmax(ref_row, axis=-1).tolist()  # greedy

    # Other prompts of the same batch shape reuse the compiled prefill and step: no compile.
    compiles = []

    def listener(event, seconds, **_):
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = generate(
            model,
            [p[::-1] for p in PROMPTS],
            max_new_tokens=n,
            mesh=device_mesh,
            rules=config.mesh.rules,
            return_logits=True,
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(again.tokens[0]) == n and compiles == []


def test_sliding_layers_keep_only_their_window_in_the_cache():
    """A cache longer than the window holds the sliding layer's last W slots and the full
    layer's every slot; shorter, every layer's every slot. The summary says so."""
    config = make_config(model=dict(MODEL, max_seq_len=32, **WINDOW), data=dict(seq_len=16))
    model = create_model(config, None, seed=0)
    cache = jax.eval_shape(lambda: model.init_cache(3, 20))
    assert cache.k.shape[:3] == (1, 3, 20) and cache.local_k.shape[:3] == (1, 3, 4)
    short = jax.eval_shape(lambda: model.init_cache(3, 4))
    assert short.k.shape[:3] == (2, 3, 4) and short.local_k is None
    per_token, what = model.cache_bytes_per_token()
    assert per_token == 2 * 2 * 2 * 8 * 4  # every layer until the window is full
    assert "of them, 1 sliding_attention keep their last 4 tokens only, 512 bytes" in what
    assert "so 128 bytes per token after that" in what


def test_sampling_against_numpy():
    logits = np.random.default_rng(0).normal(size=(1, 12)).astype(np.float32) * 2
    keys = jax.random.split(jax.random.key(0), 400)

    def draws(sampling):
        return np.asarray(jax.jit(jax.vmap(lambda k: sample(logits, k, sampling)))(keys))[:, 0]

    order = np.argsort(-logits[0])
    assert (draws(Sampling(0.0)) == order[0]).all()
    assert set(draws(Sampling(1.0, top_k=3))) == set(order[:3])
    # Nucleus: the smallest set of most likely tokens whose mass reaches top_p (at T = 0.7).
    probs = np.exp(logits[0] / 0.7 - np.max(logits[0] / 0.7))
    probs = probs[order] / probs.sum()
    nucleus = order[: np.searchsorted(np.cumsum(probs), 0.6) + 1]
    assert set(draws(Sampling(0.7, top_p=0.6))) == set(nucleus)
    # Frequencies at T = 1 follow the softmax (400 draws: 4 binomial sigmas is below 0.1).
    freq = np.bincount(draws(Sampling(1.0)), minlength=12) / 400
    p = np.exp(logits[0] - logits[0].max())
    np.testing.assert_allclose(freq, p / p.sum(), atol=0.1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An untied GQA run (byte tokenizer, EOS 257), exported to Hugging Face."""
    tmp = tmp_path_factory.mktemp("gen")
    run_dir, _ = kiln_run(tmp, vocab_size=V)
    assert main(["export-hf", str(run_dir), "--out", str(tmp / "hf")]) == 0
    return run_dir, tmp / "hf"


def hf_greedy(hf_dir, prompts, max_new_tokens):
    """transformers' greedy continuation of each unpadded prompt (ending at EOS, if any)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=258,
            )
        out.append(seq[0, len(prompt) :].tolist())
    return out


def records(run_dir, tmp_path, texts, *args):
    """`kiln generate --prompts` of `texts` (greedy unless args say otherwise), JSONL records."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    out.unlink(missing_ok=True)
    argv = ["generate", str(run_dir), "--prompts", str(prompts), "--out", str(out)]
    assert main([*argv, "--temperature", "0", *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


V = 384  # kiln's byte tokenizer: EOS 257
TEXTS = ["def f(x):", "x", "return 1"]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_generate_matches_transformers(tmp_path, run, tied):
    if tied:
        run_dir, _ = kiln_run(tmp_path, vocab_size=V, tie_embeddings=True)
        hf_dir = tmp_path / "hf"
        assert main(["export-hf", str(run_dir), "--out", str(hf_dir)]) == 0
    else:
        run_dir, hf_dir = run
    got = records(run_dir, tmp_path, TEXTS, "--max-new-tokens", "12")
    # The run's tokenizer, EOS first: the document start of training.
    prompts = [[257, *t.encode()] for t in TEXTS]
    for record, want in zip(got, hf_greedy(hf_dir, prompts, 12)):
        assert record["tokens"] == want[: len(record["tokens"])]
        assert len(record["tokens"]) == 12 or record["finish"] == "eos"


@pytest.mark.slow
def test_stop_string_and_samples(tmp_path, run):
    run_dir, _ = run
    # 12 new tokens, as in the greedy test: the same compiled prefill and step serve both.
    first = records(run_dir, tmp_path, ["x = "], "--max-new-tokens", "12")[0]
    stop = first["completion"][3]
    cut = first["completion"][: first["completion"].index(stop)]
    record = records(run_dir, tmp_path, ["x = "], "--max-new-tokens", "12", "--stop", stop)[0]
    assert (record["completion"], record["finish"]) == (cut, "stop")
    assert len(record["tokens"]) < 12  # the host check (every 8 steps) ended decoding early

    args = ["--temperature", "1", "--num-samples", "3", "--top-k", "20", "--max-new-tokens", "8"]
    got = records(run_dir, tmp_path, ["x = "], *args)
    assert [r["sample"] for r in got] == [1, 2, 3]
    assert len({tuple(r["tokens"]) for r in got}) > 1
    # The console numbers the same samples as the file: the same seed prints the same texts.
    printed = kiln_main("generate", run_dir, "--prompt", "x = ", *args)
    assert printed.returncode == 0, printed.stderr
    headers = [line for line in printed.stdout.splitlines() if line.startswith("=== ")]
    assert headers == [f"=== prompt 1, sample {r['sample']} ({r['finish']}) ===" for r in got]
    for r in got:
        header = f"=== prompt 1, sample {r['sample']} ({r['finish']}) ===\n"
        assert header + "x = " + r["completion"] in printed.stdout


def one_line_error(capsys, args, *needles):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kiln: error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err)


def test_bad_input_exits_2_with_one_line(tmp_path, run, capsys):
    run_dir, _ = run
    gen = ["generate", str(run_dir)]
    long = "x" * 30  # 31 tokens with EOS, + 8 new > max_seq_len 32
    one_line_error(
        capsys, [*gen, "--prompt", long, "--max-new-tokens", "8"], "model.max_seq_len=32"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "clay"}\n\n{"prompt": 3}\n')
    one_line_error(capsys, [*gen, "--prompts", str(bad)], f"{bad}:3:")
    bad.write_text('{"prompt": "clay"}\n{"prompt": \n')
    one_line_error(capsys, [*gen, "--prompts", str(bad)], f"{bad}:2: not valid JSON")
    few = ["--max-new-tokens", "4"]
    one_line_error(
        capsys, [*gen, "--prompt", "x", *few, "--step", "7"], "--step 7", "there are [0]"
    )
    one_line_error(capsys, [*gen], "exactly one of --prompt")
    # An --out that cannot be written is refused before anything is generated.
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "o.jsonl"  # its parent is a file
    one_line_error(capsys, [*gen, "--prompt", "x", *few, "--out", str(out)], "--out:", str(blocker))
    empty, _ = kiln_run(tmp_path, vocab_size=V, logit_softcap=30.0)  # config.yaml, no checkpoint
    one_line_error(
        capsys, ["generate", str(empty), "--prompt", "x", *few], "no complete checkpoint"
    )
