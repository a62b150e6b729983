#!/usr/bin/env bash
# Two "hosts" on one machine (needs root): the ctx and gen instances of `nixl-kv pair` run in two network namespaces
# joined by a veth pair, UCX over TCP between them. Phases of the mixed request list: a clean link; faults in 10% of
# the requests (corrupted params, forged control messages from a third agent, gen-side cancels: nixl-kv pair
# --faults) on a clean link, then between a 2-rank ctx and a 2-stage gen, then on a link limited to 200 Mbit/s (tc
# tbf); on that link a 200 ms deadline, missed behind the queue (--timeout-ms); 2% of TCP segments dropped at
# random both ways, with faults in 10% (nftables; skipped without `nft`); a second link between the namespaces, two
# TAP devices joined by a userspace netem (nixl_kv.harness.netem: this kernel has no sch_netem), that delays every
# frame 5 ms +- 4 ms (so frames overtake each other: reordered) and drops 0.5% of them, with faults in 10%; every
# ctx process stopped for longer than the lease in the middle round, then resumed; every ctx process killed in the
# middle round (--ctx-fault); and the link down for longer than the lease in the middle of a run, then back up,
# with faults in 10% of the requests.
# One table row per phase: requests by outcome, the faults injected and any request that did not end as its fault
# says it must, wrong bytes, the slowest failure against the deadline or lease, whether the run ended by itself (no
# hang), what the instances held after close, resident memory growth, and the forged messages the ctx instance
# dropped; then the totals. Exits 1 on wrong bytes, a hang, a leak, a failure later than half a second past its
# deadline or lease, or (outside the link-down, deadline and loss phases) a request that did not end as it must.
# After the table, what the netem relay counted (frames relayed, reordered, dropped). The relay is stopped and the
# namespaces are removed on exit, even on failure.
# Usage: scripts/soak.sh [ROUNDS]   rounds of the request list per phase (20 by default; 4 requests per round)
source "$(dirname "$0")/_env.sh"
set +e +o pipefail -u  # a phase's verdict is its table row's, not pair's exit status
ROUNDS="${1:-20}"
LEASE_MS=3000
CTX=nkv-soak-ctx GEN=nkv-soak-gen
NETEM_PID=""
cleanup() {  # the relay first, by SIGTERM (then it reports; its TAP devices go with it), then the namespaces
  if [ -n "$NETEM_PID" ]; then kill -TERM "$NETEM_PID" 2>/dev/null; wait "$NETEM_PID" 2>/dev/null; fi
  ip netns del "$CTX" 2>/dev/null || true; ip netns del "$GEN" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 1' INT TERM  # (so that the EXIT trap runs then too)
cleanup
ip netns add "$CTX" && ip netns add "$GEN" || exit 1
ip link add nkv-soak-c netns "$CTX" type veth peer name nkv-soak-g netns "$GEN" || exit 1
ip -n "$CTX" addr add 10.250.7.1/24 dev nkv-soak-c && ip -n "$GEN" addr add 10.250.7.2/24 dev nkv-soak-g || exit 1
for ns in "$CTX" "$GEN"; do ip -n "$ns" link set lo up; done
ip -n "$CTX" link set nkv-soak-c up && ip -n "$GEN" link set nkv-soak-g up || exit 1
wait_up() {  # UCX finds no TCP device on a veth whose carrier is not up yet (NIXL_ERR_BACKEND at start)
  for _ in $(seq 100); do  # (a TAP device's operstate stays "unknown", which the kernel counts as running too)
    case "$(ip netns exec "$1" cat "/sys/class/net/$2/operstate")" in up | unknown) return 0 ;; esac
    sleep 0.05
  done
  echo "$2 in $1 did not come up" >&2
  return 1
}
export UCX_TLS=tcp,self UCX_NET_DEVICES=nkv-soak-c,nkv-soak-g
PAIR=(python -m nixl_kv.cli pair --ctx-netns "$CTX" --gen-netns "$GEN" --lease-ms "$LEASE_MS" --json
  --layers 4 --kv-heads 4 --head-dim 64 --tokens-per-block 16 --requests 1,40,300,1000 --no-raw-read)
read -r -d '' ROW <<'PY'
import json, sys
phase, rc, lease_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
hung = "HUNG" if rc == 124 else "no"
lines = [line for line in sys.stdin.read().splitlines() if line.startswith("{")]
if not lines:
    print(f"| {phase} | - | - | - | - | - | - | - | {hung} (rc {rc}) | - | - | - | - |")
    with open(sys.argv[4], "a") as totals:
        print(0, 0, 0, int(rc == 124), file=totals)
    sys.exit(1)
s = json.loads(lines[-1])
slow = s["slowest_failure_s"]
limit = f"deadline {lease_s * 1e3:.0f} ms" if "deadline" in phase else f"lease {lease_s:.0f} s"
past = "-" if slow is None else f"{slow:.2f} s ({limit})"
leaks = {k: v for k, v in s["leaks"].items() if v} or "none"
rss = ", ".join(f"{k} {v / 1024:+.0f} MiB" for k, v in s["rss_growth_kb"].items())
gbps = f"{s['gbps']:.2f}" if s["gbps"] else "-"
faults = ", ".join(f"{n} {kind}" for kind, n in s["faults"].items() if n) or "-"
forged = s["forged_messages"].get("ctx", 0)
print(f"| {phase} | {s['requests']} | {s['verified']} | {s['failed']} | {faults} | {s['unexpected']} | "
      f"{s['mismatched_elements']} | {past} | {hung} | {leaks} | {rss} | {forged} | {gbps} |")
with open(sys.argv[4], "a") as totals:  # requests, faulted, wrong elements, hangs
    print(s["requests"], sum(s["faults"].values()), s["mismatched_elements"], int(rc == 124), file=totals)
late = slow is not None and slow > lease_s + 0.5  # a failure must come by its deadline (or lease), not later
ends_early = phase.startswith("link down") or "deadline" in phase or "lost" in phase  # may fail, in time
bad = s["mismatched_elements"] or rc == 124 or leaks != "none" or late or (s["unexpected"] and not ends_early)
sys.exit(1 if bad else 0)
PY
LOGS="$(mktemp -d)"
wait_up "$CTX" nkv-soak-c && wait_up "$GEN" nkv-soak-g || exit 1
phase() {  # phase NAME ROUNDS [PAIR OPTIONS]: one pair run, one table row; its stderr is shown on failure
  local name="$1" rounds="$2" rc
  shift 2
  # (a corrupted request holds its ctx blocks for the lease, as nothing can tell the ctx: ~0.4 s a round with faults)
  timeout $((300 + rounds)) "${PAIR[@]}" --rounds "$rounds" "$@" >"$LOGS/out" 2>"$LOGS/err"
  rc=$?
  if ! python -c "$ROW" "$name" "$rc" "${LIMIT_S:-$((LEASE_MS / 1000))}" "$LOGS/totals" <"$LOGS/out"; then
    status=1
    tail -20 "$LOGS/err" >&2
  fi
}
status=0
echo "| phase | requests | verified | failed | faults injected | not as they must end | wrong elements | slowest failure |" \
  "hang | left after close | RSS growth | forged messages dropped (ctx) | GB/s |"
echo "|---|---:|---:|---:|---|---:|---:|---|---|---|---|---:|---:|"
phase "clean link" "$ROUNDS"
phase "clean link, faults in 10% of requests" "$ROUNDS" --faults 0.1
phase "ctx tp=2 -> gen pp=2, faults in 10%" "$ROUNDS" --faults 0.1 --ctx tp=2 --gen tp=1,pp=2
phase "ctx stopped past the lease, then resumed" "$ROUNDS" --ctx-fault stop
phase "ctx killed mid-run" "$ROUNDS" --ctx-fault kill
for side in "$CTX nkv-soak-c" "$GEN nkv-soak-g"; do
  set -- $side
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate 200mbit burst 256kb latency 100ms || status=1
done
phase "200 Mbit/s link, faults in 10%" "$ROUNDS" --faults 0.1
LIMIT_S=0.2 phase "200 Mbit/s link, 200 ms deadline" "$ROUNDS" --timeout-ms 200
ip netns exec "$CTX" tc qdisc del dev nkv-soak-c root; ip netns exec "$GEN" tc qdisc del dev nkv-soak-g root
if command -v nft >/dev/null; then  # random loss of TCP segments leaving either namespace (nftables' numgen)
  for ns in "$CTX" "$GEN"; do
    ip netns exec "$ns" nft add table inet nkvloss &&
      ip netns exec "$ns" nft add chain inet nkvloss out '{ type filter hook output priority 0; }' &&
      ip netns exec "$ns" nft add rule inet nkvloss out meta l4proto tcp numgen random mod 1000 '<' 20 drop || status=1
  done
  phase "2% of TCP segments lost, faults in 10%" "$ROUNDS" --faults 0.1
  for ns in "$CTX" "$GEN"; do ip netns exec "$ns" nft delete table inet nkvloss; done
else
  echo "| 2% of TCP segments lost | skipped: no nft (apt-get install nftables) | | | | | | | | | | | |"
fi
netem_start() {  # netem_start [RELAY OPTIONS]: the relay, its TAP devices moved into the namespaces and up
  python -m nixl_kv.harness.netem --a nkv-tap-c --b nkv-tap-g --mtu 9000 "$@" >"$LOGS/netem" 2>"$LOGS/netem.err" &
  NETEM_PID=$!
  for _ in $(seq 200); do
    grep -q '^ready$' "$LOGS/netem" && break
    kill -0 "$NETEM_PID" 2>/dev/null || break
    sleep 0.05
  done
  grep -q '^ready$' "$LOGS/netem" && ip link set nkv-tap-c netns "$CTX" && ip link set nkv-tap-g netns "$GEN" &&
    ip -n "$CTX" addr add 10.250.8.1/24 dev nkv-tap-c && ip -n "$GEN" addr add 10.250.8.2/24 dev nkv-tap-g &&
    ip -n "$CTX" link set nkv-tap-c up && ip -n "$GEN" link set nkv-tap-g up &&
    wait_up "$CTX" nkv-tap-c && wait_up "$GEN" nkv-tap-g && return 0
  echo "the netem relay did not start:" >&2
  cat "$LOGS/netem.err" >&2
  return 1
}
read -r -d '' NETEM_NOTE <<'PY'
import json, sys
phase, rc = sys.argv[1], int(sys.argv[2])
s = json.loads(open(sys.argv[3]).read().splitlines()[-1])
print(f"(the netem relay in the {phase} phase: {s['frames']} frames relayed, {s['reordered']} reordered, "
      f"{s['dropped']} dropped, {s['undeliverable']} undeliverable; exit status {rc})")
sys.exit(1 if rc else 0)
PY
netem_stop() {  # netem_stop PHASE: stop the relay (its TAP devices go with it), note what it counted
  local rc
  kill -TERM "$NETEM_PID"
  wait "$NETEM_PID"
  rc=$?
  NETEM_PID=""
  if ! python -c "$NETEM_NOTE" "$1" "$rc" "$LOGS/netem" >>"$LOGS/notes"; then
    status=1
    cat "$LOGS/netem.err" >&2
  fi
}
if [ -c /dev/net/tun ]; then  # a second link through the userspace netem; UCX on it for this phase only
  NETEM_PHASE="5+-4 ms delay, reordered, 0.5% lost, faults in 10%"
  if netem_start --delay-ms 5 --jitter-ms 4 --loss 0.005 --seed 1; then
    UCX_NET_DEVICES=nkv-tap-c,nkv-tap-g phase "$NETEM_PHASE" "$ROUNDS" --faults 0.1
    netem_stop "$NETEM_PHASE"
  else
    echo "| $NETEM_PHASE | relay failed to start | | | | | | | | | | | |"
    status=1
    [ -n "$NETEM_PID" ] && netem_stop "$NETEM_PHASE"
  fi
else
  echo "| 5+-4 ms delay, reordered, 0.5% lost | skipped: no /dev/net/tun | | | | | | | | | | | |"
fi
DOWN_S=$((LEASE_MS / 1000 + 2))  # longer than the lease: requests in flight then must end by their deadline
: >"$LOGS/err"  # (the last phase's progress must not start the next one's fault)
(  # once the run is under way (its 5th round started), the gen's end of the link goes down, then up
  for _ in $(seq 600); do grep -q "round 5/" "$LOGS/err" 2>/dev/null && break; sleep 0.05; done
  ip -n "$GEN" link set nkv-soak-g down
  at_down="$(grep -a -o "round [0-9]*/" "$LOGS/err" | tail -1)"
  sleep "$DOWN_S"
  ip -n "$GEN" link set nkv-soak-g up
  echo "(the link went down in ${at_down%/} and came back up in $(grep -a -o "round [0-9]*/" "$LOGS/err" | tail -1 \
    | tr -d /) of the link-down phase)" >"$LOGS/link"
) &
DOWN_JOB=$!
phase "link down ${DOWN_S} s mid-run, faults in 10%" $((ROUNDS * 10)) --faults 0.1
wait "$DOWN_JOB"
echo
cat "$LOGS/link"
[ -f "$LOGS/notes" ] && cat "$LOGS/notes"
awk '{r += $1; f += $2; w += $3; h += $4} END {printf "totals: %d requests, %d with an injected fault (%.1f%%), " \
  "%d wrong elements, %d hangs\n", r, f, r ? 100 * f / r : 0, w, h}' "$LOGS/totals"
rm -rf "$LOGS"
exit "$status"
