//! Copying received bytes into the pool with stores that do not read the destination first.
//!
//! An imported block lands in a slab that is almost never in a core's cache: it comes off the
//! free list or the cold end of the LRU, of a pool larger than the caches, and the import
//! thread has moved megabytes of other blocks since. An ordinary copy (glibc's `rep movsb`
//! below its non-temporal threshold, three quarters of the shared cache) first reads every
//! destination line for ownership, then writes it back when it is evicted: three passes over
//! memory for two of payload. Non-temporal stores write whole lines through write-combining
//! buffers and skip the read, and they leave the caches to the thread's other work (the model,
//! the socket copies).
//!
//! Measured on an Intel Xeon of family 6 model 207 (`tl bench transfer`, `one_core`): a cached
//! 2 MiB block copied into cold memory ran at 1.2-2.2 times the rate of `copy_from_slice`
//! (10.5-16.8 GB/s against 6.5-9.2, fifteen runs). Into a destination still in the core's L2 the ordinary copy wins
//! at 256 KiB (about 35 GB/s against 17 in a C test; at 2 MiB, 13 against 15). A destination
//! that recent is the exception for an import, and payloads below [`STREAM_MIN`], the likelier
//! to be cached, keep the ordinary copy.
//!
//! This is the crate's one module with `unsafe`: each block names the check that makes it sound.
#![allow(unsafe_code)]

/// Payloads at least this long are copied with non-temporal stores (on x86-64); shorter ones
/// with `copy_from_slice`.
pub const STREAM_MIN: usize = 256 << 10;

/// Copies `src` into `dst` (same length), with non-temporal stores when the payload is at least
/// [`STREAM_MIN`] bytes and the target is x86-64. The stores are fenced before it returns, so
/// whatever publishes `dst` afterwards (a lock's release) publishes its bytes.
///
/// # Panics
/// When the lengths differ, as `copy_from_slice` does.
pub fn copy_to_pool(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_to_pool: lengths differ");
    if dst.len() < STREAM_MIN {
        dst.copy_from_slice(src);
        return;
    }
    stream(dst, src);
}

/// The non-temporal copy itself, whatever the length (tests call it on short slices too).
#[cfg(target_arch = "x86_64")]
fn stream(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{_mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // A non-temporal 16-byte store needs a 16-byte-aligned address: copy up to the first one
    // normally, then whole 64-byte lines' worth of 16-byte stores, then the tail normally.
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let (dst_head, dst_rest) = dst.split_at_mut(head);
    let (src_head, src_rest) = src.split_at(head);
    dst_head.copy_from_slice(src_head);
    let body = dst_rest.len() / 64 * 64;
    let (dst_body, dst_tail) = dst_rest.split_at_mut(body);
    let (src_body, src_tail) = src_rest.split_at(body);
    for (d, s) in dst_body.chunks_exact_mut(16).zip(src_body.chunks_exact(16)) {
        // SAFETY: `s` and `d` are exactly 16 bytes (`chunks_exact`), so the unaligned load reads
        // and the store writes only inside them; `d` starts at a 16-byte-aligned address
        // because `head` moved `dst_rest` onto one and every chunk is 16 bytes; SSE2 is part of
        // the x86-64 baseline.
        unsafe {
            let v = _mm_loadu_si128(s.as_ptr().cast());
            _mm_stream_si128(d.as_mut_ptr().cast(), v);
        }
    }
    // Non-temporal stores are weakly ordered: fence them before any later store (the import's
    // publication under the pool lock) can be seen.
    // SAFETY: `sfence` has no operands; SSE is part of the x86-64 baseline.
    unsafe { _mm_sfence() };
    dst_tail.copy_from_slice(src_tail);
}

#[cfg(not(target_arch = "x86_64"))]
fn stream(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Every alignment of the destination and the source, and lengths around the 16- and
    /// 64-byte steps, copy exactly the source and touch nothing outside the destination.
    #[test]
    fn stream_copies_every_alignment_exactly() {
        let src_all = pattern(4096 + 64, 7);
        for dst_off in 0..20 {
            for src_off in [0, 1, 5, 15, 16, 33] {
                for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096] {
                    let mut buf = vec![0xAAu8; len + 64];
                    let src = &src_all[src_off..src_off + len];
                    stream(&mut buf[dst_off..dst_off + len], src);
                    assert_eq!(
                        &buf[dst_off..dst_off + len],
                        src,
                        "{dst_off} {src_off} {len}"
                    );
                    assert!(
                        buf[..dst_off].iter().all(|&b| b == 0xAA),
                        "before: {dst_off}"
                    );
                    assert!(
                        buf[dst_off + len..].iter().all(|&b| b == 0xAA),
                        "after: {dst_off} {len}"
                    );
                }
            }
        }
    }

    /// Both sides of the threshold copy the same bytes.
    #[test]
    fn copy_to_pool_matches_copy_from_slice_across_the_threshold() {
        for len in [STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 3, 2 << 20] {
            let src = pattern(len + 3, 11);
            let mut dst = vec![0u8; len + 1];
            copy_to_pool(&mut dst[1..], &src[3..]);
            assert_eq!(&dst[1..], &src[3..]);
            assert_eq!(dst[0], 0);
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn copy_to_pool_refuses_different_lengths() {
        copy_to_pool(&mut [0u8; 4], &[1u8; 5]);
    }
}
