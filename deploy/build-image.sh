#!/usr/bin/env bash
# Builds the `tl` image from deploy/Containerfile with a statically linked binary. No base image
# is pulled (FROM scratch). Usage: deploy/build-image.sh [TAG]   (default kvwire-tl:dev)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-kvwire-tl:dev}
target=x86_64-unknown-linux-gnu
# Static glibc; --target keeps build scripts and proc macros dynamic. Its own target directory,
# so the static flags never invalidate the ordinary build.
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --bin tl --target "$target" --target-dir target/static
bin=target/static/$target/release/tl
if readelf -d "$bin" | grep -q '(NEEDED)'; then
    echo "error: $bin needs shared libraries:" >&2
    readelf -d "$bin" | grep '(NEEDED)' >&2
    exit 1
fi
ctx=target/image
rm -rf "$ctx"
mkdir -p "$ctx/certs"
# Debug info stays in target/; the image carries the stripped binary.
strip -o "$ctx/tl" "$bin"
docker build -q -f deploy/Containerfile -t "$tag" "$ctx"
echo "built $tag ($(du -h "$ctx/tl" | cut -f1) binary)"
