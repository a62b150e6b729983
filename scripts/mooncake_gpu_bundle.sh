#!/usr/bin/env bash
# Here (with a package index): build .mc/mooncake_cuda.tar.xz, the CUDA build of Mooncake's transfer engine cut
# down to what `mooncake.engine` loads, for the GPU machine (no package index, 64 MiB carried per call; the whole
# wheel is 93 MiB). Holds the engine and its bundled libraries, libcudart 12 (the GPU machine has CUDA 13), and
# the system libraries it links from this Debian host (libibverbs, libcurl, ...); bench_mooncake_gpu.sh there
# uses a system library from the bundle only where the machine lacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${MOONCAKE_VERSION:-0.3.13.post1}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/$1" "$2"
  (cd "$work/$1" && unzip -q -o ./*.whl)
}
fetch engine "mooncake-transfer-engine==$version"
fetch cudart "nvidia-cuda-runtime-cu12==12.8.*"
site="$work/bundle/site" libs="$work/bundle/syslibs"
mkdir -p "$site/mooncake" "$site/mooncake_transfer_engine.libs" "$libs"
cp "$work"/engine/mooncake/{__init__.py,buffer_pool.py,engine.so,libasio.so,libetcd_wrapper.so} "$site/mooncake/"
cp "$work"/engine/mooncake_transfer_engine.libs/* "$site/mooncake_transfer_engine.libs/"
cp "$work"/cudart/nvidia/cuda_runtime/lib/libcudart.so.12 "$libs/"
for f in "$site"/mooncake/*.so "$site"/mooncake_transfer_engine.libs/*; do ldd "$f"; done \
  | awk '$3 ~ /^\/(usr\/)?lib/ {print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' \
  | xargs -I{} cp -L {} "$libs/"
mkdir -p .mc
tar -C "$work/bundle" -cJf .mc/mooncake_cuda.tar.xz site syslibs
ls -l .mc/mooncake_cuda.tar.xz
