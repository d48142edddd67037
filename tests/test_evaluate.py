"""`kiln eval` and `train.eval_tasks`: perplexity against kiln's own held-out loss, multiple-choice
accuracy against a hand computation, bits per byte with the byte tokenizer, and the refusals.

One tiny run (2 steps, byte tokenizer, 8 simulated devices, fsdp=8) is trained once per module
and shared; its held-out split is exactly one document of 8 windows, one evaluation batch.
"""

import json
import math
import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import assert_user_error, kiln, make_config
from kiln.cli import main
from kiln.commands.compare import load_runs, read_events
from kiln.data.corpus import split_documents
from kiln.data.eval_tasks import default_name, parse_task, parse_tasks
from kiln.errors import KilnError
from kiln.model import abstract_state, build_model
from kiln.runs.restore import abstract_like, restore_params
from kiln.training.pretrain import run
from kiln.training.profiling import compilation_cache_for

pytestmark = pytest.mark.slow
F32 = 1e-5  # relative: float32 sums of the same per-token losses in another order

DOCS = 4
QUIZ = [  # (context, choices) of the in-training task; golds are arbitrary
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"]),
    ("import os\nprint(os.", ["path)", "getcwd())", "x"]),
]


def doc_text(i: int) -> str:
    """120 bytes: with seq_len 16, 120 targets = 8 windows (the last one partly padded)."""
    words = ["kiln", "fires", "clay", "at", "high", "heat", "glaze", "pot"]
    rng = np.random.default_rng(i)
    text = " ".join(rng.choice(words, 40))
    return (text * 3)[:119] + "\n"


def write_choice(path: Path, questions) -> Path:
    lines = [json.dumps({"context": c, "choices": ch, "gold": g}) for c, ch, g in questions]
    path.write_text("\n".join(lines) + "\n")
    return path


def raw_config(tmp: Path, **train) -> dict:
    return {
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 2, "num_heads": 4, "d_ff": 64, "max_seq_len": 32},
        "data": {"source": "text", "paths": [str(tmp / "docs" / "*.txt")], "seq_len": 16,
                 "eval_fraction": 1 / DOCS, "cache_dir": str(tmp / "cache")},
        "mesh": {"fsdp": -1},
        "loss": {"z_loss_multiplier": 1e-4},
        "optim": {"learning_rate": 3e-3, "schedule": "constant"},
        "train": {"output_dir": str(tmp / "runs"), "run_name": "r", "steps": 2, "global_batch_size": 8,
                  "log_every_steps": 1, "eval_every_steps": 2, "eval_batches": 1,
                  "compilation_cache_dir": str(tmp / "jax_cache"), **train},
    }  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(run dir, held-out document file, config dict): a 2-step run with two eval tasks."""
    tmp = tmp_path_factory.mktemp("evaluate")
    (tmp / "docs").mkdir()
    for i in range(DOCS):
        (tmp / "docs" / f"doc{i}.txt").write_text(doc_text(i))
    held_out = tmp / "docs" / f"doc{split_documents(DOCS, 1 / DOCS)[1][0]}.txt"
    quiz = write_choice(tmp / "quiz.jsonl", [(c, ch, 0) for c, ch in QUIZ])
    tasks = [f"heldout=perplexity:{held_out}", f"choice:{quiz}"]
    raw = raw_config(tmp, eval_tasks=tasks)
    run(make_config(raw))
    return tmp / "runs" / "r", held_out, raw


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tiny):
    """The fixture run's compilation cache for this module's `kiln eval` calls too: each call
    builds the same programs, which the first compiles and the others read back."""
    with compilation_cache_for(make_config(tiny[2])):
        yield


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_perplexity_is_exp_of_the_held_out_loss(tiny, tmp_path, capsys):
    run_dir, held_out, _ = tiny
    logged = next(r for r in rows(run_dir) if "eval/loss" in r)
    assert logged["step"] == 2
    cross_entropy = logged["eval/loss"] - logged["eval/z_loss"]  # eval/loss holds the z-term
    out = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), f"perplexity:{held_out}", "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["step"] == 2
    task = result["tasks"][held_out.stem]
    assert task["perplexity"] == pytest.approx(math.exp(cross_entropy), rel=F32)
    assert task["perplexity"] == pytest.approx(logged["eval/perplexity"], rel=F32)
    # The same during training: the task beside the held-out loss, logged as eval/<task>/<metric>.
    assert logged["eval/heldout/loss"] == pytest.approx(cross_entropy, rel=F32)
    assert logged["eval/heldout/perplexity"] == pytest.approx(task["perplexity"], rel=F32)
    # Byte tokenizer, one document: every byte but the first is a target, and so is its EOS,
    # so targets = bytes and bits per byte = loss / ln 2.
    assert task["tokens"] == task["bytes"] == len(held_out.read_bytes())
    assert task["bits_per_byte"] == pytest.approx(task["loss"] / math.log(2), rel=1e-12)
    assert "perplexity" in shown and "bits_per_byte" in shown


def test_bits_per_byte_counts_document_bytes(tiny, tmp_path, capsys):
    """Several documents (JSONL): bpb = total NLL / ln 2 / UTF-8 bytes, targets = bytes + docs - 1."""
    run_dir, _, _ = tiny
    docs = ["kiln fires clay at high heat", "glaze é pot"]  # é is two bytes
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "e.json"
    assert (
        main(["eval", str(run_dir), f"perplexity:{tmp_path / 'd.jsonl'}", "--out", str(out)]) == 0
    )
    task = json.loads(out.read_text())["tasks"]["d"]
    num_bytes = sum(len(d.encode()) for d in docs)
    assert task["bytes"] == num_bytes and task["tokens"] == num_bytes + len(docs) - 1
    nll = task["loss"] * task["tokens"]
    assert task["bits_per_byte"] == pytest.approx(nll / math.log(2) / num_bytes, rel=1e-12)


def trained_model(run_dir: Path, raw: dict):
    """The fixture run's model at step 2 on one device (restored as `kiln export-hf` does)."""
    config = make_config(raw)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = abstract_state(config.model)
    target = abstract_like(abstract, jax.tree.map(lambda _: cpu, abstract))
    params, _, _ = restore_params(run_dir / "checkpoints" / "2", target)
    model = build_model(config.model, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    return model


def hand_logliks(model, questions) -> list[list[float]]:
    """Sum of log p(choice bytes | EOS, context bytes) per choice, numpy float64 from logits.

    Each sequence is padded at its end to model.max_seq_len (32) with segment 1 throughout:
    attention is causal, so the logits of its own positions are those of the unpadded sequence.
    """
    seqs = [(c, ch) for c, choices in questions for ch in choices]
    tokens = np.zeros((len(seqs), 32), np.int32)
    for i, (c, ch) in enumerate(seqs):
        row = [257, *c.encode(), *ch.encode()]  # 257 = the byte tokenizer's EOS
        tokens[i, : len(row)] = row
    positions = np.broadcast_to(np.arange(32), tokens.shape)
    forward = jax.jit(lambda t: model.logits(model.hidden_states(t, positions, t * 0 + 1).hidden))
    logits = np.asarray(forward(tokens), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    out = []
    for i, (c, ch) in enumerate(seqs):
        start, end = 1 + len(c.encode()), 1 + len(c.encode()) + len(ch.encode())
        # logp at position j predicts token j + 1: the choice's tokens are start .. end - 1.
        out.append(float(sum(logp[i, j - 1, tokens[i, j]] for j in range(start, end))))
    it = iter(out)
    return [[next(it) for _ in choices] for _, choices in questions]


def test_choice_accuracy_equals_a_hand_computation(tiny, tmp_path, capsys):
    run_dir, _, raw = tiny
    questions = [
        ("The kiln fires", [" clay", " heat", " zebra"]),
        ("def f(x):\n    return", [" x", " x + 1", " é"]),
        ("glaze", [" pot", "d pots", " at high heat", "!"]),
        ("", ["kiln", "clay"]),  # empty context: the choice follows EOS alone
    ]
    ll = hand_logliks(trained_model(run_dir, raw), questions)
    # Gold: the likeliest choice for two questions, the least likely for the other two.
    golds = [
        int(np.argmax(ll[0])),
        int(np.argmax(ll[1])),
        int(np.argmin(ll[2])),
        int(np.argmin(ll[3])),
    ]
    path = write_choice(
        tmp_path / "four.jsonl", [(c, ch, g) for (c, ch), g in zip(questions, golds)]
    )
    norm = [
        int(np.argmax(np.asarray(q) / [len(c.encode()) for c in ch])) == g
        for q, (_, ch), g in zip(ll, questions, golds)
    ]
    out = tmp_path / "e.json"
    assert main(["eval", str(run_dir), f"choice:{path}", "--out", str(out)]) == 0
    task = json.loads(out.read_text())["tasks"]["four"]
    assert task["questions"] == 4
    assert task["acc"] == 0.5
    assert task["acc_norm"] == sum(norm) / 4


def test_tensorboard_and_compare_show_eval_tasks(tiny, tmp_path, capsys):
    run_dir, _, _ = tiny
    quiz = write_choice(tmp_path / "quiz2.jsonl", [(c, ch, 1) for c, ch in QUIZ])
    args = [
        "eval",
        str(run_dir),
        f"choice:{quiz}",
        "--tensorboard",
        "--out",
        str(tmp_path / "e.json"),
    ]
    assert main(args) == 0
    events = read_events(run_dir / "tensorboard")
    steps, values = events["eval/quiz2/acc"]
    result = json.loads((tmp_path / "e.json").read_text())["tasks"]["quiz2"]
    assert list(steps) == [2] and values[-1] == pytest.approx(result["acc"])
    # The in-training task of the fixture is in metrics.jsonl, so `kiln compare` draws it.
    runs = load_runs([run_dir], ["eval/quiz/acc", "eval/heldout/bits_per_byte"])
    assert list(runs["r"]["eval/quiz/acc"][0]) == [2]
    fig = main(
        ["compare", str(run_dir), "--metrics", "eval/quiz/acc", "--out", str(tmp_path / "c.png")]
    )
    assert fig == 0 and (tmp_path / "c.png").is_file()


def test_training_losses_do_not_change_with_eval_tasks(tiny, tmp_path):
    run_dir, _, raw = tiny
    plain = {**raw, "train": {**raw["train"], "eval_tasks": [], "output_dir": str(tmp_path)}}
    run(make_config(plain))
    with_tasks = [r["learning/loss"] for r in rows(run_dir) if "learning/loss" in r]
    without = [r["learning/loss"] for r in rows(tmp_path / "r") if "learning/loss" in r]
    assert with_tasks == without and len(without) == 2  # bitwise


def test_task_names():
    assert parse_task("choice:data/q.jsonl").name == "q"
    assert parse_task("mine=perplexity:stdlib:**/*.py").name == "mine"
    assert default_name("stdlib:**/*.py") == "stdlib"
    assert default_name("kiln:stdlib_next_line.jsonl") == "stdlib_next_line"
    assert default_name("corpus/*.txt") == "corpus"
    with pytest.raises(KilnError, match="both named 'q'"):
        parse_tasks(["choice:a/q.jsonl", "perplexity:b/q.txt"])


BAD_LINES = {
    "malformed": ('{"context": "a", "choices": ["b", "c"], "gold": 0}\n{"context": ', ":2: invalid JSON"),
    "gold": ('{"context": "a", "choices": ["b", "c"], "gold": 2}\n', ":1: gold 2 is out of range"),
}  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        "kind",
        "missing",
        "malformed",
        "gold",
        "no_checkpoints",
        "missing_perplexity",
        "fifo_choice",
        "fifo_perplexity",
        "unwritable_out",
    ],
)
def test_bad_input_exits_2_with_one_line(tiny, tmp_path, capsys, case):
    run_dir, _, _ = tiny
    needle = {
        "kind": "unknown task kind 'mcq'",
        "missing": "nope.jsonl",
        "no_checkpoints": "no checkpoints/ directory",
        "missing_perplexity": "matches no files",
    }.get(case)
    task = f"choice:{tmp_path / 'nope.jsonl'}"
    if case == "kind":
        task = "mcq:x.jsonl"
    elif case == "missing_perplexity":
        task = f"perplexity:{tmp_path / 'none' / '*.txt'}"
    elif case.startswith("fifo"):
        # A named pipe nobody writes to: reading it would block forever.
        os.mkfifo(tmp_path / "pipe.jsonl")
        kind = case.removeprefix("fifo_")
        task, needle = f"{kind}:{tmp_path / 'pipe.jsonl'}", "pipe.jsonl' is not a regular file"
    elif case in BAD_LINES:
        text, needle = BAD_LINES[case]
        (tmp_path / "bad.jsonl").write_text(text)
        task, needle = f"choice:{tmp_path / 'bad.jsonl'}", f"bad.jsonl{needle}"
    elif case == "no_checkpoints":
        bare = tmp_path / "bare"
        bare.mkdir()
        (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
        run_dir = bare
        task = f"choice:{write_choice(tmp_path / 'ok.jsonl', [('a', ['b', 'c'], 0)])}"
    out = tmp_path / "eval.json"
    if case == "unwritable_out":  # refused before any task is read or scored
        (tmp_path / "file").write_text("")
        out, needle = tmp_path / "file" / "eval.json", "--out:"
        task = f"choice:{write_choice(tmp_path / 'ok.jsonl', [('a', ['b', 'c'], 0)])}"
    code = main(["eval", str(run_dir), task, "--out", str(out)])
    err = capsys.readouterr().err
    proc = subprocess.CompletedProcess([], code, "", err)
    assert_user_error(proc, needle)
    assert not out.exists()


def test_bad_task_in_the_cli_as_a_user_sees_it(tiny):
    run_dir, _, _ = tiny
    assert_user_error(kiln("eval", run_dir, "choice:/no/such/file.jsonl"), "/no/such/file.jsonl")


def test_the_bundled_task_parses(tmp_path):
    from kiln.data.eval_tasks import load_choice
    from kiln.data.tokenizers import ByteTokenizer

    task = load_choice(parse_task("choice:kiln:stdlib_next_line.jsonl"), ByteTokenizer(), 384, 256)
    assert len(task.gold) == 100 and set(task.num_choices) == {4}
    assert max(len(r) for r in task.rows) <= 257
    assert jax.device_count() == 8


def test_train_refuses_bad_eval_tasks_before_writing(tiny, tmp_path, capsys):
    _, _, raw = tiny
    bad_kind = {**raw, "train": {**raw["train"], "eval_tasks": ["mcq:x.jsonl"]}}
    with pytest.raises(KilnError, match=r"train.eval_tasks: .*unknown task kind 'mcq'"):
        make_config(bad_kind)
    missing = tmp_path / "none.jsonl"
    train = {**raw["train"], "eval_tasks": [f"choice:{missing}"], "output_dir": str(tmp_path)}
    (tmp_path / "c.yaml").write_text(json.dumps({**raw, "train": train}))
    code = main(["train", str(tmp_path / "c.yaml")])
    proc = subprocess.CompletedProcess([], code, "", capsys.readouterr().err)
    assert_user_error(proc, str(missing))
    assert not (tmp_path / "r").exists()
    # A FIFO as an in-training task is refused too, before anything is written.
    os.mkfifo(tmp_path / "pipe.txt")
    train["eval_tasks"] = [f"perplexity:{tmp_path / 'pipe.txt'}"]
    (tmp_path / "c.yaml").write_text(json.dumps({**raw, "train": train}))
    code = main(["train", str(tmp_path / "c.yaml")])
    proc = subprocess.CompletedProcess([], code, "", capsys.readouterr().err)
    assert_user_error(proc, "pipe.txt' is not a regular file")
    assert not (tmp_path / "r").exists()
