#!/usr/bin/env bash
# Builds the etcd image the Kubernetes deployment runs (deploy/k8s/etcd.yaml) from this machine's
# Debian etcd-server (installed with apt when missing): FROM scratch, the etcd binary and the
# libraries it links, user 65532. Nothing is pulled. Usage: deploy/build-etcd-image.sh [TAG]
# (default kvwire-etcd:dev)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-kvwire-etcd:dev}
if ! command -v etcd >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server >/dev/null
fi
bin=$(command -v etcd)
ctx=target/etcd-image
rm -rf "$ctx"
# The data directory belongs to the image's user: a named volume mounted there starts so.
mkdir -p "$ctx/rootfs" "$ctx/data"
cp -L "$bin" "$ctx/etcd"
libs=$(ldd "$bin" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u || true)
for lib in $libs; do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    cp -L "$lib" "$ctx/rootfs$lib"
done
cat >"$ctx/Containerfile" <<'IMAGE'
FROM scratch
COPY rootfs/ /
COPY --chown=65532:65532 data/ /var/lib/etcd/
COPY etcd /etcd
USER 65532:65532
ENTRYPOINT ["/etcd"]
IMAGE
docker build -q -f "$ctx/Containerfile" -t "$tag" "$ctx"
echo "built $tag from $("$bin" --version | head -1)"
