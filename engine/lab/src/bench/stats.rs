//! Welch's two-sample t-test, for telling whether two timing distributions are separable: the
//! statistic, its Welch–Satterthwaite degrees of freedom, and the two-sided p-value from
//! Student's t distribution (through the regularized incomplete beta function).

/// Mean and unbiased variance.
fn moments(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var)
}

/// Welch's test of `a` against `b`: `(t, degrees of freedom, two-sided p)`. NaN with fewer than
/// two samples on a side; p = 1 when both sides are constant and equal.
pub fn welch(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    if a.len() < 2 || b.len() < 2 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let ((ma, va), (mb, vb)) = (moments(a), moments(b));
    let (sa, sb) = (va / a.len() as f64, vb / b.len() as f64);
    let se2 = sa + sb;
    if se2 == 0.0 {
        return if ma == mb {
            (0.0, f64::INFINITY, 1.0)
        } else {
            (f64::INFINITY, f64::INFINITY, 0.0)
        };
    }
    let t = (ma - mb) / se2.sqrt();
    let df = se2 * se2 / (sa * sa / (a.len() as f64 - 1.0) + sb * sb / (b.len() as f64 - 1.0));
    (t, df, student_two_sided(t, df))
}

/// P(|T| >= |t|) for Student's t with `df` degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2).
pub fn student_two_sided(t: f64, df: f64) -> f64 {
    if !t.is_finite() {
        return 0.0;
    }
    reg_inc_beta(df / 2.0, 0.5, df / (df + t * t))
}

/// ln Γ(x) for x > 0, by the Lanczos approximation (g = 7, nine terms), with the reflection
/// formula below 1/2.
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut sum = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        sum += c / (x + i as f64);
    }
    let t = x + G + 0.5;
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// The regularized incomplete beta function I_x(a, b), by its continued fraction (evaluated
/// with the modified Lentz method) on whichever side of the mean converges fast.
fn reg_inc_beta(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_fraction(a, b, x) / a
    } else {
        1.0 - ln_front.exp() * beta_fraction(b, a, 1.0 - x) / b
    }
}

/// The continued fraction of the incomplete beta function at (a, b, x).
fn beta_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let clamp = |v: f64| if v.abs() < TINY { TINY } else { v };
    let mut c = 1.0;
    let mut d = 1.0 / clamp(1.0 - (a + b) * x / (a + 1.0));
    let mut f = d;
    for m in 1..=300 {
        let m = f64::from(m);
        // The even step, then the odd one.
        let even = m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m));
        d = 1.0 / clamp(1.0 + even * d);
        c = clamp(1.0 + even / c);
        f *= c * d;
        let odd = -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0));
        d = 1.0 / clamp(1.0 + odd * d);
        c = clamp(1.0 + odd / c);
        let step = c * d;
        f *= step;
        if (step - 1.0).abs() < 1e-14 {
            break;
        }
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn student_t_matches_its_tables() {
        // Two-sided 5% critical values: df 1, 10, 30, and the normal's 1.96 at large df.
        for (t, df, p) in [
            (12.706, 1.0, 0.05),
            (2.228, 10.0, 0.05),
            (2.042, 30.0, 0.05),
            (1.960, 1e6, 0.05),
            (2.576, 1e6, 0.01),
            (0.0, 5.0, 1.0),
        ] {
            let got = student_two_sided(t, df);
            assert!((got - p).abs() < 5e-4, "t {t} df {df}: {got}, want {p}");
        }
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-12);
    }

    #[test]
    fn welch_separates_shifted_samples_only() {
        let a: Vec<f64> = (0..50).map(|i| 10.0 + f64::from(i % 7)).collect();
        let same: Vec<f64> = (0..50).map(|i| 10.0 + f64::from((i + 3) % 7)).collect();
        let shifted: Vec<f64> = a.iter().map(|x| x + 3.0).collect();
        assert!(welch(&a, &same).2 > 0.5, "{:?}", welch(&a, &same));
        assert!(welch(&a, &shifted).2 < 1e-6, "{:?}", welch(&a, &shifted));
        assert!(welch(&a[..1], &same).2.is_nan());
    }
}
