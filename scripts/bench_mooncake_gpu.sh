#!/usr/bin/env bash
# On the GPU machine: `nixl-kv pair --device cuda --backend mooncake` over Mooncake's TCP transport (VRAM staged
# through the host) and over its intra-node NVLink transport (CUDA IPC), each beside a raw Mooncake READ of the
# same bytes. Carry .mc (built here by scripts/mooncake_gpu_bundle.sh); nixl is not needed. Logs go to $OUT.
# Usage: scripts/bench_mooncake_gpu.sh [pair options, e.g. --requests 256,1500,8000 --rounds 3]
source "$(dirname "$0")/_gpu_env.sh"
bundle=/tmp/mooncake_cuda
rm -rf "$bundle" && mkdir -p "$bundle/missing" && tar -C "$bundle" -xJf .mc/mooncake_cuda.tar.xz || exit 1
ldconfig -p >"$bundle/present.txt"
for lib in "$bundle"/syslibs/*; do  # the machine's own copy wins; the bundle's only fills gaps
  grep -F " $(basename "$lib") " "$bundle/present.txt" >/dev/null || ln -s "$lib" "$bundle/missing/"
done
echo "from the bundle: $(ls "$bundle/missing" | tr '\n' ' ')"
export LD_LIBRARY_PATH="$bundle/missing${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONPATH="$bundle/site:$PYTHONPATH"
export GLOG_minloglevel="${GLOG_minloglevel:-1}"
python3 -c "import mooncake.engine as e; print('mooncake engine, CUDA:', e.SUPPORT_CUDA)" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--requests 256,1500,8000 --rounds 3)
status=0
for protocol in tcp nvlink_intra; do
  NIXL_KV_MOONCAKE_PROTOCOL=$protocol python3 -m nixl_kv.cli pair --device cuda --backend mooncake --json "${args[@]}" \
    2>"$OUT/pair_mooncake_$protocol.err" | tee "$OUT/pair_mooncake_$protocol.txt" | tail -3 || status=1
  tail -5 "$OUT/pair_mooncake_$protocol.err"
done
exit $status
