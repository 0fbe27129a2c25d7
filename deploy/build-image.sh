#!/usr/bin/env bash
# Builds the `tl` image from deploy/Containerfile. No base image is pulled (FROM scratch): the
# context holds the release binary and the few shared libraries it links (glibc's loader, libc,
# libm, libgcc_s), copied from this machine at their own paths. Reusing the ordinary release
# build (the one `cargo run --release` makes) costs no second compile; a statically linked
# build would (minutes on 2 cores). Usage: deploy/build-image.sh [TAG]   (default kvwire-tl:dev)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-kvwire-tl:dev}
cargo build --quiet --release --bin tl
bin=target/release/tl
ctx=target/image
rm -rf "$ctx"
mkdir -p "$ctx/certs" "$ctx/rootfs"
# Debug info stays in target/; the image carries the stripped binary.
strip -o "$ctx/tl" "$bin"
# Every library the loader resolves for the binary, and the loader itself.
libs=$(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
for lib in $libs; do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    cp -L "$lib" "$ctx/rootfs$lib"
done
# The loader is also found by its canonical path on x86-64.
if [ -e /lib64/ld-linux-x86-64.so.2 ] && [ ! -e "$ctx/rootfs/lib64/ld-linux-x86-64.so.2" ]; then
    mkdir -p "$ctx/rootfs/lib64"
    cp -L /lib64/ld-linux-x86-64.so.2 "$ctx/rootfs/lib64/"
fi
docker build -q -f deploy/Containerfile -t "$tag" "$ctx"
echo "built $tag ($(du -h "$ctx/tl" | cut -f1) binary, $(echo "$libs" | wc -w) shared libraries)"
