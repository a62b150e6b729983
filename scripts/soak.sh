#!/usr/bin/env bash
# Two "hosts" on one machine (needs root): the ctx and gen instances of `nixl-kv pair` run in two network namespaces
# joined by a veth pair, UCX over TCP between them. Phases of the mixed request list: a clean link; faults in 10% of
# the requests (corrupted params, forged control messages from a third agent, gen-side cancels: nixl-kv pair
# --faults) on a clean link, then between a 2-rank ctx and a 2-stage gen, then on a link limited to 200 Mbit/s (tc
# tbf); on that link a 200 ms deadline, missed behind the queue (--timeout-ms); 2% of TCP segments dropped at
# random both ways, with faults in 10% (nftables; skipped without `nft`); every ctx process stopped for longer than
# the lease in the middle round, then resumed; every ctx process killed in the middle round (--ctx-fault); and the
# link down for longer than the lease in the middle of a run, then back up, with faults in 10% of the requests.
# One table row per phase: requests by outcome, the faults injected and any request that did not end as its fault
# says it must, wrong bytes, the slowest failure against the deadline or lease, whether the run ended by itself (no
# hang), what the instances held after close, resident memory growth, and the forged messages the ctx instance
# dropped; then the totals. Exits 1 on wrong bytes, a hang, a leak, a failure later than half a second past its
# deadline or lease, or (outside the link-down, deadline and loss phases) a request that did not end as it must.
# The namespaces are removed on exit, even on failure. (tc netem is not in this machine's kernel: no delay or
# reorder phase; the loss comes from nftables instead.)
# Usage: scripts/soak.sh [ROUNDS]   rounds of the request list per phase (20 by default; 4 requests per round)
source "$(dirname "$0")/_env.sh"
set +e +o pipefail -u  # a phase's verdict is its table row's, not pair's exit status
ROUNDS="${1:-20}"
LEASE_MS=3000
CTX=nkv-soak-ctx GEN=nkv-soak-gen
cleanup() { ip netns del "$CTX" 2>/dev/null || true; ip netns del "$GEN" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$CTX" && ip netns add "$GEN" || exit 1
ip link add nkv-soak-c netns "$CTX" type veth peer name nkv-soak-g netns "$GEN" || exit 1
ip -n "$CTX" addr add 10.250.7.1/24 dev nkv-soak-c && ip -n "$GEN" addr add 10.250.7.2/24 dev nkv-soak-g || exit 1
for ns in "$CTX" "$GEN"; do ip -n "$ns" link set lo up; done
ip -n "$CTX" link set nkv-soak-c up && ip -n "$GEN" link set nkv-soak-g up || exit 1
wait_up() {  # UCX finds no TCP device on a veth whose carrier is not up yet (NIXL_ERR_BACKEND at start)
  for _ in $(seq 100); do
    [ "$(ip netns exec "$1" cat "/sys/class/net/$2/operstate")" = up ] && return 0
    sleep 0.05
  done
  echo "$2 in $1 did not come up" >&2
  return 1
}
export UCX_TLS=tcp,self UCX_NET_DEVICES=nkv-soak-c,nkv-soak-g
PAIR=(python -m nixl_kv.cli pair --ctx-netns "$CTX" --gen-netns "$GEN" --lease-ms "$LEASE_MS" --json
  --layers 4 --kv-heads 4 --head-dim 64 --tokens-per-block 16 --requests 1,40,300,1000)
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
ends_early = phase.startswith("link down") or "deadline" in phase or "loss" in phase  # may fail, in time
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
awk '{r += $1; f += $2; w += $3; h += $4} END {printf "totals: %d requests, %d with an injected fault (%.1f%%), " \
  "%d wrong elements, %d hangs\n", r, f, r ? 100 * f / r : 0, w, h}' "$LOGS/totals"
rm -rf "$LOGS"
exit "$status"
