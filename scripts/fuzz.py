"""Long-form fuzzing (not part of CI): mutated params, control messages and agent metadata, real transports.

Three targets, ``--inputs`` mutated inputs each (100,000 by default):
- the wire decoder, for the params, a ctx state and every control message: only ``WireFormatError`` may come
  out, and whatever decodes must encode back to bytes that decode to the same object;
- ``NixlAgent.load_remote`` on mutated agent metadata: only ``AgentError``, and nothing left loaded after a
  refusal. Twice: damaged blobs (whose checksum then fails), and blobs sealed again after the damage, as a sender
  that means it would (the router or a reader holding the request's secret: trusted, docs/trust_model.md).
  Inputs that kill the process inside UCX or NIXL (SIGABRT, SIGSEGV: no Python code can catch that) are counted
  and the last one is kept in ``fuzz_metadata_abort.hex``;
- a real gen transceiver fed mutated params of a live ctx request (``--requests`` of them, 2,000 by default;
  half of them sealed again after the damage, as a ctx side that made them so would, to get past the checksum):
  each must end (complete or error) by its deadline, and one that completes must hold the request's exact bytes
  (every tenth request is left unchanged and must complete: the harness checks itself).

Mutations: 1-4 of flip, insert, delete, overwrite with a msgpack type byte, and truncation. Prints one line per
target; exits 1 on the first input that breaks a rule (its bytes are printed in hex).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nixl_kv import wire  # noqa: E402
from nixl_kv.errors import AgentError, WireFormatError  # noqa: E402
from nixl_kv.params_seal import seal  # noqa: E402
from nixl_kv.protocol import (  # noqa: E402
    LayersReady,
    LayerWatch,
    NoReaders,
    ReadDone,
    ReadVerdict,
    StageClaim,
    StageGrant,
)
from nixl_kv.requests import RequestState, TransferRequest  # noqa: E402
from nixl_kv.state import ContextPhaseParams, DataTransceiverState  # noqa: E402

TYPE_BYTES = (0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC2, 0xC3, 0xC4, 0xCC, 0xCF, 0xD3, 0xDC, 0xDE, 0xDF, 0xFF)
CLASSES = (ContextPhaseParams, DataTransceiverState, ReadDone, ReadVerdict, StageClaim, StageGrant, NoReaders)
CLASSES += (LayerWatch, LayersReady)


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    if rng.random() < 0.1:
        return bytes(out[: rng.randrange(len(out) + 1)])
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(("flip", "insert", "delete", "set"))
        if op == "insert":
            out.insert(rng.randrange(len(out) + 1), rng.randrange(256))
        elif out:
            at = rng.randrange(len(out))
            if op == "flip":
                out[at] ^= 1 << rng.randrange(8)
            elif op == "delete":
                del out[at]
            else:
                out[at] = rng.choice(TYPE_BYTES)
    return bytes(out)


def fail(what: str, data: bytes, detail: str) -> None:
    print(f"FAIL {what}: {detail}\n  input: {data.hex()}", flush=True)
    sys.exit(1)


def fuzz_decoder(samples: list[bytes], inputs: int, rng: random.Random) -> None:
    decoded = refused = 0
    start = time.monotonic()
    for i in range(inputs * len(samples)):  # ``inputs`` of each sample
        data = mutate(samples[i % len(samples)], rng)
        try:
            obj = wire.decode_one_of(data, CLASSES)
        except WireFormatError:
            refused += 1
            continue
        except Exception as exc:  # noqa: BLE001 - exactly what this looks for
            fail("decoder", data, f"{type(exc).__name__}: {exc}")
        again = wire.decode(wire.encode(obj), type(obj))
        if again != obj:
            fail("decoder round trip", data, f"{obj!r} != {again!r}")
        decoded += 1
    total = inputs * len(samples)
    print(
        f"decoder: {total} inputs ({inputs} for each of {len(samples)} samples: params, ctx state, every control "
        f"message), {decoded} decoded, {refused} refused ({time.monotonic() - start:.0f} s)"
    )


def fuzz_metadata(inputs: int, seed: int, resealed: bool) -> None:
    """In child processes: a malformed blob can abort or crash the process inside UCX or NIXL. Each such input is
    counted (the last is kept in ``fuzz_metadata_abort.hex``) and the next child goes on after it."""
    start, aborts, counts = 0, 0, {"loaded": 0, "refused": 0}
    began = time.monotonic()
    progress = Path(tempfile.mkdtemp()) / "index"
    while start < inputs:
        child = subprocess.run(
            [sys.executable, __file__, "--metadata-child", str(start), str(inputs), str(seed), str(progress)]
            + ["--resealed"] * resealed,
            capture_output=True,
        )
        if child.returncode == 0:
            for line in child.stdout.decode(errors="replace").splitlines():
                name, _, value = line.partition("=")
                if name in counts and value.isdigit():  # (NIXL logs to stdout too)
                    counts[name] += int(value)
            break
        at, loaded, refused, data_hex = progress.read_text().split(" ")
        counts["loaded"] += int(loaded)
        counts["refused"] += int(refused)
        if child.returncode not in (-signal.SIGABRT, -signal.SIGSEGV):
            detail = child.stderr[-500:].decode(errors="replace")
            fail("metadata", bytes.fromhex(data_hex), f"child ended with {child.returncode}: {detail}")
        aborts += 1
        Path("fuzz_metadata_abort.hex").write_text(data_hex)
        start = int(at) + 1
    print(
        f"agent metadata, {'sealed again' if resealed else 'damaged'}: {inputs} inputs, {counts['loaded']} loaded, "
        f"{counts['refused']} refused, {aborts} killed "
        f"the process inside UCX/NIXL (SIGABRT or SIGSEGV) ({time.monotonic() - began:.0f} s)"
    )


def metadata_child(start: int, inputs: int, seed: int, progress: Path, resealed: bool) -> None:
    from nixl_kv.agents.nixl_agent import NixlAgent, seal_metadata, unseal_metadata

    owner, target = NixlAgent("fuzz-owner"), NixlAgent("fuzz-target")
    real = unseal_metadata(target.metadata()) if resealed else target.metadata()
    loaded = refused = 0
    try:
        for index in range(start, inputs):
            data = mutate(real, random.Random(seed * 1_000_003 + index))
            data = seal_metadata(data) if resealed else data
            progress.write_text(f"{index} {loaded} {refused} {data.hex()}")  # read back if UCX aborts
            try:
                owner.load_remote(data, target.name)
            except AgentError:
                refused += 1
                if owner.live_handles["remotes"]:
                    fail("metadata", data, "a refused load left an agent loaded")
                continue
            except Exception as exc:  # noqa: BLE001
                fail("metadata", data, f"{type(exc).__name__}: {exc}")
            loaded += 1
            owner.forget_remote(target.name)
    finally:
        owner.close()
        target.close()
    print(f"loaded={loaded}\nrefused={refused}")


def fuzz_transceiver(requests: int, rng: random.Random) -> None:
    """Mutated params of live ctx requests through a real gen transceiver (loopback agents, DRAM)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import Pair, Shape, make_side  # the test fixtures' shape and fill

    shape = Shape(num_blocks=256)
    ctx, gen = make_side(shape, lease_ms=2000), make_side(shape)
    pair = Pair(shape, ctx, gen)
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    try:
        for i in range(requests):
            ctx_request = pair.prefill(i, rng.randint(1, 100))
            original = ctx_request.context_phase_params
            data = original if i % 10 == 0 else mutate(original, rng)  # every tenth: the harness itself works
            if i % 2 and data[-9:-8] == b"\xcf":  # half sealed again, as if made so: past the checksum, deeper in
                data = seal(data)
            gen_id = 1_000_000 + i
            gen.cache.allocate(gen_id, ctx_request.num_tokens)
            request = TransferRequest(gen_id, context_phase_params=data)
            gen.transceiver.request_and_receive_async(request)
            deadline = time.monotonic() + 10
            while request.state is RequestState.GENERATION_TRANS_IN_PROGRESS and time.monotonic() < deadline:
                gen.transceiver.check_gen_transfer_status(at_least=1)
            outcome = check_outcome(pair, request, ctx_request, data)
            if data == original and outcome != "completed":
                fail("transceiver", data, f"unchanged params ended in {request.state.value}: {request.error}")
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            gen.cache.free(gen_id)
            ctx.transceiver.cancel_request(ctx_request)
            ctx.transceiver.check_context_transfer_status(0, mark_complete=True)
            ctx.cache.free(i)
    finally:
        ctx.transceiver.close()
        gen.transceiver.close()
    print(f"transceiver: {requests} mutated params, outcomes {outcomes} ({time.monotonic() - start:.0f} s)")


def check_outcome(pair: Any, request: TransferRequest, ctx_request: TransferRequest, data: bytes) -> str:
    if request.state is RequestState.GENERATION_TRANS_IN_PROGRESS:
        fail("transceiver", data, "no terminal state 10 s after the request (its lease is 2 s)")
    if request.state is not RequestState.GENERATION_TRANS_COMPLETE:
        return "error"
    params = wire.decode(data, ContextPhaseParams)  # it completed, so these decoded
    same = (params.request_id, params.num_tokens) == (ctx_request.request_id, ctx_request.num_tokens)
    if not same or pair.mismatches(request.request_id, ctx_request.request_id, ctx_request.num_tokens):
        fail("transceiver", data, "completed with bytes that are not the request's")
    return "completed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=("decoder", "metadata", "transceiver"))
    parser.add_argument("--metadata-child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--resealed", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.metadata_child:
        start, inputs, seed, progress = options.metadata_child
        metadata_child(int(start), int(inputs), int(seed), Path(progress), options.resealed)
        return
    rng = random.Random(options.seed)
    targets: dict[str, Callable[[], object]] = {
        "decoder": lambda: fuzz_decoder(samples(), options.inputs, rng),
        "metadata": lambda: (
            fuzz_metadata(options.inputs, options.seed, resealed=False),
            fuzz_metadata(options.inputs, options.seed, resealed=True),
        ),
        "transceiver": lambda: fuzz_transceiver(options.requests, rng),
    }
    for name, run in targets.items():
        if options.only in (None, name):
            run()


def samples() -> list[bytes]:
    """A real ctx state and params (from a loopback transceiver) and one of every control message."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import Shape, make_side

    shape = Shape()
    side = make_side(shape)
    try:
        side.cache.allocate(1, 40)
        request = TransferRequest(1, num_tokens=40)
        side.transceiver.respond_and_send_async(request)
        params = request.context_phase_params
        state = side.transceiver.get_serialized_data_transceiver_state()
        side.transceiver.cancel_request(request)
    finally:
        side.transceiver.close()
    proof, meta = bytes(range(16)), bytes(range(200))
    messages = [
        ReadDone("i", 7, 3, meta, 2, final=False, failed=True, reason="r", checks_hold=True, hold_token=9, proof=proof),
        ReadVerdict("i", 7, 3, False, "unpinned", proof),
        StageClaim("i", 7, 3, meta, 4, (0, 2), (0, 8), (0, 4), proof),
        StageGrant("i", 7, 3, True, 1 << 40, 4096, False, "", proof),
        NoReaders("i", 7, meta, proof),
        LayerWatch("i", 7, meta, proof),
        LayersReady("i", 7, 12, proof),
    ]
    return [params, state, *(wire.encode(m) for m in messages)]


if __name__ == "__main__":
    main()
