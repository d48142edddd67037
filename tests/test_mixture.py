"""Weighted mixtures (data.sources): proportions, process layout, resume, per-source eval, errors."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, assert_user_error, kiln_main, make_config, write_config
from kiln.commands.compare import expand_metrics
from kiln.config import config_from_dict, load_config
from kiln.data import make_datasets
from kiln.errors import KilnError
from kiln.training.console import step_line

KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")
SEQ = 16


def write_docs(root: Path, letters: str, sizes: list[int]) -> Path:
    """Text files of the 3 `letters` only: any row of a batch says which source it came from."""
    root.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(sizes):
        # Counting in base 3 with the source's letters: rows of one source mostly differ.
        count = "".join(letters[int(c)] for j in range(i, i + n) for c in np.base_repr(j, 3))
        (root / f"d{i:02d}.txt").write_text(count[:n])
    return root


@pytest.fixture
def corpora(tmp_path: Path) -> dict[str, Path]:
    """Three sources of different sizes: 'a' (A-C), 'b' (D-F), 'c' (G-I, the smallest)."""
    return {
        "a": write_docs(tmp_path / "a", "ABC", [300, 41, 170, 88, 9, 260]),
        "b": write_docs(tmp_path / "b", "DEF", [120, 75, 33, 210]),
        "c": write_docs(tmp_path / "c", "GHI", [50, 27, 19]),
    }


def mixture(corpora, weights, **extra) -> list[dict]:
    return [
        {"name": n, "source": "text", "paths": [str(corpora[n])], "weight": w, **extra}
        for n, w in zip(("a", "b", "c"), weights)
    ]


def cfg(tmp_path, sources=None, *, batch=8, processes=1, process_id=0, train=None, **data):
    data = {"seq_len": SEQ, "cache_dir": str(tmp_path / "cache"), **data}
    if sources is not None:
        data["sources"] = sources
    return make_config(
        data=data,
        model={"vocab_size": 384},
        train={"global_batch_size": batch, **(train or {})},
        distributed={"num_processes": processes, "process_id": process_id},
        output_dir=tmp_path / "runs",
    )


def source_of(row) -> str:
    """'a', 'b' or 'c' from the letters of a row's real tokens (EOS and padding aside)."""
    found = {"abc"[(int(t) - 65) // 3] for t in row if 65 <= t < 74}
    assert len(found) == 1, row  # a window never mixes sources
    return found.pop()


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (7, 1, 2.5)])
def test_realised_proportions_match_the_weights_and_each_source_repeats(tmp_path, corpora, weights):
    ds = make_datasets(cfg(tmp_path, mixture(corpora, weights), batch=100))
    rows = [r for b in take(ds.train_iterator(), 100) for r in b["inputs"]]
    counts = collections.Counter(source_of(r) for r in rows)
    assert sum(counts.values()) == 10_000
    for name, w in zip("abc", weights):
        # Within 2% (absolute) of its weight's share over 10,000 sequences.
        assert abs(counts[name] / 10_000 - w / sum(weights)) < 0.02, (counts, weights)
    # Each source is read in epochs of its own: the smallest, 'c', many times over; its rows,
    # in order, are whole epochs (every window once) and then part of the next one.
    by_source = collections.defaultdict(list)
    for r in rows:
        by_source[source_of(r)].append(tuple(r))
    for name, part in zip("abc", ds.parts):
        n = part.train.num_windows
        every = collections.Counter(map(tuple, part.train.batch(np.arange(n))["inputs"]))
        read = by_source[name]
        epochs = len(read) // n
        assert collections.Counter(read[: epochs * n]) == collections.Counter(
            {row: k * epochs for row, k in every.items()}
        )
        assert collections.Counter(read[epochs * n :]) <= every
    assert len(by_source["c"]) // ds.parts[2].train.num_windows > 10


def test_one_entry_reads_what_the_shorthand_reads(tmp_path, corpora):
    single = {"source": "text", "paths": [str(corpora["b"])], "eval_fraction": 0.25}
    short = make_datasets(cfg(tmp_path, batch=4, **single))
    entry = make_datasets(cfg(tmp_path, [{**single, "name": "b", "weight": 3.0}], batch=4))
    n = short.train.num_windows
    assert entry.parts[0].train.num_windows == n and n % 4 == 0  # epochs end on batches
    for epoch in range(2):  # a small source: the same windows, each once per epoch
        got, want = (
            collections.Counter(map(tuple, np.concatenate([b["inputs"] for b in batches])))
            for batches in (
                take(entry.train_iterator(), (epoch + 1) * n // 4)[epoch * n // 4 :],
                take(short.train_iterator(), (epoch + 1) * n // 4)[epoch * n // 4 :],
            )
        )
        assert got == want and max(got.values()) == 1
    assert_same_batches(short.eval_batches(2), entry.eval_sets(2)["b"])


def test_resume_restores_every_source_and_the_schedule(tmp_path, corpora):
    config = cfg(tmp_path, mixture(corpora, (0.5, 0.3, 0.2)))
    it = make_datasets(config).train_iterator()
    take(it, 11)  # past the first epoch of 'c'
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 9)
    resumed = make_datasets(config).train_iterator()
    resumed.set_state(state)
    assert_same_batches(take(resumed, 9), expected)


@pytest.mark.parametrize("processes", [2, 4])
def test_global_batches_do_not_depend_on_the_process_count(tmp_path, corpora, processes):
    sources = mixture(corpora, (0.5, 0.3, 0.2))
    whole = take(make_datasets(cfg(tmp_path, sources)).train_iterator(), 6)
    k = 8 // processes
    for p in range(processes):
        local = cfg(tmp_path, sources, processes=processes, process_id=p)
        for step, batch in enumerate(take(make_datasets(local).train_iterator(), 6)):
            for key in KEYS:
                np.testing.assert_array_equal(batch[key], whole[step][key][p * k : (p + 1) * k])


def test_zero_weight_is_evaluated_but_never_trained(tmp_path, corpora):
    ds = make_datasets(
        cfg(tmp_path, mixture(corpora, (1, 1, 0), eval_fraction=0.3), train={"eval_every_steps": 5})
    )
    trained = {source_of(r) for b in take(ds.train_iterator(), 20) for r in b["inputs"]}
    assert trained == {"a", "b"}
    sets = ds.eval_sets(2)
    assert list(sets) == ["a", "b", "c"]
    for name, batches in sets.items():
        real = [r for b in batches for r, w in zip(b["inputs"], b["weights"]) if w.any()]
        assert {source_of(r) for r in real} == {name}
    # eval/loss: the per-token losses of the sources weighted by their shares (c's is 0).
    by_source = {
        "a": {"eval/loss": 2.0, "eval/z_loss": 0.1},
        "b": {"eval/loss": 3.0, "eval/z_loss": 0.3},
        "c": {"eval/loss": 9.0, "eval/z_loss": 0.5},
    }
    got = ds.combine_eval(by_source)
    assert got["eval/loss"] == pytest.approx(2.5, rel=1e-12)  # (2 + 3) / 2, float64 sums
    assert got["eval/z_loss"] == pytest.approx(0.2, rel=1e-12)
    assert got["eval/perplexity"] == pytest.approx(math.exp(2.3), rel=1e-12)
    assert {k: got[f"eval/loss/{k}"] for k in "abc"} == {"a": 2.0, "b": 3.0, "c": 9.0}
    assert step_line(5, 10, got).endswith("a 2.0000  b 3.0000  c 9.0000")


def test_a_file_held_out_by_one_source_cannot_train_another(tmp_path, corpora):
    sources = mixture(corpora, (1, 1, 1))
    sources[2]["eval_paths"] = [str(corpora["a"] / "d01.txt")]
    with pytest.raises(KilnError, match=r"data\.sources\.2\.eval_paths: .*d01\.txt is also in "):
        make_datasets(cfg(tmp_path, sources))


def entry(**fields):
    return {"name": "web", "source": "synthetic", "weight": 1.0, **fields}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"sources": [entry(weight=-0.5)]}, "data.sources.0.weight: got -0.5; "),
        ({"sources": [entry(weight=0), entry(name="x", weight=0.0)]}, "sum to 0.0; allowed:"),
        (
            {"sources": [entry(weight="lots")]},
            "data.sources.0.weight: got 'lots'; Input should be a valid number",
        ),
        (
            {"sources": [entry(weight="1e-3"), entry(name="x", weight=-1)]},
            "sources.1.weight: got -1;",
        ),
        ({"sources": [entry(weight=True)]}, "data.sources.0.weight: got True; allowed: a number"),
        ({"sources": [entry(weight=float("nan"))]}, "data.sources.0.weight: got nan;"),
        ({"sources": [entry(weight=1e308), entry(name="x", weight=1e308)]}, "a finite sum"),
        ({"sources": [entry(), entry()]}, "data.sources.1.name: 'web' is also the name of"),
        ({"sources": [entry(name="web text")]}, "data.sources.0.name: 'web text'; allowed: 1"),
        ({"sources": [entry(name="")]}, "data.sources.0.name: ''; allowed:"),
        ({"sources": [entry(source="none")]}, "data.sources.0.source: 'none'; allowed: synth"),
        ({"sources": [{"name": "web", "source": "text"}]}, "data.sources.0.weight: got "),
        ({"sources": [entry()], "paths": ["x"]}, "data.paths: set together with data.sources"),
        ({"sources": [entry(eval_paths=["e"])]}, "data.sources.0.eval_paths: ['e'] given, but"),
    ],
)
def test_bad_mixtures_name_field_value_and_allowed(data, message):
    with pytest.raises(KilnError) as err:
        config_from_dict({"data": data})
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_a_resolved_mixture_config_reads_back(tmp_path):
    config = config_from_dict({"data": {"sources": [entry(), entry(name="code", weight=2)]}})
    assert config_from_dict(yaml.safe_load(config.to_yaml())) == config


# What a user writes to mix a source into the shipped tiny run: no data.source or data.paths.
ON_TINY = """\
base_config: {tiny}
data:
  sources:
    - {{name: stdlib, source: text, paths: ["stdlib:json/*.py"], weight: 0.9}}
    - {{name: noise, source: synthetic, weight: 0.1}}
train:
  output_dir: {runs}
"""


def test_a_mixture_replaces_the_single_source_of_its_base_config(tmp_path):
    tiny = REPO / "configs" / "tiny.yaml"
    top = tmp_path / "mix.yaml"
    top.write_text(ON_TINY.format(tiny=tiny, runs=tmp_path / "runs"))
    config = load_config(top)
    # tiny.yaml's data.source: text and data.paths are replaced; its seq_len stays.
    assert (config.data.source, config.data.paths, config.data.seq_len) == ("synthetic", [], 128)
    assert [(s.name, s.source, s.paths) for s in config.data.sources] == [
        ("stdlib", "text", ["stdlib:json/*.py"]),
        ("noise", "synthetic", []),
    ]
    explained = kiln_main("config", top, "--explain")
    assert explained.returncode == 0, explained.stderr
    replaced = f"# default (data.sources of {top} replaces data.paths of {tiny})"
    assert replaced in explained.stdout
    # The same mixture given on the command line replaces them too.
    sources = json.dumps(
        [s.model_dump(include={"name", "source", "paths", "weight"}) for s in config.data.sources]
    )
    assert load_config(tiny, [f"data.sources={sources}"]).data == config.data
    # It builds: a step of the mixture, each source with its held-out loss.
    proc = kiln_main(
        "train",
        top,
        "train.steps=2",
        "optim.warmup_steps=0",
        "train.eval_every_steps=2",
        "train.eval_tasks=[]",
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs/tiny/metrics.jsonl").open()]
    assert {"eval/loss/stdlib", "eval/loss/noise"} <= set(rows[-1])
    # Both in one file are still refused: which one was meant is not known.
    both = tmp_path / "both.yaml"
    both.write_text(top.read_text().replace("data:\n", "data:\n  paths: [x]\n"))
    with pytest.raises(KilnError, match=r"^data\.paths: set together with data\.sources"):
        load_config(both)


def test_cli_refuses_a_bad_weight_in_one_line_and_writes_nothing(tmp_path):
    config = write_config(
        tmp_path / "c.yaml",
        data={"sources": [entry(), entry(name="code", weight=-1)]},
        train={"output_dir": str(tmp_path / "runs")},
    )
    proc = kiln_main("train", config)
    assert_user_error(proc, "data.sources.1.weight: got -1", "greater than or equal to 0")
    assert not (tmp_path / "runs").exists()


def test_compare_expands_a_pattern_to_every_source(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": 5, "eval/loss": 2.0, "eval/loss/web": 1.5, "eval/loss/code": 2.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = expand_metrics([run], ["eval/loss", "eval/loss/*"])
    assert got == ["eval/loss", "eval/loss/code", "eval/loss/web"]
    with pytest.raises(KilnError, match=r"--metrics: no metric of .* matches 'x/\*'; available"):
        expand_metrics([run], ["x/*"])
    proc = kiln_main("compare", run, "--metrics", "eval/loss/*", "--out", tmp_path / "p.png")
    assert proc.returncode == 0, proc.stderr
    assert "eval/loss/code" in proc.stdout and (tmp_path / "p.png").is_file()


# ---------------------------------------------------------------------------------------------
# End to end: `kiln train` on a 3-source mixture, killed and resumed, and on two processes


def run_config(tmp: Path, corpus: Path, cache: Path) -> Path:
    """Prose (text files), the json package's code (text) and a Markov chain (synthetic)."""
    sources = [
        {
            "name": "prose",
            "source": "text",
            "paths": [str(corpus / "*.txt")],
            "weight": 0.5,
            "eval_fraction": 0.1,
        },
        {
            "name": "code",
            "source": "text",
            "paths": ["stdlib:json/*.py"],
            "weight": 0.3,
            "eval_fraction": 0.2,
        },
        {"name": "markov", "source": "synthetic", "weight": 0.2},
    ]
    cfg = {
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 2, "num_heads": 4, "d_ff": 64, "max_seq_len": 32, "dtype": "float32"},
        "data": {"sources": sources, "seq_len": 32, "cache_dir": str(cache)},
        "mesh": {"fsdp": -1},
        "optim": {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        "train": {"output_dir": str(tmp / "runs"), "run_name": "r", "global_batch_size": 8, "log_every_steps": 1, "steps": 12, "eval_every_steps": 6, "eval_batches": 1},
        "checkpoint": {"every_steps": 3, "keep": 2},
        "distributed": {"init_timeout_s": 120, "heartbeat_timeout_s": 30},
    }  # fmt: skip
    return write_config(tmp / "config.yaml", cfg)


def rows_by_step(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], {}).update(row)
    return out


SOURCES = ("prose", "code", "markov")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """12 uninterrupted steps of the mixture: what the interrupted runs must reproduce."""
    from test_checkpoint import WORDS

    root = tmp_path_factory.mktemp("mixture")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(30):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, rng.integers(20, 90))))
    config = run_config(root, corpus, root / "cache")
    proc = kiln_main("train", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/loss" in proc.stdout and "prose " in proc.stdout  # per-source eval printed
    return root, corpus, rows_by_step(root / "runs" / "r")


@pytest.mark.slow
def test_kill_9_mid_run_resumes_with_the_same_batches_and_losses(tmp_path, straight):
    from kiln.config import load_config
    from test_checkpoint import assert_bitwise, final_params, kill_9_after_step_5

    root, corpus, want = straight
    config = run_config(tmp_path, corpus, root / "cache")
    run_dir = tmp_path / "runs" / "r"
    complete = kill_9_after_step_5(config, run_dir, "checkpoint.every_steps=1")

    # The data state saved at `complete` continues with the straight run's next batches.
    mixture_config = load_config(config)
    data_state = json.loads(
        (run_dir / "checkpoints" / str(complete) / "data" / "metadata").read_text()
    )
    resumed_it = make_datasets(mixture_config).train_iterator()
    resumed_it.set_state(data_state)
    straight_it = make_datasets(mixture_config).train_iterator()
    assert_same_batches(take(resumed_it, 12 - complete), take(straight_it, 12)[complete:])

    proc = kiln_main("train", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from step {complete}" in proc.stderr
    got = rows_by_step(run_dir)
    for step in range(complete + 1, 13):
        assert got[step]["learning/loss"] == want[step]["learning/loss"], step  # bitwise
    tags = ["eval/loss", *(f"eval/loss/{n}" for n in SOURCES)]
    assert {t: got[12][t] for t in tags} == {t: want[12][t] for t in tags}  # bitwise
    assert_bitwise(final_params(config), final_params(run_config(root, corpus, root / "cache")))


# Each process one stage of 2: 2 layers, 2 pipeline micro-batches (the accumulation's).
STAGES = ("mesh.stage=2", "mesh.fsdp=2", "train.gradient_accumulation_steps=2")


@pytest.mark.slow
def test_two_processes_of_two_devices_train_on_the_same_global_batches(tmp_path, straight):
    """Against the straight run on 8 devices: 2 devices a process make fewer ranks for gloo's
    collectives between the processes, and a mesh of another size reads the same batches. The
    two processes are two pipeline stages (stage 2 x fsdp 2, as stages on two pods would be),
    each reading its own rows of every global batch: the batch is split over `stage` outside
    the stages (docs/pipeline.md)."""
    import sys

    from conftest import REPO, kiln_env, run_process

    root, corpus, want = straight
    config = run_config(tmp_path, corpus, root / "cache")
    launch = ["bash", str(REPO / "scripts" / "launch_local.sh"), "--devices-per-process", "2", "2"]
    two = run_process(
        [*launch, str(config), "train.steps=4", "train.eval_every_steps=0", *STAGES],
        env=kiln_env(PYTHON=sys.executable),
    )
    assert two.returncode == 0, two.stderr[-3000:]
    got = rows_by_step(tmp_path / "runs" / "r")
    assert sorted(s for s in got if "learning/loss" in got[s]) == list(range(1, 5))
    for step in range(1, 5):
        # 1e-5 relative: the same batches and arithmetic; only the order of the sums across
        # the devices, the two processes and the pipeline's two micro-batches may differ (as
        # in test_multihost and tests/test_pipeline.py).
        assert got[step]["learning/loss"] == pytest.approx(want[step]["learning/loss"], rel=1e-5)
