#!/usr/bin/env bash
# A development CA and one certificate per identity of the Kubernetes deployment, written to
# deploy/k8s/certs/ by `tl certs` (for production, see the cert-manager note in
# kustomization.yaml). Usage: deploy/k8s/certs.sh [path to tl]
set -euo pipefail
tl=${1:-tl}
if [[ $tl == */* ]]; then tl=$(realpath "$tl"); fi
cd "$(dirname "$0")"
dir=certs
mkdir -p "$dir"
"$tl" certs --dir "$dir" --id gw --role gateway --host kvwire-gateway --host gateway >/dev/null
# Engines advertise their pod IP; peers verify the name every engine certificate carries.
"$tl" certs --dir "$dir" --id prefill --role prefill --host kvwire-engine >/dev/null
for i in 0 1; do
    "$tl" certs --dir "$dir" --id "decode-$i" --role decode --host kvwire-engine >/dev/null
done
# One tenant key and one admin key for the gateway (its Secret mounts them): a gateway with no
# key refuses to start unless told to serve the public unauthenticated.
for f in api_keys admin_keys; do
    [[ -s $dir/$f ]] || { umask 077; od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$dir/$f"; echo >>"$dir/$f"; }
done
echo "certificates in $(pwd)/$dir"
