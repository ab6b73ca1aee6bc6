"""`cluster drafters ...`: validate, build data, train, export and evaluate EAGLE drafters."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.help import DefaultsHelpFormatter
from cluster.models import cache_dir

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"


def resolve_target(target: str) -> Path:
    """A checkpoint directory, or an `embedded:` model (prepared on first use)."""
    from cluster.models import EMBEDDED_SOURCE_PREFIX

    if target.startswith(EMBEDDED_SOURCE_PREFIX):
        from cluster.models import embedded_name, prepare_embedded

        return prepare_embedded(embedded_name(target), quiet=True)
    return Path(target)


def _default_data_dir(split: str) -> Path:
    return cache_dir() / "drafter-data" / "smollm2-135m-instruct" / split


def _cmd_validate(args: argparse.Namespace) -> int:
    from cluster.drafters import spec

    target = resolve_target(args.target)
    problems = spec.validate(Path(args.drafter), spec.read_target_config(target))
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    drafter = spec.DrafterSpec.read(Path(args.drafter))
    print(
        f"{args.drafter}: ok: {drafter.variant}, draft vocab {drafter.draft_vocab_size}, "
        f"aux layers {drafter.eagle_aux_hidden_state_layer_ids}"
    )
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from cluster.drafters import data

    target = resolve_target(args.target)
    recipe = data.DataRecipe(
        code_long_contexts=args.contexts,
        code_long_per_context=args.per_context,
        chat_short=args.chat,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    sets = [("train", args.out, 1)]
    if args.val_fraction > 0:  # a further training set reuses the first one's validation set
        sets.insert(0, ("eval", args.val_out, args.val_fraction))
    for split, out, fraction in sets:
        data.generate(target, Path(out), recipe.scaled(fraction), split, args.batch_size)
    for _, out, _ in sets:
        data.capture(target, Path(out))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from cluster.drafters.train import TrainConfig, train

    cfg = TrainConfig(
        variant=args.variant,
        steps=args.steps,
        ttt_steps=args.ttt_steps,
        tokens_per_step=args.tokens_per_step,
        max_sample_tokens=args.max_sample_tokens,
        prompt_context_tokens=args.prompt_context_tokens,
        prompt_loss_weight=args.prompt_loss_weight,
        draft_vocab_size=args.draft_vocab_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        threads=args.threads,
        checkpoint_every=args.checkpoint_every,
        val_samples=args.val_samples,
        init_from=args.init_from,
    )
    datasets = [Path(d) for d in args.data or [_default_data_dir("train")]]
    metrics = train(resolve_target(args.target), datasets, Path(args.val), Path(args.out), cfg)
    print(f"{args.out}: {metrics}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from cluster.drafters.export import ExportError, export

    try:
        path = export(Path(args.run), resolve_target(args.target), Path(args.out))
    except ExportError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"exported: {path}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from cluster.drafters import evaluate

    drafters = {}
    for item in args.drafter:
        name, sep, path = item.partition("=")
        if not sep:
            print(f"--drafter {item!r}: expected NAME=PATH", file=sys.stderr)
            return 2
        drafters[name] = Path(path)
    report = evaluate.evaluate(
        resolve_target(args.target),
        evaluate.methods(drafters, args.k, ngram=not args.no_ngram),
        per_bucket=args.requests,
        max_context=args.max_context,
        output_tokens=args.output_tokens,
        cores=args.cores,
        dtype=args.dtype,
        ignore_eos=args.ignore_eos,
    )
    evaluate.write_report(report, Path(args.out), Path(args.plot) if args.plot else None)
    if args.write_drafter_metrics:
        evaluate.write_drafter_metrics(report, drafters)
    print(evaluate.markdown(report))
    written = [args.out, str(Path(args.out).with_suffix(".md"))] + (
        [args.plot] if args.plot else []
    )
    print(f"wrote {', '.join(written)}")
    return 0


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=EMBEDDED_TARGET, help=f"target checkpoint dir or {EMBEDDED_TARGET}"
    )


def add_commands(commands: argparse._SubParsersAction) -> None:
    from cluster.drafters.data import DataRecipe

    drafters = commands.add_parser(
        "drafters",
        help="EAGLE 3 / 3.1 drafters: validate, build training data, train, export, evaluate",
    )
    actions = drafters.add_subparsers(dest="drafters_command", required=True, metavar="ACTION")

    validate = actions.add_parser(
        "validate",
        help="check a drafter against its target before deploying it (one line per problem)",
    )
    validate.add_argument("target", metavar="TARGET", help=f"checkpoint dir or {EMBEDDED_TARGET}")
    validate.add_argument("drafter", metavar="DRAFTER", help="drafter directory")
    validate.set_defaults(func=_cmd_validate)

    data = actions.add_parser(
        "data",
        help="self-distillation data: the target answers prompts built from stdlib code "
        "(vLLM), then its hidden states are captured (resumable)",
        formatter_class=DefaultsHelpFormatter,
    )
    _add_target(data)
    data.add_argument("--out", default=str(_default_data_dir("train")), help="training set dir")
    data.add_argument(
        "--val-out", default=str(_default_data_dir("val")), help="validation set dir (eval files)"
    )
    defaults = DataRecipe()
    data.add_argument(
        "--contexts",
        type=lambda text: tuple(int(part) for part in text.split(",")),
        default=defaults.code_long_contexts,
        help="code tokens of the continuation prompts (comma-separated)",
    )
    data.add_argument(
        "--per-context", type=int, default=defaults.code_long_per_context,
        help="continuation prompts per context length",
    )  # fmt: skip
    data.add_argument("--chat", type=int, default=defaults.chat_short, help="instruction prompts")
    data.add_argument(
        "--output-tokens", type=int, default=defaults.output_tokens, help="max response tokens"
    )
    data.add_argument(
        "--val-fraction",
        type=float,
        default=0.08,
        help="validation size relative to training (0: no validation set, for a further "
        "training set next to an existing one)",
    )
    data.add_argument("--batch-size", type=int, default=64, help="prompts per vLLM batch")
    data.add_argument(
        "--seed", type=int, default=0, help="seed of prompt sampling (another seed: other prompts)"
    )
    data.set_defaults(func=_cmd_data)

    train = actions.add_parser(
        "train",
        help="train a drafter (checkpoints every N steps; rerun to resume)",
        formatter_class=DefaultsHelpFormatter,
    )
    _add_target(train)
    train.add_argument(
        "--data",
        action="append",
        metavar="DIR",
        help=f"training set (repeatable: all are mixed; default {_default_data_dir('train')})",
    )
    train.add_argument(
        "--val", default=str(_default_data_dir("val")), help="validation set (`data --val-out`)"
    )
    train.add_argument("--out", required=True, help="run directory (checkpoint, history)")
    train.add_argument(
        "--variant",
        choices=("eagle3.1", "eagle3"),
        default="eagle3.1",
        help="eagle3.1 adds fc_norm and norm_output to the EAGLE 3 layout",
    )
    train.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    train.add_argument("--ttt-steps", type=int, default=5, help="draft steps unrolled")
    train.add_argument(
        "--tokens-per-step", type=int, default=4096, help="tokens accumulated per optimizer step"
    )
    train.add_argument(
        "--max-sample-tokens",
        type=int,
        default=2048,
        help="longer samples are cropped to a random window of this many tokens",
    )
    train.add_argument(
        "--prompt-context-tokens",
        type=int,
        default=512,
        help="prompt tokens kept before each response (0: all)",
    )
    train.add_argument(
        "--prompt-loss-weight",
        type=float,
        default=0.1,
        help="loss weight of prompt positions relative to response positions, in (0, 1]: "
        "the fraction of prompt positions each sample trains on",
    )
    train.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="tokens the drafter can propose (the most frequent in the training data)",
    )
    train.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    train.add_argument("--warmup-steps", type=int, default=40, help="linear warm-up steps")
    train.add_argument("--seed", type=int, default=0, help="seed of initialization, data order")
    train.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    train.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between checkpoints (and validation)",
    )
    train.add_argument(
        "--val-samples", type=int, default=48, help="held-out samples each validation uses"
    )
    train.add_argument(
        "--init-from",
        default="",
        metavar="DIR",
        help="continue from another run's weights and draft vocabulary, or from an exported "
        "drafter's (e.g. a shipped one); fresh optimizer, schedule and data order: for more "
        "data or more steps",
    )
    train.set_defaults(func=_cmd_train)

    export = actions.add_parser(
        "export", help="write a run's checkpoint in vLLM's LlamaForCausalLMEagle3 layout"
    )
    export.add_argument("run", metavar="RUN_DIR", help="training run directory (`train --out`)")
    _add_target(export)
    export.add_argument("--out", required=True, help="drafter directory to create")
    export.set_defaults(func=_cmd_export)

    evaluate = actions.add_parser(
        "eval",
        help="acceptance length and single-stream tok/s per context bucket: no speculation, "
        "n-gram and each drafter side by side (JSON + PNG)",
    )
    _add_target(evaluate)
    evaluate.add_argument(
        "--drafter", action="append", default=[], metavar="NAME=PATH", help="repeatable"
    )
    evaluate.add_argument("-k", type=int, default=5, help="speculative tokens (default 5)")
    evaluate.add_argument("--no-ngram", action="store_true", help="skip the n-gram baseline")
    evaluate.add_argument("--requests", type=int, default=6, help="requests per bucket")
    evaluate.add_argument(
        "--output-tokens", type=int, default=128, help="most tokens generated per request"
    )
    evaluate.add_argument(
        "--ignore-eos",
        action="store_true",
        help="always generate --output-tokens (as load benchmarks do); by default responses "
        "stop where the target stops, the text drafters are trained on and users get",
    )
    evaluate.add_argument(
        "--dtype",
        default="float32",
        help="engine dtype (bfloat16 only pays on CPUs with AMX or AVX-512 BF16)",
    )
    evaluate.add_argument(
        "--max-context",
        type=int,
        help="skip buckets with longer prompts (the 4k bucket is the slow one on a CPU)",
    )
    evaluate.add_argument(
        "--cores", default="0-1", help="CPU cores for vLLM (VLLM_CPU_OMP_THREADS_BIND)"
    )
    evaluate.add_argument(
        "--write-drafter-metrics",
        action="store_true",
        help="also write each drafter's results to DIR/metrics.json (shipped drafters)",
    )
    evaluate.add_argument(
        "--out", default="drafter-eval.json", help="results JSON (default %(default)s)"
    )
    evaluate.add_argument(
        "--plot", default="drafter-eval.png", help="acceptance and tok/s plot (default %(default)s)"
    )
    evaluate.set_defaults(func=_cmd_eval)
