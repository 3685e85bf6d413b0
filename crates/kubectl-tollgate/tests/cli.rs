//! The binary's command line, run as kubectl runs a plugin: help on every subcommand, usage
//! errors exit 2, `check` works offline, and a cluster that cannot be reached is an error
//! (exit 1) with a message on stderr.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kubectl-tollgate"))
        .args(args)
        // No cluster configuration from the environment.
        .env_remove("KUBECONFIG")
        .env("HOME", env!("CARGO_TARGET_TMPDIR"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("run kubectl-tollgate")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_subcommand_has_help() {
    let top = run(&["--help"]);
    assert!(top.status.success());
    for sub in ["status", "top", "check", "why"] {
        assert!(text(&top.stdout).contains(sub), "{sub} missing from --help");
        let out = run(&[sub, "--help"]);
        assert!(out.status.success(), "{sub} --help: {}", text(&out.stderr));
        let help = text(&out.stdout);
        assert!(help.contains("Usage: kubectl tollgate"), "{sub}: {help}");
        if sub != "check" {
            assert!(
                help.contains("--namespace") && help.contains("--kubeconfig"),
                "{help}"
            );
            assert!(help.contains("--output"), "{sub}: {help}");
        }
    }
    let status = text(&run(&["status", "--help"]).stdout);
    assert!(
        status.contains("tollgate_controller_stream_lag_seconds"),
        "{status}"
    );
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["frobnicate"][..],
        &["top"],
        &["why"],
        &["check"],
        &["status", "-o", "xml"],
        &["why", "--pod", "p", "--header", "novalue"],
    ] {
        let out = run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
}

#[test]
fn an_unreachable_cluster_is_an_error_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-kubeconfig");
    let out = run(&["status", "--kubeconfig", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("no-such-kubeconfig"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn check_explains_good_files_and_names_the_field_of_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\n\
         metadata: {name: api, namespace: shop}\n\
         spec:\n  targetRef: {selector: {matchLabels: {app: api}}}\n  rules:\n\
         \x20 - name: per-key\n    key: [{header: x-api-key}]\n    limit: {requests: 10, period: 1m}\n",
    )
    .unwrap();
    let out = run(&["check", good.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("policy shop/api (selects pods with app=api)"),
        "{stdout}"
    );
    assert!(stdout.contains("per-key"), "{stdout}");

    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&good)
            .unwrap()
            .replace("requests: 10", "requests: 0"),
    )
    .unwrap();
    let out = run(&["check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("spec.rules[0].limit.requests"), "{err}");
}
