"""The `cluster` command line."""

from __future__ import annotations

import argparse
import json
import sys

from cluster.config import DEFAULT_CONFIG, ConfigError, load_config
from cluster.storage import StorageError


def _config_arg(parser: argparse.ArgumentParser, required: bool) -> None:
    kwargs = {} if required else {"nargs": "?", "default": None}
    parser.add_argument(
        "file",
        metavar="FILE",
        **kwargs,
        help=f"cluster YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)})"
        if not required
        else "cluster YAML",
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster.serve import serve_config

    return serve_config(load_config(args.file), address=args.address)


def _cmd_validate(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    pools = ", ".join(f"{p.name} ({p.role}, {p.speculation.method})" for p in config.pools)
    print(f"{args.file}: ok: {len(config.targets)} target(s); pools: {pools}")
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    import yaml

    from cluster.deployments.app import render

    rendered = render(load_config(args.file))
    if args.format == "json":
        print(json.dumps(rendered, indent=2))
    else:
        print(yaml.safe_dump(rendered, sort_keys=False), end="")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from cluster.models import prepare_config_models

    for path in prepare_config_models(load_config(args.config)):
        print(f"ready: {path}")
    return 0


def _cmd_render_kuberay(args: argparse.Namespace) -> int:
    from cluster.kuberay import dump_yaml_documents, manifests

    documents = manifests(
        load_config(args.file),
        image=args.image,
        name=args.name,
        service_account=args.service_account,
        efa_interfaces=args.efa_interfaces,
        memory_gib_per_gpu=args.memory_gib_per_gpu,
    )
    print(dump_yaml_documents(documents), end="")
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from cluster import storage

    client = storage.s3_client(args.endpoint_url, args.workers)
    manifest = storage.push(args.local_dir, args.uri, client=client, workers=args.workers)
    print(f"pushed {len(manifest)} files to {args.uri} (manifest {storage.MANIFEST})")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from cluster import storage

    client = storage.s3_client(args.endpoint_url, args.workers)
    version = storage.pull(args.uri, args.local_dir, client=client, workers=args.workers)
    print(f"ready: {args.local_dir} -> {version}")
    return 0


def _cmd_reliability(args: argparse.Namespace) -> int:
    from cluster.reliability import main as reliability_main

    return reliability_main(args)


def _cmd_keys_hash(args: argparse.Namespace) -> int:
    from cluster.request.auth import hash_key

    print(hash_key(sys.stdin.readline().strip()))
    return 0


def _transfer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint-url", help="S3-compatible endpoint (default: AWS, or $AWS_ENDPOINT_URL_S3)"
    )
    parser.add_argument(
        "--workers", type=int, default=16, help="parallel part transfers per file (default 16)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cluster",
        description="Speculation-aware LLM inference cluster on Ray Serve and vLLM. "
        "One YAML file describes targets, pools, routing and telemetry.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="deploy a cluster YAML and serve the OpenAI API until Ctrl-C",
        description="Start a local Ray (or join one with --address), deploy one Serve "
        "deployment per pool plus the routing ingress, wait until it answers, print the URL. "
        "Embedded models are prepared first.",
    )
    _config_arg(serve, required=False)
    serve.add_argument(
        "--address", help="deploy onto an existing Ray cluster (e.g. ray://head:10001 or auto)"
    )
    serve.set_defaults(func=_cmd_serve)

    config = commands.add_parser("config", help="check a cluster YAML before deploying it")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    validate = config_commands.add_parser(
        "validate", help="validate; one line per problem naming file and field"
    )
    _config_arg(validate, required=True)
    validate.set_defaults(func=_cmd_validate)
    render = config_commands.add_parser(
        "render", help="print exactly what will be deployed (per-pool LLMConfig, Serve options)"
    )
    _config_arg(render, required=True)
    render.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default yaml)"
    )
    render.set_defaults(func=_cmd_render)

    render_group = commands.add_parser("render", help="render deployment manifests from a YAML")
    render_commands = render_group.add_subparsers(
        dest="render_command", required=True, metavar="KIND"
    )
    kuberay = render_commands.add_parser(
        "kuberay",
        help="a KubeRay RayService (head, ingress group, one worker group per pool, Serve "
        "config inline) with its Service, PodDisruptionBudgets and NetworkPolicies",
        description="Print the manifests that the Terraform kuberay module deploys. The Serve "
        "config builds the app with the same code as `cluster serve`.",
    )
    _config_arg(kuberay, required=True)
    kuberay.add_argument(
        "--image",
        default="ghcr.io/example/cluster:0.1.0",
        help="container image with this package, Ray and vLLM installed",
    )
    kuberay.add_argument("--name", default="cluster", help="RayService name")
    kuberay.add_argument(
        "--service-account",
        default="ray-weights-reader",
        help="service account bound to the S3 weights reader role",
    )
    kuberay.add_argument(
        "--efa-interfaces",
        type=int,
        default=0,
        help="EFA devices each GPU worker requests (8 on p6-b200.48xlarge)",
    )
    kuberay.add_argument(
        "--memory-gib-per-gpu",
        type=int,
        default=200,
        help="host memory a GPU worker requests per GPU (p6-b200: 2 TiB / 8)",
    )
    kuberay.set_defaults(func=_cmd_render_kuberay)

    models = commands.add_parser(
        "models", help="model weights: prepare the embedded model, push/pull checkpoints to S3"
    )
    model_commands = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    prepare = model_commands.add_parser(
        "prepare",
        help="convert the embedded GGUF into a bf16 safetensors checkpoint in $CLUSTER_CACHE "
        "(once; instant afterwards)",
    )
    prepare.add_argument("--config", help="prepare the embedded models this YAML uses")
    prepare.set_defaults(func=_cmd_prepare)
    push = model_commands.add_parser(
        "push",
        help="upload a checkpoint directory to s3://bucket/prefix with a SHA-256 manifest",
    )
    push.add_argument("local_dir", metavar="LOCAL_DIR", help="checkpoint directory to upload")
    push.add_argument("uri", metavar="S3_URI", help="s3://bucket/prefix to upload to")
    _transfer_args(push)
    push.set_defaults(func=_cmd_push)
    pull = model_commands.add_parser(
        "pull",
        help="download a pushed checkpoint; resumable, hash-verified, installed atomically",
    )
    pull.add_argument("uri", metavar="S3_URI", help="s3://bucket/prefix a push wrote")
    pull.add_argument(
        "local_dir", metavar="LOCAL_DIR", help="directory to install it in (atomically)"
    )
    _transfer_args(pull)
    pull.set_defaults(func=_cmd_pull)

    reliability = commands.add_parser(
        "reliability",
        help="kill replicas, overload, send bad input and bad keys to a live cluster; "
        "write benchmarks/results/reliability.json (exit 1 if a target is missed)",
    )
    _config_arg(reliability, required=True)
    reliability.add_argument(
        "--out",
        default="benchmarks/results/reliability.json",
        help="where the JSON result goes (default %(default)s)",
    )
    reliability.add_argument(
        "--capacity",
        type=int,
        default=4,
        help="requests admitted per replica, no queue, so that 4x overload is small enough to "
        "offer from one machine (default %(default)s)",
    )
    reliability.add_argument(
        "--kills",
        type=int,
        default=3,
        help="pool replicas SIGKILLed while streams run, one at a time (default %(default)s)",
    )
    reliability.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="closed-loop clients during the kills (default %(default)s)",
    )
    reliability.set_defaults(func=_cmd_reliability)

    keys = commands.add_parser("keys", help="API keys")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    hash_cmd = keys_commands.add_parser(
        "hash", help="print the SHA-256 of a key read from stdin (what server.auth.keys holds)"
    )
    hash_cmd.set_defaults(func=_cmd_keys_hash)

    from cluster.drafters.cli import add_commands as add_drafter_commands

    add_drafter_commands(commands)

    from cluster.dashboards import add_command as add_dashboards_command

    add_dashboards_command(commands)

    from cluster.bench.cli import add_command as add_bench_command

    add_bench_command(commands)

    from cluster.autoscale.calibrate import add_command as add_calibrate_command

    add_calibrate_command(commands)

    from cluster.simulate.cli import add_command as add_simulate_command

    add_simulate_command(commands)

    from cluster.load_step import add_command as add_load_step_command

    add_load_step_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    except StorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
