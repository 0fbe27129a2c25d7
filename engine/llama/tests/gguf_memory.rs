//! Issue 63, class 7: what parsing a GGUF file's metadata costs in memory is in proportion to
//! the file, whatever its arrays declare. A 64 MiB file whose bulk is one u8 array under a key
//! the loader never reads once took 2.1 GiB (a 32-byte value per byte).
#![allow(unsafe_code)] // the counting allocator below; nothing else.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use tl_llama::gguf::Gguf;

/// Counts the bytes the current thread holds, and their peak, so tests running in parallel do
/// not interfere.
struct Counting;

thread_local! {
    static HELD: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn grew(by: usize) {
    HELD.with(|h| {
        let now = h.get() + by;
        h.set(now);
        PEAK.with(|p| p.set(p.get().max(now)));
    });
}

fn shrank(by: usize) {
    HELD.with(|h| h.set(h.get().saturating_sub(by)));
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counters are
// const-initialised thread-local Cells, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrank(layout.size());
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        shrank(layout.size());
        grew(new_size);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A GGUF v3 file of `kvs` (key, value type, value bytes) and no tensor.
fn gguf(kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (k, kind, v) in kvs {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        b.extend_from_slice(&kind.to_le_bytes());
        b.extend_from_slice(v);
    }
    b
}

/// An array value of `n` elements of type `kind`, each `elem`.
fn array(kind: u32, n: usize, elem: &[u8]) -> Vec<u8> {
    let mut v = kind.to_le_bytes().to_vec();
    v.extend_from_slice(&(n as u64).to_le_bytes());
    for _ in 0..n {
        v.extend_from_slice(elem);
    }
    v
}

/// Peak bytes this thread held while opening `bytes` as a file, and the result's error.
fn open_peak(name: &str, bytes: &[u8]) -> (usize, Option<String>) {
    let path = std::env::temp_dir().join(format!("tl-gguf-mem-{name}-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let before = HELD.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let got = Gguf::open(&path).err().map(|e| e.to_string());
    let peak = PEAK.with(Cell::get) - before;
    let _ = std::fs::remove_file(&path);
    (peak, got)
}

#[test]
fn a_small_file_with_a_huge_array_parses_in_memory_in_proportion_to_it() {
    const MIB: usize = 1 << 20;
    // 64 MiB of u8 under a key nothing reads: walked, not kept.
    let file = gguf(&[
        ("general.architecture", 8, {
            let mut s = 5u64.to_le_bytes().to_vec();
            s.extend_from_slice(b"llama");
            s
        }),
        ("general.padding", 9, array(0, 64 * MIB, &[7])),
    ]);
    let (peak, err) = open_peak("unread", &file);
    assert!(err.is_none(), "{err:?}");
    // The file itself is read whole (64 MiB); the parse adds next to nothing.
    assert!(
        peak < file.len() + 4 * MIB,
        "{} MiB for a {} MiB file",
        peak / MIB,
        file.len() / MIB
    );

    // The same bulk under a key the tokenizer reads, as the wrong type: refused by name.
    let file = gguf(&[("tokenizer.ggml.token_type", 9, array(0, 64 * MIB, &[1]))]);
    let (peak, err) = open_peak("typed", &file);
    let err = err.expect("a u8 token_type array is refused");
    assert!(err.contains("tokenizer.ggml.token_type"), "{err}");
    assert!(peak < file.len() + 4 * MIB, "{} MiB", peak / MIB);

    // Past the bound on tokenizer entries (of the right type): refused by name, before any
    // entry is kept.
    let file = gguf(&[(
        "tokenizer.ggml.token_type",
        9,
        array(5, 3 << 20, &[1, 0, 0, 0]),
    )]);
    let (peak, err) = open_peak("long", &file);
    let err = err.expect("3M token types are refused");
    assert!(
        err.contains("tokenizer.ggml.token_type") && err.contains("entries"),
        "{err}"
    );
    assert!(peak < file.len() + 4 * MIB, "{} MiB", peak / MIB);

    // A flood of keys: refused by its count.
    let mut flood = gguf(&[]);
    flood[16..24].copy_from_slice(&(1u64 << 20).to_le_bytes());
    flood.extend(std::iter::repeat_n(0u8, 14 << 20));
    let (_, err) = open_peak("keys", &flood);
    let err = err.expect("a million keys are refused");
    assert!(err.contains("metadata count"), "{err}");
}
