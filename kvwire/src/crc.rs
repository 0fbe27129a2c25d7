//! CRC-32C (Castagnoli): reflected, init and xor-out `0xFFFF_FFFF`.
//!
//! Two crates compete here and neither wins everywhere (figures from `benches/wire.rs`): on CPUs
//! with AVX-512 VL and VPCLMULQDQ, `crc-fast` folds 64 bytes per step and runs about twice as fast
//! as `crc32c` on 2 MiB; on CPUs without AVX-512 (this project's current machines), `crc32c`'s
//! three-way `crc32` instruction loop is 1.1-1.3x faster than `crc-fast` on 2 MiB. The choice is
//! made once per process from the CPU's features.

use crc_fast::{CrcAlgorithm, Digest};

/// The CRC-32C of any message followed by its own little-endian CRC-32C.
///
/// One pass over a whole envelope (trailer included) that yields this value proves the trailer
/// right, so a receiver that already ran one pass for a chunk checksum need not run a second.
pub const CRC32C_RESIDUE: u32 = 0x4867_4BC7;

/// True when `crc-fast`'s AVX-512 VPCLMULQDQ path is available (it is then the faster crate).
fn wide_folding() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// The implementation in use: `"crc-fast"` or `"crc32c"`.
#[must_use]
pub fn crc32c_impl() -> &'static str {
    if wide_folding() { "crc-fast" } else { "crc32c" }
}

/// CRC-32C of `data`.
///
/// ```
/// assert_eq!(kvwire::crc32c(b"123456789"), 0xE306_9283);
/// ```
#[must_use]
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    if wide_folding() {
        crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
    } else {
        crc32c::crc32c(data)
    }
}

/// An incremental CRC-32C, for bytes that arrive or are produced in pieces.
#[derive(Clone, Copy, Debug)]
pub struct Crc32c(State);

// Boxing the digest would allocate per envelope; a few hundred bytes on the stack cost nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
enum State {
    Fast(Digest),
    /// The CRC-32C of the bytes so far (the `crc32c` crate appends to a finished value).
    Append(u32),
}

impl Default for Crc32c {
    fn default() -> Self {
        Self::new()
    }
}

impl Crc32c {
    /// A fresh checksum (of the empty message).
    #[must_use]
    pub fn new() -> Self {
        if wide_folding() {
            Self(State::Fast(Digest::new(CrcAlgorithm::Crc32Iscsi)))
        } else {
            Self(State::Append(0))
        }
    }

    /// Feeds `data`.
    #[inline]
    pub fn update(&mut self, data: &[u8]) {
        match &mut self.0 {
            State::Fast(d) => d.update(data),
            State::Append(c) => *c = crc32c::crc32c_append(*c, data),
        }
    }

    /// The CRC-32C of everything fed so far.
    #[must_use]
    pub fn finish(&self) -> u32 {
        match &self.0 {
            State::Fast(d) => d.finalize() as u32,
            State::Append(c) => *c,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_crates_agree() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 13 + 1) as u8).collect();
        for n in [0, 1, 7, 64, 172, 4999] {
            let a = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, &data[..n]) as u32;
            assert_eq!(a, crc32c::crc32c(&data[..n]));
            assert_eq!(a, crc32c(&data[..n]));
        }
    }

    #[test]
    fn incremental_equals_one_shot_and_residue_holds() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut c = Crc32c::new();
        for piece in data.chunks(33) {
            c.update(piece);
        }
        assert_eq!(c.finish(), crc32c(&data));
        let mut framed = data.clone();
        framed.extend_from_slice(&crc32c(&data).to_le_bytes());
        assert_eq!(crc32c(&framed), CRC32C_RESIDUE);
    }
}
