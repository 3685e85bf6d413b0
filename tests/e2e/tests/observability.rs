//! The Grafana dashboard and the alert rules shipped in the chart are valid and only use metrics
//! tollgate really exports: every expression parses as PromQL, and every `tollgate_*` metric it
//! names appears on the `/metrics` endpoint of a real sidecar or controller.

use std::collections::BTreeSet;
use std::time::Duration;

use tollgate_e2e::{ControlPlane, Sidecar, free_port, install_crd, repo_root, start_controller};

/// Every PromQL expression in the dashboard and the alert file, Grafana variables filled in.
fn expressions() -> Vec<(String, String)> {
    let root = repo_root().join("charts/tollgate");
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("dashboards/tollgate.json")).unwrap(),
    )
    .expect("dashboard is valid JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        assert!(panel["title"].as_str().is_some_and(|t| !t.is_empty()));
        for target in panel["targets"].as_array().expect("targets") {
            out.push((
                format!("dashboard panel {:?}", panel["title"]),
                target["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    let alerts: serde_norway::Value = serde_norway::from_str(
        &std::fs::read_to_string(root.join("alerts/tollgate-alerts.yaml")).unwrap(),
    )
    .expect("alerts are valid YAML");
    for group in alerts["groups"].as_sequence().expect("rule groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("alert name").to_string();
            assert!(
                rule["annotations"]["summary"].as_str().is_some(),
                "{name} has no summary"
            );
            out.push((
                format!("alert {name}"),
                rule["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out.into_iter()
        .map(|(w, e)| {
            (
                w,
                e.replace("$__rate_interval", "5m")
                    .replace("$namespace", ".*"),
            )
        })
        .collect()
}

fn scrape(url: &str) -> String {
    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = client.get(url).send().and_then(|r| r.text()) {
            return text;
        }
        assert!(std::time::Instant::now() < deadline, "{url} did not answer");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Metric family names from an OpenMetrics/Prometheus text exposition.
fn families(text: &str, into: &mut BTreeSet<String>) {
    for line in text.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split_whitespace().next(),
            None if !line.starts_with('#') => line.split(['{', ' ']).next(),
            None => None,
        };
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            into.insert(n.to_string());
        }
    }
}

#[test]
fn dashboard_and_alerts_parse_and_use_real_metrics() {
    let exprs = expressions();
    assert!(exprs.len() >= 15, "{} expressions", exprs.len());
    for (where_, expr) in &exprs {
        if let Err(e) = promql_parser::parser::parse(expr) {
            panic!("{where_}: invalid PromQL {expr:?}: {e}");
        }
    }

    // A real sidecar (with a rule so per-rule series exist, and Redis configured so the global
    // metrics are live) and a real controller.
    let mut names = BTreeSet::new();
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.yaml");
    std::fs::write(
        &policy,
        std::fs::read_to_string(repo_root().join("manifests/examples/per-api-key.yaml")).unwrap(),
    )
    .unwrap();
    let redis = format!("redis://127.0.0.1:{}", free_port());
    let sidecar = Sidecar::start(
        "tollgate-sidecar",
        "http://127.0.0.1:9",
        &["--policies", policy.to_str().unwrap(), "--redis", &redis],
    );
    let (listen, admin) = (sidecar.listen, sidecar.admin);
    // One request with Redis unreachable: the error and fallback series come into being.
    let _ = tollgate_e2e::http_client()
        .build()
        .unwrap()
        .get(format!("http://127.0.0.1:{listen}/"))
        .header("x-api-key", "k")
        .send();
    families(
        &scrape(&format!("http://127.0.0.1:{admin}/metrics")),
        &mut names,
    );

    let cp = ControlPlane::start();
    install_crd(&cp);
    let port = free_port();
    let _controller = start_controller(&cp, "tollgate-controller", port, &[]);
    families(
        &scrape(&format!("http://127.0.0.1:{port}/metrics")),
        &mut names,
    );

    let metric = regex::Regex::new(r"\btollgate_[a-z0-9_]+").unwrap();
    let mut missing = BTreeSet::new();
    for (where_, expr) in &exprs {
        for m in metric.find_iter(expr) {
            let name = m.as_str();
            let family = ["_bucket", "_sum", "_count", "_total"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            if !names.contains(name) && !names.contains(family) {
                missing.insert(format!("{where_}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "metrics not exported by tollgate: {missing:#?}\nexported: {names:#?}"
    );
}
