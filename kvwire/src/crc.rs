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

/// Which crate computes CRC-32C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CrcImpl {
    /// Chosen from the CPU's features (the default).
    Auto,
    /// The `crc32c` crate (SSE4.2 `crc32` instruction, three streams).
    Crc32c,
    /// The `crc-fast` crate (carry-less multiply folding; AVX-512 VPCLMULQDQ where present).
    CrcFast,
}

/// A name that is not one of [`CrcImpl`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected auto, crc32c or crc-fast")]
pub struct UnknownCrcImpl(pub String);

impl std::str::FromStr for CrcImpl {
    type Err = UnknownCrcImpl;

    fn from_str(s: &str) -> Result<Self, UnknownCrcImpl> {
        match s {
            "auto" => Ok(Self::Auto),
            "crc32c" => Ok(Self::Crc32c),
            "crc-fast" => Ok(Self::CrcFast),
            other => Err(UnknownCrcImpl(other.to_owned())),
        }
    }
}

/// 0 auto, 1 crc32c, 2 crc-fast.
static CHOICE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Forces one implementation for the whole process (both give the same values), or returns to
/// the automatic choice. For benchmarks that compare the two on one machine.
///
/// ```
/// use kvwire::{CrcImpl, crc32c, crc32c_impl, set_crc_impl};
/// set_crc_impl(CrcImpl::Crc32c);
/// assert_eq!(crc32c_impl(), "crc32c");
/// let a = crc32c(b"kv");
/// set_crc_impl(CrcImpl::CrcFast);
/// assert_eq!(crc32c(b"kv"), a);
/// set_crc_impl(CrcImpl::Auto);
/// ```
pub fn set_crc_impl(choice: CrcImpl) {
    let v = match choice {
        CrcImpl::Auto => 0,
        CrcImpl::Crc32c => 1,
        CrcImpl::CrcFast => 2,
    };
    CHOICE.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// True when `crc-fast` computes (the override, else the CPU's features: its AVX-512 VPCLMULQDQ
/// path makes it the faster crate).
// cargo-mutants: on a CPU with both AVX-512 VL and VPCLMULQDQ, deleting the `2` arm and `&&` ->
// `||` below are equivalent (the automatic choice is `crc-fast` there too); on any other CPU
// `the_crc_override_picks_the_implementation` kills both.
fn wide_folding() -> bool {
    match CHOICE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => return false,
        2 => return true,
        _ => {}
    }
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
    ///
    /// ```
    /// use kvwire::{Crc32c, crc32c};
    /// let mut c = Crc32c::new();
    /// c.update(b"1234");
    /// c.update(b"56789");
    /// assert_eq!(c.finish(), crc32c(b"123456789"));
    /// ```
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
    fn forcing_an_implementation_changes_the_crate_not_the_value() {
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 31 + 5) as u8).collect();
        let want = crc32c::crc32c(&data);
        for (choice, name) in [(CrcImpl::Crc32c, "crc32c"), (CrcImpl::CrcFast, "crc-fast")] {
            set_crc_impl(choice);
            assert_eq!(crc32c_impl(), name);
            assert_eq!(crc32c(&data), want, "{name}");
            let mut c = Crc32c::new();
            c.update(&data[..1000]);
            c.update(&data[1000..]);
            assert_eq!(c.finish(), want, "{name} incremental");
        }
        set_crc_impl(CrcImpl::Auto);
        assert_eq!("crc-fast".parse::<CrcImpl>(), Ok(CrcImpl::CrcFast));
        assert!("crc64".parse::<CrcImpl>().is_err());
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
