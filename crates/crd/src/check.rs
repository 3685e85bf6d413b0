//! `check`: the policy files in words, or every error with its field path. The sidecar's
//! `check` and `kubectl tollgate check` both print this report.

use std::path::PathBuf;

/// `tollgate-sidecar check` (and `kubectl tollgate check`): prints each rule of the policy
/// files in words to stdout, or every error with its field path to stderr; FAILURE on errors.
pub fn run(paths: &[PathBuf]) -> std::process::ExitCode {
    let mut failed = false;
    for path in paths {
        match crate::files::load(path) {
            Ok(policies) => {
                for p in &policies {
                    println!(
                        "policy {} (selects {})",
                        p.id(),
                        describe_selector(&p.selector)
                    );
                    for r in &p.rules {
                        println!("  - {}", r.describe());
                    }
                    if !p.bypass.keys.is_empty() || !p.bypass.cidrs.is_empty() {
                        println!(
                            "  bypass: {} key(s), networks {:?}",
                            p.bypass.keys.len(),
                            p.bypass
                                .cidrs
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                        );
                    }
                }
            }
            Err(errors) => {
                failed = true;
                for e in errors {
                    eprintln!("error: {e}");
                }
            }
        }
    }
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

fn describe_selector(s: &crate::compiled::Selector) -> String {
    if s.match_labels.is_empty() && s.match_expressions.is_empty() {
        return "every pod in the namespace".to_string();
    }
    let mut parts: Vec<String> = s
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in &s.match_expressions {
        parts.push(format!("{} {:?} {:?}", e.key, e.operator, e.values));
    }
    format!("pods with {}", parts.join(", "))
}
