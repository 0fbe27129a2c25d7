//! E4M3 (OCP "E4M3FN") conversion, written out: the example's, and what `tl bench wire`
//! measures as `f16_to_fp8_gbps` (it includes this file).

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// E4M3 bits of `x`: round to nearest (ties to even), saturating at +-448, NaN to NaN.
pub fn to_e4m3(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Below the smallest normal (2^-6) the spacing is fixed: 2^-9. A rounded count of 8 is the
    // smallest normal, whose bits are also 8.
    if a < f32::powi(2.0, -6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // A normal f32 in [2^-6, 448): its exponent, and its 23 mantissa bits cut to 3, rounding
    // the 20 dropped bits to nearest, ties to even.
    let bits = a.to_bits();
    let mut e = (bits >> 23) as i32 - 127;
    let m = bits & 0x007f_ffff;
    let (keep, rest) = (m >> 20, m & 0x000f_ffff);
    let mut q = keep + u32::from(rest > 0x8_0000 || (rest == 0x8_0000 && keep & 1 == 1));
    if q == 8 {
        q = 0;
        e += 1;
    }
    if e > 8 || (e == 8 && q == 7) {
        return sign | 0x7e;
    }
    sign | (((e + 7) as u8) << 3) | q as u8
}

/// The value of E4M3 bits.
pub fn from_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0f);
    let man = f32::from(b & 0x07);
    match exp {
        0 => sign * man / 8.0 * f32::powi(2.0, -6),
        15 if man == 7.0 => f32::NAN,
        _ => sign * (1.0 + man / 8.0) * f32::powi(2.0, exp - 7),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        for (x, bits) in [
            (0.0, 0x00),
            (1.0, 0x38),
            (-2.0, 0xc0),
            (448.0, 0x7e),
            (1000.0, 0x7e),
            (0.015625, 0x08),
            (0.001953125, 0x01),
            (1.0625, 0x38), // a tie: to even (mantissa 0)
            (1.1875, 0x3a), // a tie: to even (mantissa 2)
        ] {
            assert_eq!(to_e4m3(x), bits, "{x}");
        }
        for b in 0..=255u8 {
            let v = from_e4m3(b);
            if !v.is_nan() {
                assert_eq!(to_e4m3(v), b & if v == 0.0 { 0x80 } else { 0xff }, "{b:#x}");
            }
        }
    }
}
