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
# tl certs never overwrites a certificate (it needs --force): issue only what is missing.
issue() { [[ -e $dir/$1.pem ]] || "$tl" certs --dir "$dir" --id "$@" >/dev/null; }
issue gw --role gateway --host kvwire-gateway --host gateway
# Engines advertise their pod IP; peers verify the name every engine certificate carries.
issue prefill --role prefill --host kvwire-engine
for i in 0 1; do
    issue "decode-$i" --role decode --host kvwire-engine
done
# etcd members: clients and peers reach each by its stable name under the headless Service.
for i in 0 1 2; do
    issue "etcd-$i" --role etcd --host "etcd-$i.etcd.kvwire.svc" --host "etcd-$i.etcd" --host etcd
done
# The admin identity of the etcd-init Job (etcd's superuser role).
issue ops --role admin
# One tenant key and one admin key for the gateway (its Secret mounts them): a gateway with no
# key refuses to start unless told to serve the public unauthenticated.
for f in api_keys admin_keys; do
    [[ -s $dir/$f ]] || { umask 077; od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$dir/$f"; echo >>"$dir/$f"; }
done
echo "certificates in $(pwd)/$dir"
