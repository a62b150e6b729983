"""``nixl-kv serve ctx|gen|router``: start one server role on uvicorn.

A ctx or gen instance of ``--tp N`` > 1 re-launches itself as an ``mpiexec -n N`` job: every rank builds its
pools and transceiver together, rank 0 serves HTTP and the others follow its steps (``lockstep``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from nixl_kv.layout import LayoutKind
from nixl_kv.serving.limits import MAX_BODY_BYTES, MAX_IN_FLIGHT, MAX_UNPULLED, ServerLimits

LAYOUTS = {"block_major": LayoutKind.BLOCK_MAJOR, "nhd": LayoutKind.PER_LAYER_NHD, "hnd": LayoutKind.PER_LAYER_HND}
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run a ctx, gen or router server (FastAPI on uvicorn)")
    serve.add_argument("role", choices=["ctx", "gen", "router"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", help="ctx/gen: a transformers causal LM directory (config.json + safetensors)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    serve.add_argument("--tp", type=int, default=1, help="ctx/gen: tensor-parallel ranks (an mpiexec job if > 1)")
    serve.add_argument("--layout", choices=list(LAYOUTS), default="block_major", help="ctx/gen: pool layout")
    serve.add_argument("--tokens-per-block", type=int, default=16)
    serve.add_argument("--num-blocks", type=int, default=512, help="ctx/gen: KV blocks per rank")
    serve.add_argument("--max-prompt-tokens", type=int, default=1024)
    serve.add_argument("--transfer-timeout-ms", type=int, default=10_000, help="gen: a transfer's deadline")
    serve.add_argument("--lease-ms", type=int, default=60_000, help="ctx: how long a request's blocks await a reader")
    serve.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="a request body's limit (413)")
    serve.add_argument("--max-in-flight", type=int, default=MAX_IN_FLIGHT, help="requests served at once (503 past)")
    serve.add_argument(
        "--max-unpulled", type=int, default=MAX_UNPULLED, help="ctx: params handed out and not yet pulled (503 past)"
    )
    serve.add_argument("--ctx", action="append", default=[], help="router: a ctx server's URL (repeatable)")
    serve.add_argument("--gen", action="append", default=[], help="router: a gen server's URL (repeatable)")
    serve.add_argument(
        "--engine",
        choices=["nixl_kv", "vllm"],
        default="nixl_kv",
        help="router: what --ctx and --gen are: nixl_kv's reference servers, or vLLM OpenAI servers (prefill, decode)",
    )


def serve_main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.role == "router":
        if not args.ctx or not args.gen:
            print("nixl-kv serve router: give at least one --ctx URL and one --gen URL", file=sys.stderr)
            return 2
        if args.engine == "vllm":
            from nixl_kv.vllm.router import create_app

            return _run(create_app(args.ctx, args.gen), args)
        from nixl_kv.serving.router import create_router_app

        return _run(create_router_app(args.ctx, args.gen, limits=_limits(args)), args)
    if not args.model:
        print(f"nixl-kv serve {args.role}: --model DIR is required", file=sys.stderr)
        return 2
    positive = ("tp", "num_blocks", "tokens_per_block", "lease_ms", "max_body_bytes", "max_in_flight", "max_unpulled")
    if any(getattr(args, name) < 1 for name in positive):
        flags = ", ".join("--" + name.replace("_", "-") for name in positive)
        print(f"nixl-kv serve {args.role}: {flags} must be >= 1", file=sys.stderr)
        return 2
    world = next((int(os.environ[name]) for name in MPI_SIZE_VARIABLES if name in os.environ), None)
    if args.tp > 1 and world is None:
        from nixl_kv.comm import mpiexec_path

        mpiexec = mpiexec_path()
        os.execv(mpiexec, [mpiexec, "-n", str(args.tp), sys.executable, "-m", "nixl_kv.serving.serve", *argv])
    if world is not None and world != args.tp:
        print(f"nixl-kv serve {args.role}: --tp {args.tp} in an MPI world of {world}", file=sys.stderr)
        return 2
    return _serve_instance(args)


def _serve_instance(args: argparse.Namespace) -> int:
    from nixl_kv.comm import MpiComm, SingleProcessComm
    from nixl_kv.serving.engine import InstanceOptions

    options = InstanceOptions(
        model_dir=args.model,
        dtype=args.dtype,
        tp=args.tp,
        layout=LAYOUTS[args.layout].value,
        tokens_per_block=args.tokens_per_block,
        num_blocks=args.num_blocks,
        max_prompt_tokens=args.max_prompt_tokens,
        transfer_timeout_ms=args.transfer_timeout_ms,
        lease_ms=args.lease_ms,
    )
    comm = MpiComm() if args.tp > 1 else SingleProcessComm()
    if args.role == "ctx":
        from nixl_kv.serving.ctx_engine import CtxEngine
        from nixl_kv.serving.ctx_server import create_ctx_app

        engine, create_app = CtxEngine(options, comm), create_ctx_app
    else:
        from nixl_kv.serving.gen_engine import GenEngine
        from nixl_kv.serving.gen_server import create_gen_app

        engine, create_app = GenEngine(options, comm), create_gen_app
    if comm.rank != 0:  # rank 0 stops the followers; a signal to the job must not end them first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.follow()
        return 0
    engine.start()
    try:
        return _run(create_app(engine, _limits(args)), args)
    finally:
        engine.stop()


def _limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(args.max_body_bytes, args.max_in_flight, args.max_unpulled)


def _run(app: object, args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="nixl-kv")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return serve_main(parser.parse_args(["serve", *argv]), argv)


if __name__ == "__main__":
    sys.exit(main())
