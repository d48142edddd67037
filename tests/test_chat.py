"""Chat and prompt/completion data: loss weights from chat templates, shards, batches, losses."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_user_error, kiln, make_config, train_bpe
from kiln import losses
from kiln.data import chat, make_datasets
from kiln.data.corpus import open_corpus
from kiln.data.pipeline import StreamWindows
from kiln.data.prepare import prepare
from kiln.data.sources import resolve_inputs
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError

# A ChatML template as Hugging Face tokenizer_config.json files write them (Qwen-style).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "the quick brown fox"},
    {"role": "assistant", "content": "jumps over 3 lazy dogs"},
    {"role": "user", "content": "line 7: the fox"},
    {"role": "assistant", "content": "jumps over"},
    {"role": "user", "content": "and then?"},
    {"role": "assistant", "content": "the lazy dogs 14"},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json with ChatML special tokens and its tokenizer_config
    (eos_token <|im_end|>: the end-of-turn token is the EOS, as in Qwen's chat models)."""
    d = tmp_path_factory.mktemp("chat_tok")
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    train_bpe(d / "tokenizer.json", 320, special)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "chat_template": CHATML,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_three_turns_weigh_exactly_the_assistant_tokens_and_match_transformers(chat_tokenizer):
    tok = load_tokenizer(str(chat_tokenizer / "tokenizer.json"))
    fmt = chat.record_format("chat", tok, None)
    assert fmt.template == CHATML and "tokenizer_config.json" in fmt.origin
    text, spans = chat.assistant_spans(CONVERSATION, fmt)
    ids, offsets = tok.encode_offsets(text)
    got = np.zeros(len(ids), np.uint8)
    for a, b in spans:
        got |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    # Reference, built turn by turn: the header and the newline after <|im_end|> weigh 0; the
    # assistant's content and its <|im_end|> weigh 1. (The pre-tokenizer splits at newlines
    # and special tokens, so the pieces tokenize as the whole does.)
    want_ids, want_w = [], []
    for m in CONVERSATION:
        scored = m["role"] == "assistant"
        for piece, w in (
            (f"<|im_start|>{m['role']}\n", 0),
            (m["content"] + "<|im_end|>", int(scored)),
            ("\n", 0),
        ):
            p = tok.encode(piece)
            want_ids += p
            want_w += [w] * len(p)
    assert ids.tolist() == want_ids
    assert got.tolist() == want_w
    assert sum(want_w) > 10 and tok.eos_id == tok.encode("<|im_end|>")[0]

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    out = hf.apply_chat_template(CONVERSATION, tokenize=True)
    hf_ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert list(hf_ids) == ids.tolist()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_chat_shards_pack_weights_and_whole_conversations(tmp_path, chat_tokenizer):
    """Weights reach batches as the targets' own; segments follow documents, not the EOS
    (<|im_end|>) that ends every turn."""
    spec = str(chat_tokenizer / "tokenizer.json")
    tok = load_tokenizer(spec)
    other = [{"role": "user", "content": "lazy dogs"}, {"role": "assistant", "content": "fox 21"}]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": other}] * 3)
    fmt = chat.record_format("chat", tok, None)
    manifest, _ = prepare(
        resolve_inputs([str(src)]), "jsonl", "text", tok, tmp_path / "out", record_format=fmt
    )
    assert manifest["version"] == 2 and manifest["record_format"]["kind"] == "chat"
    corpus = open_corpus([tmp_path / "out"], tok, 384)
    tokens, weights = np.asarray(corpus.shards[0]), np.asarray(corpus.weights[0])
    ends = np.cumsum(corpus.doc_len)
    assert (tokens[ends - 1] == tok.eos_id).all() and (weights[ends - 1] == 0).all()
    n = corpus.num_tokens
    windows = StreamWindows(
        corpus, np.arange(corpus.num_documents), n - 1, tok.eos_id, tok.pad_id, vocab_size=384
    )
    b = windows.batch(np.array([0]))
    np.testing.assert_array_equal(b["targets"][0], tokens[1:])
    np.testing.assert_array_equal(b["weights"][0], weights[1:].astype(np.float32))
    # One segment per document: the first starts at token 0, each next one at the EOS input
    # that ends the document before it, although <|im_end|> is everywhere inside.
    want = np.searchsorted(ends - 1, np.arange(n - 1), side="right") + 1
    np.testing.assert_array_equal(b["segment_ids"][0], want)
    assert (b["inputs"][0] == tok.eos_id).sum() > corpus.num_documents


def test_prompt_completion_weighs_the_completion_and_its_eos(tmp_path):
    tok = load_tokenizer("byte")
    src = write_jsonl(
        tmp_path / "pc.jsonl",
        [{"prompt": "2+2=", "completion": "4"}, {"prompt": "", "completion": "hé"}],
    )
    fmt = chat.record_format("prompt_completion", tok, None)
    prepare(resolve_inputs([str(src)]), "jsonl", "text", tok, tmp_path / "out", record_format=fmt)
    corpus = open_corpus([tmp_path / "out"], tok, 384)
    tokens, weights = np.asarray(corpus.shards[0]), np.asarray(corpus.weights[0])
    eos = tok.eos_id
    assert tokens.tolist() == [*b"2+2=4", eos, *"hé".encode(), eos]
    assert weights.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]


def test_chat_config_trains_on_cached_weighted_shards(tmp_path):
    """data.format: chat through make_datasets: raw JSONL tokenized into a cache keyed by the
    format (text shards of the same file are another cache), batches carry the weights."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 8)
    cfg = make_config(
        data={
            "source": "jsonl",
            "format": "chat",
            "paths": [str(src)],
            "seq_len": 64,
            "eval_fraction": 0.2,
        },
        train={"global_batch_size": 8},
        output_dir=tmp_path,
    )
    ds = make_datasets(cfg)
    batch = next(ds.train_iterator())
    text = bytes(int(t) for t in batch["targets"].ravel() if t < 256).decode()
    assert "<|assistant|>" in text
    scored = batch["targets"][batch["weights"] > 0]
    assert 0 < len(scored) < 0.5 * batch["weights"].size
    # Scored bytes are the assistant's words and "<|end|>", never a user's or the system's.
    words = bytes(int(t) for t in scored if t < 256).decode()
    assert "quick" not in words and "terse" not in words and "lazy" in words
    (cache,) = [p.name for p in (tmp_path / ".cache").iterdir()]
    text_cfg = make_config(
        data={"source": "jsonl", "field": "messages", "paths": [str(src)]}, output_dir=tmp_path
    )
    from kiln.data import cache_dir_for

    assert cache_dir_for(text_cfg, [src], load_tokenizer("byte")).name != cache


def test_bad_record_in_a_training_config_leaves_no_cache_behind(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"prompt": "x"}])
    cfg = make_config(
        data={"source": "jsonl", "format": "chat", "paths": [str(src)]},
        output_dir=tmp_path / "runs",
    )
    with pytest.raises(KilnError, match=re.escape("c.jsonl:2: format chat needs 'messages'")):
        make_datasets(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


# --- the weights flow into the losses --------------------------------------------------------------


def chat_mask(shape, seed):
    """0/1 weights in runs, as a chat's prompts and answers alternate."""
    rng = np.random.default_rng(seed)
    return (np.cumsum(rng.random(shape) < 0.2, axis=-1) % 2).astype(np.float32)


def test_lm_loss_ignores_masked_targets_and_matches_float64():
    rng = np.random.default_rng(0)
    b, s, d, v = 2, 24, 16, 40
    h = rng.normal(size=(b, s, d)).astype(np.float32)
    w_dv = (rng.normal(size=(d, v)) / 4).astype(np.float32)
    y = rng.integers(0, v, (b, s))
    mask = chat_mask((b, s), 1)
    assert 0 < mask.sum() < mask.size

    def mean_loss(h, w_dv, y):
        out = losses.lm_loss(h, w_dv, jnp.asarray(y), jnp.asarray(mask))
        return out["loss_sum"] / out["weight_sum"]

    value, (dh, dw) = jax.value_and_grad(mean_loss, argnums=(0, 1))(h, w_dv, y)
    # float64 reference over the weight-1 tokens only.
    x = h.astype(np.float64) @ w_dv.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(p, y[..., None], -1))[..., 0]
    want = (nll * mask).sum() / mask.sum()
    dx = (p - np.eye(v)[y]) * (mask / mask.sum())[..., None]
    np.testing.assert_allclose(value, want, rtol=1e-5)  # f32 vs f64: 1e-5 relative
    np.testing.assert_allclose(
        dh, dx @ w_dv.T.astype(np.float64), rtol=1e-5, atol=1e-7
    )  # f32: 1e-5 rel
    np.testing.assert_allclose(
        dw, np.einsum("bsd,bsv->dv", h.astype(np.float64), dx), rtol=1e-5, atol=1e-7
    )
    # Another target where the weight is 0 changes nothing, bit for bit.
    y2 = np.where(mask > 0, y, (y + 1) % v)
    value2, (dh2, dw2) = jax.value_and_grad(mean_loss, argnums=(0, 1))(h, w_dv, y2)
    assert float(value2) == float(value)
    np.testing.assert_array_equal(dh2, dh)
    np.testing.assert_array_equal(dw2, dw)


def test_soft_loss_is_weighted_by_the_same_mask():
    rng = np.random.default_rng(2)
    b, s, d, e, v, t = 2, 16, 8, 12, 30, 2.0
    hs, ht = rng.normal(size=(b, s, d)), rng.normal(size=(b, s, e))
    ws, wt = rng.normal(size=(d, v)) / 3, rng.normal(size=(e, v)) / 3
    y = rng.integers(0, v, (b, s))
    mask = chat_mask((b, s), 3)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out = losses.soft_loss_sums(f(hs), f(ws), f(ht), f(wt), jnp.asarray(y), f(mask), temperature=t)

    def softmax(x):
        e_ = np.exp(x - x.max(-1, keepdims=True))
        return e_ / e_.sum(-1, keepdims=True)

    p_s, p_t = softmax(hs @ ws / t), softmax(ht @ wt / t)
    kl = t * t * np.sum(p_t * (np.log(p_t) - np.log(p_s)), -1)
    np.testing.assert_allclose(out["soft_sum"], (kl * mask).sum(), rtol=1e-5)  # f32 vs f64


# --- bad input: exit 2, one line, nothing written ----------------------------------------------------


def prepare_records(src, record_format, out):
    """`kiln prepare` of a JSONL file as chat or prompt/completion records."""
    return kiln(
        "prepare", "--input", src, "--format", "jsonl", "--record-format", record_format,
        "--output", out,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("record", "needles"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, ["c.jsonl:2", "no assistant message"]),
        (
            {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            ["c.jsonl:2", "messages[0].role is 'bot'", "allowed: system, user, assistant, tool"],
        ),
        ({"messages": "hi"}, ["c.jsonl:2", "needs 'messages'"]),
    ],
    ids=["no-assistant", "unknown-role", "not-a-list"],
)
def test_bad_chat_record_exits_2_and_writes_nothing(tmp_path, record, needles):
    good = {"messages": CONVERSATION}
    src = write_jsonl(tmp_path / "c.jsonl", [good, record])
    proc = prepare_records(src, "chat", tmp_path / "out")
    assert_user_error(proc, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_prompt_completion_without_its_fields_exits_2(tmp_path):
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    proc = prepare_records(src, "prompt_completion", tmp_path / "out")
    assert_user_error(proc, "pc.jsonl:2", "'prompt' and 'completion'", "['prompt']")
    assert not (tmp_path / "out").exists()


def test_template_that_fails_to_render_names_record_template_line_and_error(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}\n"
        "{% if m['role'] == 'system' %}{{ raise_exception('no system messages here') }}{% endif %}\n"
        "{{ m['content'] }}\n{% endfor %}\n"
    )
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    proc = kiln(
        "prepare", "--input", src, "--format", "jsonl", "--record-format", "chat",
        "--chat-template", template, "--output", tmp_path / "out",
    )  # fmt: skip
    assert_user_error(
        proc, "c.jsonl:1", "t.jinja, template line 2", "TemplateError: no system messages here"
    )
    assert not (tmp_path / "out").exists()


def test_config_template_syntax_error_and_format_without_jsonl_exit_2(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps(
            {
                "base_config": str(__import__("conftest").REPO / "configs/tiny.yaml"),
                "data": {
                    "source": "jsonl",
                    "format": "chat",
                    "paths": [str(src)],
                    "chat_template": "{% for m in messages %}\n{{ m }",
                },
                "train": {"output_dir": str(tmp_path / "runs"), "eval_tasks": []},
            }
        )
    )
    proc = kiln("train", cfg)
    assert_user_error(proc, "data.chat_template: template line 2: not a valid Jinja template")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(
        KilnError,
        match=re.escape("data.format: 'chat' reads JSONL records, but data.source is 'text'"),
    ):
        make_config(data={"source": "text", "format": "chat"})
    with pytest.raises(
        KilnError, match=re.escape("data.chat_template: given, but data.format is 'text'")
    ):
        make_config(data={"source": "jsonl", "chat_template": "{{ messages }}"})


@pytest.mark.slow
def test_chat_weights_flow_through_the_train_step_and_accumulation(tmp_path):
    """A chat batch through train.loss_and_grads: total_weights counts the assistant targets,
    accumulation agrees, and targets of weight 0 change neither the loss nor the gradients."""
    from kiln.training import train

    tok = load_tokenizer("byte")
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 4)
    fmt = chat.record_format("chat", tok, None)
    prepare(resolve_inputs([str(src)]), "jsonl", "text", tok, tmp_path / "out", record_format=fmt)
    corpus = open_corpus([tmp_path / "out"], tok, 384)
    windows = StreamWindows(corpus, np.arange(4), 32, tok.eos_id, tok.pad_id, vocab_size=384)
    batch = windows.batch(np.arange(16))
    assert 0 < batch["weights"].sum() < batch["weights"].size
    model = {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_seq_len": 32}  # fmt: skip

    from kiln.config import MESH_AXES

    # One device: the weights' path is under test here, not sharding (test_train covers it).
    mesh = jax.make_mesh(
        (1,) * len(MESH_AXES), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=jax.devices()[:1],
    )  # fmt: skip
    configs = {
        accum: make_config(
            model=model,
            data={"seq_len": 32},
            train={"global_batch_size": 16, "gradient_accumulation_steps": accum},
            mesh={"fsdp": 1},
        )
        for accum in (1, 2)
    }
    state = train.init_state(configs[1], mesh)

    def run(accum, b):
        loss, aux, grads = train.loss_and_grads(configs[accum], state, b)
        return float(loss), float(aux["learning/total_weights"]), jax.tree.map(np.asarray, grads)

    loss, total, grads = run(1, batch)
    assert total == batch["weights"].sum()
    loss2, total2, grads2 = run(2, batch)
    np.testing.assert_allclose(loss2, loss, rtol=1e-5)  # f32 sums in another order: 1e-5
    assert total2 == total
    for g2, g in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(g2, g, rtol=1e-5, atol=1e-5 * np.abs(g).max())  # f32: 1e-5
    masked = batch["weights"] == 0
    other = {**batch, "targets": np.where(masked, (batch["targets"] + 1) % 256, batch["targets"])}
    loss3, _, grads3 = run(1, other)
    assert loss3 == loss
    for g3, g in zip(jax.tree.leaves(grads3), jax.tree.leaves(grads), strict=True):
        np.testing.assert_array_equal(g3, g)


def test_weighted_shards_at_a_url_mix_with_a_text_source(tmp_path):
    """Loss weights survive an upload (`.wts` beside the tokens at a memory:// URL) and a
    mixture: rows of the prompt/completion source carry its mask, rows of the text source
    weigh every real target."""
    tok = load_tokenizer("byte")
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "QQQQ", "completion": "AA"}] * 40)
    fmt = chat.record_format("prompt_completion", tok, None)
    url = f"memory://{tmp_path.name}/pc"
    manifest, _ = prepare(resolve_inputs([str(src)]), "jsonl", "text", tok, url, record_format=fmt)
    assert manifest["version"] == 2
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("x" * 600)
    sources = [
        {"name": "pc", "source": "tokens", "paths": [url], "weight": 1.0},
        {"name": "text", "source": "text", "paths": [str(tmp_path / "t")], "weight": 1.0},
    ]
    cfg = make_config(
        data={"seq_len": 12, "cache_dir": str(tmp_path / "cache"), "sources": sources},
        model={"vocab_size": 384},
        train={"global_batch_size": 16},
        output_dir=tmp_path / "runs",
    )
    batch = next(make_datasets(cfg).train_iterator())
    eos, seen = tok.eos_id, set()
    for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
        if (inputs == ord("x")).any():
            seen.add("text")
            np.testing.assert_array_equal(weights, (targets != tok.pad_id).astype(np.float32))
        else:
            seen.add("pc")
            # Weight 1 exactly on the completion's "A"s and the EOS after them.
            want = ((targets == ord("A")) | ((targets == eos) & (inputs == ord("A")))).astype(
                np.float32
            )
            np.testing.assert_array_equal(weights, want)
    assert seen == {"pc", "text"}
