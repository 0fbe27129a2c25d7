#!/usr/bin/env bash
# The field's mutation tool over the wire library and the receiver, with each crate's own tests
# only (cargo-mutants tests the package of the mutated file): every viable mutant must be caught,
# or argued equivalent in a comment at its line.
#
# Usage: tests/mutants/cargo-mutants.sh [kvwire|receiver]...   (both when none is given)
# Installs cargo-mutants (pinned) when missing. About 10 min for kvwire, more for the receiver, on
# 2 cores: too slow for .ci/run. Results go to target/mutants-out/<target>/mutants.out.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants@27.1.0
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kvwire receiver)
status=0
for t in "${targets[@]}"; do
    case "$t" in
        kvwire) args=(--package kvwire) ;;
        receiver) args=(--package kvwire-grpc --file kvwire-grpc/src/receiver.rs) ;;
        *) echo "unknown target $t (kvwire, receiver)" >&2; exit 2 ;;
    esac
    out="target/mutants-out/$t"
    mkdir -p "$out"
    echo "== cargo mutants ${args[*]}"
    cargo mutants "${args[@]}" --timeout 120 --output "$out" || status=$?
    echo "missed ($t):"
    cat "$out/mutants.out/missed.txt"
done
exit $status
