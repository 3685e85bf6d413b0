//! Output as kubectl prints it: aligned tables with upper-case headers, JSON or YAML, ages.

use std::fmt::Write as _;

use k8s_openapi::jiff::Timestamp;

use crate::cli::Output;

/// Columns left-aligned and separated by three spaces, as kubectl's tables are; the last
/// column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>], no_headers: bool) -> String {
    let mut all: Vec<Vec<String>> = Vec::with_capacity(rows.len() + 1);
    if !no_headers {
        all.push(headers.iter().map(|h| h.to_string()).collect());
    }
    all.extend(rows.iter().cloned());
    let columns = headers.len();
    let mut widths = vec![0; columns];
    for row in &all {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &all {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate().take(columns) {
            if i + 1 == columns {
                line.push_str(cell);
            } else {
                let pad = widths[i] - cell.chars().count() + 3;
                let _ = write!(line, "{cell}{:pad$}", "");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Prints `value` as JSON or YAML; false for the table formats.
pub fn structured(value: &serde_json::Value, format: Option<Output>) -> anyhow::Result<bool> {
    match format {
        Some(Output::Json) => {
            println!("{}", serde_json::to_string_pretty(value)?);
            Ok(true)
        }
        Some(Output::Yaml) => {
            print!("{}", serde_norway::to_string(value)?);
            Ok(true)
        }
        Some(Output::Wide) | None => Ok(false),
    }
}

/// A duration as kubectl's AGE column shows it: `45s`, `5m3s`, `3h12m`, `4d5h`, `400d`.
pub fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..120 => format!("{s}s"),
        120..600 => format!("{}m{}s", s / 60, s % 60),
        600..10_800 => format!("{}m", s / 60),
        10_800..172_800 => two_units(s / 3600, "h", (s % 3600) / 60, "m"),
        172_800..2_592_000 => two_units(s / 86_400, "d", (s % 86_400) / 3600, "h"),
        _ => format!("{}d", s / 86_400),
    }
}

fn two_units(major: i64, a: &str, minor: i64, b: &str) -> String {
    if minor == 0 {
        format!("{major}{a}")
    } else {
        format!("{major}{a}{minor}{b}")
    }
}

/// The age of a timestamp, or `<unknown>`.
pub fn age_of(t: Option<Timestamp>) -> String {
    match t {
        Some(t) => age(Timestamp::now().as_second() - t.as_second()),
        None => "<unknown>".to_string(),
    }
}

/// The age of an RFC 3339 timestamp given as text.
pub fn age_of_text(t: &str) -> String {
    age_of(t.parse().ok())
}

/// `-` for a missing value, as kubectl shows `<none>`-like gaps compactly.
pub fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_like_kubectl() {
        let t = table(
            &["NAME", "ACCEPTED", "AGE"],
            &[
                vec!["a".into(), "True".into(), "5s".into()],
                vec!["long-name".into(), "False".into(), "12m".into()],
            ],
            false,
        );
        assert_eq!(
            t,
            "NAME        ACCEPTED   AGE\n\
             a           True       5s\n\
             long-name   False      12m\n"
        );
        let t = table(&["A", "B"], &[vec!["x".into(), "y".into()]], true);
        assert_eq!(t, "x   y\n");
    }

    #[test]
    fn ages_read_like_kubectl() {
        assert_eq!(age(-3), "0s");
        assert_eq!(age(45), "45s");
        assert_eq!(age(119), "119s");
        assert_eq!(age(303), "5m3s");
        assert_eq!(age(900), "15m");
        assert_eq!(age(3 * 3600 + 12 * 60), "3h12m");
        assert_eq!(age(5 * 3600), "5h");
        assert_eq!(age(3 * 3600 + 10 * 60), "3h10m");
        assert_eq!(age(4 * 86_400 + 5 * 3600), "4d5h");
        assert_eq!(age(400 * 86_400), "400d");
        assert_eq!(age_of_text("not a time"), "<unknown>");
    }
}
