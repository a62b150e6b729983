#!/usr/bin/env bash
# On the GPU machine: what moving state beside the paged KV costs. Each pair runs with and without the extra
# state (same attention cache, same requests, 3 rounds); prints nixl_kv's GB/s and its ratio to a raw NIXL READ
# of the same bytes in the same run. Usage: scripts/bench_state_gpu.sh
source "$(dirname "$0")/_gpu_env.sh"
REQ="256,777,1500,3000,8000"
run() {  # name, args...
  local name=$1; shift
  python3 -m nixl_kv.cli pair --device cuda --rounds 3 --requests "$REQ" --json "$@" 2>"$OUT/$name.err" \
    | tail -1 > "$OUT/$name.json"
  python3 - "$name" "$OUT/$name.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[2]))
print(f"{sys.argv[1]:<28} ok={s['ok']} MiB/round={s['bytes'] / 3 / 2**20:9.1f} nixl_kv={s['gbps']:7.1f} GB/s "
      f"raw={s['raw_read_gbps']:6.1f} ratio={s['ratio_to_raw']:.2f} rounds_ms={[round(x * 1e3, 1) for x in s['seconds_per_round']]}")
PY
}
MLA="--attention mla --layers 61 --head-dim 576 --tokens-per-block 64"
run mla $MLA
run mla_indexer $MLA --indexer-dim 128
ATT="--layers 8 --kv-heads 8 --head-dim 128"
run attention_only $ATT
run hybrid_small_state $ATT --rnn layers=48,heads=8,head_dim=64,d_state=16,d_conv=4,n_groups=1,layout=xbc
run hybrid_nemotron_h $ATT --rnn layers=48,heads=128,head_dim=64,d_state=128,d_conv=4,n_groups=8,layout=xbc
run hybrid_tp1_to_tp2 $ATT --gen tp=2 --rnn layers=48,heads=128,head_dim=64,d_state=128,d_conv=4,n_groups=8,layout=xbc
