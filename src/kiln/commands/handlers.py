"""What each `kiln` command does with its parsed arguments (kiln.cli parses them): each loads
what it needs lazily, so that `kiln --help` and bad input stay fast and start no JAX backend."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kiln.errors import KilnError, RunStopped


def _load(args: argparse.Namespace):
    from kiln.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    config = _load(args)
    from kiln.training.pretrain import run

    run(config, restart=args.restart, whole_process=args.whole_process)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    config = _load(args)
    from kiln.distill.run import run

    run(config, restart=args.restart, whole_process=args.whole_process)
    return 0


def cmd_teacher_logits(args: argparse.Namespace) -> int:
    config = _load(args)
    from kiln.distill.writer import run

    print(run(config, args.out, top_k=args.top_k, dtype=args.dtype, shard_steps=args.shard_steps))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from kiln import config as cfg

    if args.schema:
        print(format_schema(cfg.schema_rows(), args.format))
        return 0
    if args.config is None:
        raise KilnError("kiln config: give a CONFIG.yaml, or --schema to list every field")
    if args.explain:
        if args.summary:
            raise KilnError("kiln config: give --explain or --summary, not both")
        from kiln.config.explain import explain

        print(explain(args.config, args.overrides))
        return 0
    given = [f for f, v in (("--devices", args.devices), ("--topology", args.topology)) if v]
    given += ["--hbm-gb"] if args.hbm_gb is not None else []
    if given and not args.summary:
        raise KilnError(f"kiln config: {', '.join(given)} only apply with --summary")
    if args.summary:
        from kiln.commands import compile as aot
        from kiln.model import summary
        from kiln.training.optim import make_optimizer, state_name

        config = _load(args)
        # Devices before anything starts JAX's backend (simulated CPU devices are set first).
        devices = aot.summary_devices(config, args.devices, args.topology)
        report = aot.compile_report(config, devices)
        optimizer = make_optimizer(config.optim)
        print(summary(config, optimizer.init, state_name(config.optim), len(devices)))
        print(aot.summary_lines(report, args.hbm_gb))
        return 0
    config = _load(args)
    print(config.to_yaml(), end="")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from kiln.commands import compile as aot

    if args.fit and args.hbm_gb is None:
        raise KilnError("kiln compile --fit: give the memory per device to fit, --hbm-gb X")
    if args.fit_mesh is not None and not args.fit:
        raise KilnError("kiln compile --fit-mesh: only applies with --fit")
    if args.fit and args.peak_buffers:
        raise KilnError(
            f"kiln compile --peak-buffers {args.peak_buffers}: applies to one compile, not to "
            "--fit's search; compile the settings --fit prints with --peak-buffers"
        )
    mesh_axes: tuple[str, ...] = ()
    if args.fit_mesh is not None:
        from kiln.commands.fit import check_mesh_axes

        mesh_axes = check_mesh_axes(args.fit_mesh)
    # Devices first: simulated CPU devices must be set before JAX's backend starts.
    devices = aot.target_devices(args.devices, args.topology)
    config = _load(args)
    if args.fit:
        from kiln.commands.fit import fit, format_fit

        result = fit(config, devices, args.hbm_gb, mesh_axes)
        print(json.dumps(result.to_json()) if args.json else format_fit(result))
        if result.best is None:
            mesh = f", mesh split over {args.fit_mesh}" if args.fit_mesh else ""
            mesh += ", pipeline.repeats" if result.searches_repeats else ""
            raise RunStopped(
                f"no combination of model.remat, loss.num_vocab_tiling{mesh} and "
                f"train.gradient_accumulation_steps fits in --hbm-gb {args.hbm_gb:g} "
                f"({len(result.trials)} compiled); add devices or shrink the model or sequence"
            )
        return 0
    report = aot.compile_report(config, devices, args.peak_buffers)
    print(json.dumps(report.to_json()) if args.json else aot.format_report(report, args.config))
    aot.check_fits(report, args.hbm_gb, args.config)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from kiln.data.prepare import run_prepare

    print(
        run_prepare(
            args.input,
            args.format,
            args.field,
            args.tokenizer,
            args.output,
            args.workers,
            args.on_decode_error,
            args.record_format,
            args.chat_template,
        )
    )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kiln.commands.compare import (
        check_out,
        compare,
        expand_metrics,
        final_values,
        goodput_table,
        load_runs,
    )

    check_out(args.out)  # before any run is read
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    metrics = expand_metrics(args.run_dirs, metrics)  # eval/loss/*: every source of a mixture
    notes: list[str] = []
    compare(
        args.run_dirs, metrics, args.out, window=args.smooth, log_scale=args.log_scale, notes=notes
    )
    for note in notes:
        print(f"kiln: {note}", file=sys.stderr)
    print(final_values(load_runs(args.run_dirs, metrics), metrics, args.smooth))
    goodput = goodput_table(args.run_dirs)
    if goodput is not None:
        print(goodput)
    print(f"wrote {args.out}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from kiln.commands.hf import export_hf

    print(export_hf(args.run_dir, args.out, args.step))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.commands.generate import Sampling, read_prompts, run_generate

    if (args.prompt is None) == (args.prompts is None):
        raise KilnError("kiln generate: give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    texts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    print(
        run_generate(
            args.run_dir,
            texts,
            step=args.step,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            num_samples=args.num_samples,
            stop=args.stop,
            out=args.out,
        )
    )
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from kiln.commands.hf import import_hf

    print(import_hf(args.hf_dir, args.out))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from kiln.commands.evaluate import print_table, run_eval

    report = run_eval(
        args.run_dir, args.tasks, step=args.step, out=args.out, tensorboard=args.tensorboard
    )
    print_table(report)
    return 0


def format_schema(rows: Sequence[tuple[str, str, str, str]], fmt: str) -> str:
    """Every config field with type, default and description, as text or a markdown table."""
    if fmt == "markdown":
        out = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        out += [f"| `{n}` | `{t}` | `{d}` | {desc.replace('|', '/')} |" for n, t, d, desc in rows]
        return "\n".join(out)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{n:<{width}}  {t} = {d}\n{'':<{width}}  {desc}" for n, t, d, desc in rows)
