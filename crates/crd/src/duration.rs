//! Duration strings such as `500ms`, `1m` or `1h30m`.
//!
//! The accepted grammar is exactly [`crate::policy::DURATION_PATTERN`], the subset of Go's
//! `time.ParseDuration` without fractions or `us`/`ns`, so the API server's CEL `duration()` check
//! and this parser never disagree about a policy.

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration")]
    Empty,
    #[error("expected a number at byte {0} (durations look like 500ms, 1s, 1m, 1h30m)")]
    ExpectedNumber(usize),
    #[error("unknown or missing unit at byte {0}: use ms, s, m or h")]
    BadUnit(usize),
    #[error("number too large")]
    Overflow,
}

/// [`parse`] for command-line flags and annotations (clap's `value_parser`): every duration
/// tollgate reads, in a policy, a flag or an annotation, follows this one grammar.
pub fn parse_flag(s: &str) -> Result<Duration, String> {
    parse(s.trim()).map_err(|e| format!("{s:?} is not a duration such as 500ms, 5s or 1h30m: {e}"))
}

/// Parses `[0-9]+(ms|s|m|h)` repeated, e.g. `1h30m`.
pub fn parse(s: &str) -> Result<Duration, DurationError> {
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total_ms: u64 = 0;
    while i < bytes.len() {
        let start = i;
        let mut n: u64 = 0;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            n = n
                .checked_mul(10)
                .and_then(|n| n.checked_add(u64::from(bytes[i] - b'0')))
                .ok_or(DurationError::Overflow)?;
            i += 1;
        }
        if i == start {
            return Err(DurationError::ExpectedNumber(start));
        }
        let (unit_ms, len) = match &bytes[i..] {
            [b'm', b's', ..] => (1, 2),
            [b's', ..] => (1_000, 1),
            [b'm', ..] => (60_000, 1),
            [b'h', ..] => (3_600_000, 1),
            _ => return Err(DurationError::BadUnit(i)),
        };
        i += len;
        total_ms = n
            .checked_mul(unit_ms)
            .and_then(|ms| total_ms.checked_add(ms))
            .ok_or(DurationError::Overflow)?;
    }
    Ok(Duration::from_millis(total_ms))
}

/// Formats a duration in the largest units that represent it exactly (`90s` → `1m30s`).
pub fn format(d: Duration) -> String {
    let mut ms = d.as_millis();
    if ms == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    for (unit, size) in [("h", 3_600_000u128), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
        if ms >= size {
            out.push_str(&format!("{}{unit}", ms / size));
            ms %= size;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_sums() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("1m500ms"), Ok(Duration::from_millis(60_500)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects_what_the_schema_pattern_rejects() {
        assert_eq!(parse(""), Err(DurationError::Empty));
        assert_eq!(parse("m"), Err(DurationError::ExpectedNumber(0)));
        assert_eq!(parse("10"), Err(DurationError::BadUnit(2)));
        assert_eq!(parse("1d"), Err(DurationError::BadUnit(1)));
        assert_eq!(parse("1.5s"), Err(DurationError::BadUnit(1)));
        assert_eq!(parse("-1s"), Err(DurationError::ExpectedNumber(0)));
        assert_eq!(parse("1s "), Err(DurationError::ExpectedNumber(2)));
        assert_eq!(parse("99999999999999999999h"), Err(DurationError::Overflow));
    }

    #[test]
    fn format_round_trips() {
        for s in ["1h30m", "1m", "500ms", "1s", "2h", "1m1s1ms"] {
            assert_eq!(format(parse(s).unwrap()), s);
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,24}") {
            let _ = parse(&s);
        }

        #[test]
        fn agrees_with_pattern(s in "[0-9a-z]{0,8}") {
            let re = regex::Regex::new(crate::policy::DURATION_PATTERN).unwrap();
            // Numbers up to 9 digits cannot overflow, so the pattern and the parser agree.
            proptest::prop_assert_eq!(re.is_match(&s), parse(&s).is_ok(), "{}", s);
        }
    }
}
