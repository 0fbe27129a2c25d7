#!/usr/bin/env bash
# The seed's mutants against the tests named to catch them.
#
# For each sNN.patch here: copy the working tree to a scratch directory, apply the patch, build
# the named test, run it alone, and print one line: "sNN killed by <test>" when the test fails,
# "sNN SURVIVED <test>" when it passes. A patch that no longer applies, a mutant that does not
# build, or a named test that did not run is a failure of this script, never a skip.
#
# Usage: tests/mutants/run.sh [sNN ...]   (all mutants when none is given)
# Builds go to target/mutants (kept between runs). Too slow for .ci/run on 2 cores.
set -u

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/mutants}"

# id | package | test target (--lib for a unit test) | test name
table='
s01|kvwire|hand_example|hand_example_envelope
s02|kvwire|reader_rules|envelope_reader_rules
s03|kvwire|reader_rules|envelope_reader_rules
s04|kvwire|reader_rules|envelope_reader_rules
s05|tl-engine-core|--lib|rng::tests::resume_rng_hands_off_the_draws
s06|tl|transfer|has_blocks_takes_no_reference
s07|kvwire-grpc|receiver|push_accepts_dedups_and_refuses
s08|kvwire-grpc|receiver|push_accepts_dedups_and_refuses
s09|kvwire-grpc|receiver|push_accepts_dedups_and_refuses
s10|tl|disagg|disaggregated_equals_colocated
s11|tl|transfer|bytes_moved_are_missing_blocks_plus_tail
s12|tl|transfer|transfer_reset_frees_both_sides
s13|tl|disagg|prefill_rpc_validation_and_info
s14|tl|heartbeat|beat_once_counts_failures_and_drain
'

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
tree="$scratch/tree"

fresh_copy() {
    rm -rf "$tree"
    mkdir -p "$tree"
    tar -C "$root" --exclude=./target --exclude=./.git -cf - . | tar -C "$tree" -xf -
}

wanted=" $* "
total=0
killed=0
failed=0
while IFS='|' read -r id pkg target name; do
    [ -n "$id" ] || continue
    if [ $# -gt 0 ] && [[ "$wanted" != *" $id "* ]]; then
        continue
    fi
    total=$((total + 1))
    patch_file="$here/$id.patch"
    fresh_copy
    if [ ! -f "$patch_file" ] || ! patch -s -p1 -d "$tree" --dry-run <"$patch_file" >/dev/null; then
        echo "$id FAILED: the patch does not apply to this tree"
        failed=$((failed + 1))
        continue
    fi
    patch -s -p1 -d "$tree" <"$patch_file"
    if [ "$target" = "--lib" ]; then
        sel=(--lib)
    else
        sel=(--test "$target")
    fi
    log="$scratch/$id.log"
    if ! (cd "$tree" && cargo test -q -p "$pkg" "${sel[@]}" --no-run) >"$log" 2>&1; then
        echo "$id FAILED: the mutant does not build (see below)"
        tail -20 "$log"
        failed=$((failed + 1))
        continue
    fi
    (cd "$tree" && cargo test -p "$pkg" "${sel[@]}" -- --exact "$name") >"$log" 2>&1
    if grep -q "^test $name \.\.\. FAILED" "$log"; then
        echo "$id killed by $name"
        killed=$((killed + 1))
    elif grep -q "^test $name \.\.\. ok" "$log"; then
        echo "$id SURVIVED $name"
        failed=$((failed + 1))
    else
        echo "$id FAILED: $name did not run"
        tail -20 "$log"
        failed=$((failed + 1))
    fi
done <<<"$table"

echo "total: $killed/$total killed"
[ "$failed" -eq 0 ] && [ "$total" -gt 0 ]
