"""The ``nixl-kv`` command line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from nixl_kv.dtypes import DataType
from nixl_kv.errors import NotSupportedError
from nixl_kv.harness.pair import (
    CTX_FAULTS,
    PLACEMENTS,
    PairOptions,
    ParallelSpec,
    format_table,
    parse_rnn,
    run_pair,
)
from nixl_kv.harness.pair_worker import InstanceSpec, RnnSpec
from nixl_kv.registry import agent_class, agent_names


def token_counts(text: str) -> tuple[int, ...]:
    values = tuple(int(item) for item in text.split(",") if item)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("requests are positive token counts, comma-separated")
    return values


def _spec(text: str) -> ParallelSpec:
    try:
        return ParallelSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backend(text: str) -> str:
    """A transfer agent's registry name, in any case; one that is not installed is refused now, with the list."""
    name = text.upper()
    try:
        agent_class(name)
    except NotSupportedError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ImportError as exc:  # declared, but its library is missing
        raise argparse.ArgumentTypeError(f"backend {name} cannot load ({exc}): see README, Transfer backends") from None
    return name


def _rnn(text: str) -> RnnSpec:
    try:
        return parse_rnn(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nixl-kv", description="KV cache transfer for disaggregated serving")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("bench", help="nixl_kv against its baselines in one run (see nixl-kv bench --help)")
    commands.add_parser("serve", help="run a ctx, gen or router server (see nixl-kv serve --help)")
    pair = commands.add_parser("pair", help="run a ctx and a gen instance end to end and verify every element")
    spec_help = "SPEC: tp=,pp=,cp=,dp= (0/1 attention DP), layers=a:b:.. (uneven PP), layout=block_major|nhd|hnd"
    pair.add_argument("--ctx", type=_spec, default=ParallelSpec(), help=f"ctx {spec_help}")
    pair.add_argument("--gen", type=_spec, default=ParallelSpec(), help=f"gen {spec_help}")
    pair.add_argument("--layers", type=int, default=32)
    pair.add_argument("--kv-heads", type=int, default=None, help="8 (mha) or 1 (mla) when not given")
    pair.add_argument("--head-dim", type=int, default=128)
    pair.add_argument("--tokens-per-block", type=int, default=32)
    pair.add_argument("--dtype", choices=[d.value for d in DataType], default="bfloat16")
    pair.add_argument("--attention", choices=["mha", "mla"], default="mha")
    pair.add_argument(
        "--indexer-dim",
        type=int,
        default=0,
        metavar="N",
        help="MLA only: also move a DSA indexer-K cache (N + N/128*4 bytes per token and layer)",
    )
    pair.add_argument(
        "--rnn",
        type=_rnn,
        default=None,
        metavar="OPTIONS",
        help="hybrid model: also move Mamba state, e.g. layers=2,heads=4,head_dim=64,d_state=16,d_conv=4,"
        "n_groups=1,layout=xbc|qkv|none,conv_dtype=float32,ssm_dtype=bfloat16",
    )
    pair.add_argument("--requests", type=token_counts, default=(256, 777, 1500, 3000))
    pair.add_argument(
        "--rounds", type=int, default=5, help="send the request list this many times (the first pays first contact)"
    )
    pair.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    pair.add_argument(
        "--timeout-ms",
        type=int,
        default=None,
        help="gen-side transfer deadline, enforced with in-flight cancellation (timed-out requests end in error)",
    )
    pair.add_argument(
        "--layerwise", action="store_true", help="ctx responds layer-wise while prefill marks layers done"
    )
    pair.add_argument(
        "--reuse-prefix",
        type=int,
        default=0,
        metavar="N",
        help="the gen side already holds the first N blocks of every request: only the rest moves",
    )
    pair.add_argument(
        "--direct-min-run-bytes",
        type=int,
        default=None,
        help="stage slices whose direct runs are shorter (default by pool memory: DRAM 8 KiB, VRAM 1 MiB; "
        "0: direct wherever possible; huge: always staged)",
    )
    add_load_options(pair)
    pair.add_argument(
        "--connect-ahead",
        action="store_true",
        help="the gen instance meets the ctx instance (CacheTransceiver.connect_to) before the first request",
    )
    pair.add_argument(
        "--no-raw-read",
        dest="raw_read",
        action="store_false",
        help="skip the raw READ baselines after the rounds (no ratio: for soaks, where the link may be slow)",
    )
    pair.add_argument("--lease-ms", type=int, default=60_000, help="how long the ctx side holds a request's blocks")
    pair.add_argument(
        "--faults",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="inject a fault into this fraction of requests: corrupted params (must fail), forged control messages "
        "from a third agent (must change nothing), a gen-side or a ctx-side cancel (either way); never wrong bytes",
    )
    pair.add_argument(
        "--ctx-fault",
        choices=CTX_FAULTS,
        default="",
        help="in the middle round, after its params were handed out and before the gen instance reads: SIGSTOP "
        "every ctx process for 1 s longer than the lease, then SIGCONT (stop), or SIGKILL them (kill: the run ends "
        "with that round); that round's requests may end either way, by their deadline, never with wrong bytes",
    )
    for role in ("ctx", "gen"):
        pair.add_argument(
            f"--{role}-netns",
            default="",
            metavar="NAME",
            help=f"run the {role} instance inside this network namespace (ip netns exec; root): with UCX_TLS=tcp "
            "the bytes cross the namespaces' link, as between two hosts (scripts/soak.sh)",
        )
    pair.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return parser


def add_load_options(parser: argparse.ArgumentParser, busy_scope: str = "") -> None:
    """Options ``pair`` and ``bench`` share: what else the workers do and where their ranks run."""
    parser.add_argument(
        "--backend",
        type=_backend,
        default="NIXL",
        help=f"the transfer agent, for nixl_kv and for its raw READ baseline: {', '.join(agent_names())} (any case)",
    )
    parser.add_argument(
        "--busy-thread",
        action="store_true",
        help="every ctx and gen worker process also runs a pure-Python CPU-bound thread, as a server's model "
        f"loop holds the GIL{busy_scope}",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="default",
        help="GPUs (ignored on the CPU): default puts rank r on GPU r, ctx ranks first; split puts every ctx rank "
        "on GPU 0 and every gen rank on GPU 1",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from nixl_kv.harness.bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["serve"]:  # its imports (fastapi, torch, transformers) only when serving
        from nixl_kv.serving.serve import main as serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "pair":
        return _pair(args)
    return 2


def _pair(args: argparse.Namespace) -> int:
    if args.attention == "mla" and args.kv_heads not in (None, 1):
        print("nixl-kv pair: an MLA cache has one latent head per layer (--kv-heads 1)", file=sys.stderr)
        return 2
    if args.device == "cuda" and importlib.util.find_spec("cupy") is None:
        print("nixl-kv pair: --device cuda needs cupy (pip install nixl-kv[gpu-cu12] or [gpu-cu13])", file=sys.stderr)
        return 2
    if args.indexer_dim and args.attention != "mla":
        print("nixl-kv pair: --indexer-dim needs --attention mla (the indexer-K cache is DSA's)", file=sys.stderr)
        return 2
    if args.indexer_dim < 0:
        print("nixl-kv pair: --indexer-dim must be >= 0", file=sys.stderr)
        return 2
    if args.rnn is not None and args.layerwise:
        print(
            "nixl-kv pair: --rnn cannot be combined with --layerwise (RNN state is final only at the end)",
            file=sys.stderr,
        )
        return 2
    if args.reuse_prefix < 0 or (args.timeout_ms is not None and args.timeout_ms < 1):
        print("nixl-kv pair: --reuse-prefix must be >= 0 and --timeout-ms >= 1", file=sys.stderr)
        return 2
    if min(args.layers, args.kv_heads or 1, args.head_dim, args.tokens_per_block, args.rounds) < 1:
        print("nixl-kv pair: layers, kv heads, head dim, tokens per block and rounds must be >= 1", file=sys.stderr)
        return 2
    model = InstanceSpec(
        layers=args.layers,
        kv_heads=args.kv_heads or (1 if args.attention == "mla" else 8),
        attention=args.attention,
        head_dim=args.head_dim,
        tokens_per_block=args.tokens_per_block,
        dtype=args.dtype,
        num_blocks=1,
        device=args.device,
        timeout_ms=args.timeout_ms,
        direct_min_run_bytes=args.direct_min_run_bytes,
        layerwise=args.layerwise,
        reuse_prefix_blocks=args.reuse_prefix,
        indexer_dim=args.indexer_dim,
        rnn=args.rnn,
        busy_thread=args.busy_thread,
        lease_ms=args.lease_ms,
        backend=args.backend,
    )
    options = PairOptions(
        args.ctx,
        args.gen,
        model,
        args.requests,
        args.rounds,
        placement=args.placement,
        connect_ahead=args.connect_ahead,
        raw_read=args.raw_read,
        faults=args.faults,
        ctx_fault=args.ctx_fault,
        ctx_netns=args.ctx_netns,
        gen_netns=args.gen_netns,
    )
    try:
        report = run_pair(options, progress=lambda text: print(f"[pair] {text}", file=sys.stderr, flush=True))
    except (NotSupportedError, ValueError) as exc:
        print(f"nixl-kv pair: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"nixl-kv pair: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json:
        print(json.dumps(report.summary()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
