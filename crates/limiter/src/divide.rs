//! Division by a per-rule constant without the `div` instruction (20–90 cycles on common
//! x86 cores): a precomputed multiply-high and shift (Granlund–Montgomery, as in libdivide).
//! Used for the `remaining` header on every decision.

/// Precomputed unsigned 64-bit divisor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Divisor {
    d: u64,
    magic: u64,
    shift: u32,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Power of two: plain shift.
    Shift,
    /// `mulhi(n, magic) >> shift`.
    Mul,
    /// 65-bit magic: `((n − q) / 2 + q) >> shift` with `q = mulhi(n, magic)`.
    MulAdd,
}

#[inline(always)]
fn mulhi(a: u64, b: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) >> 64) as u64
}

impl Divisor {
    /// Divisor `d` (0 is treated as 1).
    pub(crate) fn new(d: u64) -> Self {
        let d = d.max(1);
        let log2 = 63 - d.leading_zeros();
        if d.is_power_of_two() {
            return Self {
                d,
                magic: 0,
                shift: log2,
                kind: Kind::Shift,
            };
        }
        let num = 1u128 << (64 + log2);
        let d128 = u128::from(d);
        // 2^(64+log2) / d is in [2^63, 2^64) because 2^log2 < d < 2^(log2+1).
        let m = (num / d128) as u64;
        let rem = (num % d128) as u64;
        let e = d - rem;
        if e < (1u64 << log2) {
            Self {
                d,
                magic: m.wrapping_add(1),
                shift: log2,
                kind: Kind::Mul,
            }
        } else {
            // Double the magic (one more bit of precision), correcting with the remainder.
            let twice_rem = rem.wrapping_add(rem);
            let carry = u64::from(twice_rem >= d || twice_rem < rem);
            let m = m.wrapping_add(m).wrapping_add(carry);
            Self {
                d,
                magic: m.wrapping_add(1),
                shift: log2,
                kind: Kind::MulAdd,
            }
        }
    }

    /// `n / d`.
    #[inline(always)]
    pub(crate) fn div(&self, n: u64) -> u64 {
        match self.kind {
            Kind::Shift => n >> self.shift,
            Kind::Mul => mulhi(n, self.magic) >> self.shift,
            Kind::MulAdd => {
                let q = mulhi(n, self.magic);
                (((n - q) >> 1) + q) >> self.shift
            }
        }
    }

    /// `ceil(n / d)` for a 128-bit dividend (saturating).
    #[inline]
    pub(crate) fn div_ceil_u128(&self, n: u128) -> u64 {
        let q = self.div_u128(n);
        if u128::from(q) * u128::from(self.d) < n {
            q.saturating_add(1)
        } else {
            q
        }
    }

    /// `n / d` for a 128-bit dividend (saturating), using the fast path when it fits.
    #[inline]
    pub(crate) fn div_u128(&self, n: u128) -> u64 {
        match u64::try_from(n) {
            Ok(n) => self.div(n),
            Err(_) => u64::try_from(n / u128::from(self.d)).unwrap_or(u64::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EDGE: [u64; 14] = [
        1,
        2,
        3,
        5,
        6,
        7,
        10,
        641,
        1_000_000_000,
        (1 << 32) + 1,
        (1 << 63) - 1,
        1 << 63,
        (1 << 63) + 1,
        u64::MAX,
    ];

    #[test]
    fn edges() {
        for d in EDGE.into_iter().chain([u64::MAX - 1, 60_000_000_000]) {
            let div = Divisor::new(d);
            for n in EDGE
                .into_iter()
                .chain([0, d - 1, d, d.wrapping_add(1), u64::MAX - 1])
            {
                assert_eq!(div.div(n), n / d, "{n} / {d}");
            }
        }
        assert_eq!(Divisor::new(0).div(7), 7);
        assert_eq!(Divisor::new(3).div_u128(u128::MAX), u64::MAX);
        assert_eq!(Divisor::new(1 << 20).div_u128(1u128 << 80), 1 << 60);
    }

    proptest! {
        #[test]
        fn matches_hardware_division(d in 1u64.., n: u64, small in 1u64..100_000) {
            prop_assert_eq!(Divisor::new(d).div(n), n / d);
            prop_assert_eq!(Divisor::new(small).div(n), n / small);
            let wide = u128::from(n) * u128::from(small);
            prop_assert_eq!(u128::from(Divisor::new(d).div_u128(wide)), (wide / u128::from(d)).min(u128::from(u64::MAX)));
            prop_assert_eq!(u128::from(Divisor::new(d).div_ceil_u128(wide)), wide.div_ceil(u128::from(d)).min(u128::from(u64::MAX)));
        }
    }
}
