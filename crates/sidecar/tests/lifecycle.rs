//! Configuration and process lifecycle: hot reload, `check`, the admin port, graceful shutdown.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]
#![allow(
    clippy::too_many_lines,
    reason = "a scenario test reads top to bottom as one story: setup, steps, checks"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

fn limit_policy(requests: u64, period: &str) -> String {
    policy(
        "reloadable",
        &format!(
            "
            rules:
              - name: per-key
                key:
                  - header: x-api-key
                limit:
                  requests: {requests}
                  period: {period}
                scope: Local
            "
        ),
    )
}

/// Sends `n + 1` requests with a key never used before and reports whether exactly the first
/// `n` were admitted, i.e. whether a limit of `n` is in force.
async fn limit_in_force(c: &reqwest::Client, url: &str, fresh: &AtomicUsize, n: usize) -> bool {
    let key = format!("probe-{}", fresh.fetch_add(1, Ordering::SeqCst));
    let got = statuses(c, url, &[("x-api-key", &key)], n + 1).await;
    let mut want = vec![200u16; n];
    want.push(429);
    got == want
}

async fn debug_config(c: &reqwest::Client, sc: &Sidecar) -> serde_json::Value {
    let resp = c.get(sc.admin_url("/debug/config")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_applies_good_edits_and_refuses_bad_ones() {
    within(90, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &limit_policy(10, "1m"), &[]).await;
        let c = client();
        let url = sc.url("/");
        let fresh = Arc::new(AtomicUsize::new(0));
        assert!(
            limit_in_force(&c, &url, &fresh, 10).await,
            "initial limit of 10"
        );

        // A lower limit is enforced within about two seconds.
        let edited = Instant::now();
        sc.write_policy(&limit_policy(2, "1m"));
        poll_until(Duration::from_secs(4), "the lowered limit", || {
            let (c, url, fresh) = (c.clone(), url.clone(), Arc::clone(&fresh));
            async move { limit_in_force(&c, &url, &fresh, 2).await.then_some(()) }
        })
        .await;
        let took = edited.elapsed();
        assert!(took < Duration::from_millis(3500), "reload took {took:?}");
        assert_eq!(debug_config(&c, &sc).await["version"], 2);

        // An invalid edit is refused: the error is reported with its field path, the last good
        // rules stay in force.
        sc.write_policy(&limit_policy(1, "10 parsecs"));
        let error = poll_until(Duration::from_secs(4), "the reload error", || {
            let c = c.clone();
            let admin = sc.admin_url("/debug/config");
            async move {
                let v: serde_json::Value = c.get(admin).send().await.ok()?.json().await.ok()?;
                v["configError"].as_str().map(str::to_string)
            }
        })
        .await;
        assert!(
            error.contains("spec.rules[0].limit.period"),
            "error does not name the field: {error}"
        );
        assert!(
            error.contains("policy.yaml"),
            "error does not name the file: {error}"
        );
        assert_eq!(
            debug_config(&c, &sc).await["version"],
            2,
            "the bad edit was applied"
        );
        let m = sc.metrics(&c).await;
        assert_eq!(
            metric(&m, "tollgate_config_last_reload_successful", &[]),
            Some(0.0),
            "{m}"
        );
        assert_eq!(
            metric(&m, "tollgate_config_errors_total", &[]),
            Some(1.0),
            "{m}"
        );
        assert!(
            limit_in_force(&c, &url, &fresh, 2).await,
            "old rules no longer in force"
        );
        let ready = c.get(sc.admin_url("/readyz")).send().await.unwrap();
        assert_eq!(
            ready.status(),
            200,
            "a refused reload must not make the pod unready"
        );

        // A misspelled field is refused the same way (it used to load as a policy without
        // it): reported with its path, the last good rules stay in force.
        sc.write_policy(
            &limit_policy(1, "1m")
                .replace("        period: 1m", "        period: 1m\n        burts: 1"),
        );
        let error = poll_until(Duration::from_secs(4), "the misspelling error", || {
            let c = c.clone();
            let admin = sc.admin_url("/debug/config");
            async move {
                let v: serde_json::Value = c.get(admin).send().await.ok()?.json().await.ok()?;
                let e = v["configError"].as_str()?;
                e.contains("burts").then(|| e.to_string())
            }
        })
        .await;
        assert!(
            error.contains("spec.rules[0].limit.burts: unknown field (did you mean `burst`?)"),
            "{error}"
        );
        assert_eq!(
            debug_config(&c, &sc).await["version"],
            2,
            "the misspelled edit was applied"
        );
        let m = sc.metrics(&c).await;
        assert_eq!(
            metric(&m, "tollgate_config_errors_total", &[]),
            Some(2.0),
            "{m}"
        );
        assert!(
            limit_in_force(&c, &url, &fresh, 2).await,
            "old rules no longer in force after a misspelled edit"
        );

        // Fixing the file recovers.
        sc.write_policy(&limit_policy(4, "1m"));
        poll_until(Duration::from_secs(4), "recovery", || {
            let (c, sc_admin) = (c.clone(), sc.admin_url("/debug/config"));
            async move {
                let v: serde_json::Value = c.get(sc_admin).send().await.ok()?.json().await.ok()?;
                (v["configError"].is_null() && v["version"] == 3).then_some(())
            }
        })
        .await;
        assert!(
            limit_in_force(&c, &url, &fresh, 4).await,
            "the fixed limit of 4"
        );
        let m = sc.metrics(&c).await;
        assert_eq!(
            metric(&m, "tollgate_config_last_reload_successful", &[]),
            Some(1.0),
            "{m}"
        );
    })
    .await;
}

#[test]
fn refuses_to_start_with_an_invalid_policy() {
    refuses_to_start_with(&limit_policy(5, "soon"), "spec.rules[0].limit.period");
    // A misspelled field is as invalid as a bad value.
    refuses_to_start_with(
        &limit_policy(5, "1m").replace(
            "      scope: Local",
            "      scope: Local\n      failurMode: Closed",
        ),
        "spec.rules[0].failurMode: unknown field (did you mean `failureMode`?)",
    );
}

fn refuses_to_start_with(yaml: &str, needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, yaml).unwrap();
    let mut child = Command::new(BIN)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .args(["--upstream", "http://127.0.0.1:9"])
        .arg("--policies")
        .arg(&file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sidecar with an invalid policy is still running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "started with an invalid policy");
    assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../manifests/examples")
}

/// Rule names declared in a policy file (`- name: x` list items).
fn rule_names(yaml: &str) -> Vec<String> {
    yaml.lines()
        .filter_map(|l| l.trim().strip_prefix("- name:"))
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn check_describes_every_example_in_words() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(examples_dir())
        .expect("manifests/examples")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 5,
        "expected the example policies, found {files:?}"
    );
    for file in &files {
        let (status, out, err) = run_check(&[file]);
        assert!(
            status.success(),
            "check {} failed:\n{out}\n{err}",
            file.display()
        );
        assert_eq!(
            out.lines().filter(|l| l.starts_with("policy ")).count(),
            1,
            "{}:\n{out}",
            file.display()
        );
        let names = rule_names(&std::fs::read_to_string(file).unwrap());
        assert!(!names.is_empty());
        for name in names {
            let line = out
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("- {name}: ")))
                .unwrap_or_else(|| panic!("rule {name} not described:\n{out}"));
            assert!(line.contains(" requests per "), "no limit in words: {line}");
            assert!(
                line.contains("429") || line.contains("shadow"),
                "no action in words: {line}"
            );
        }
    }
    // The whole directory at once.
    let (status, out, err) = run_check(&[&examples_dir()]);
    assert!(status.success(), "{out}\n{err}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("policy ")).count(),
        files.len()
    );
}

#[test]
fn check_reports_every_error_with_its_field_path() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        policy(
            "broken",
            "
            rules:
              - name: ok-rule
                limit:
                  requests: 5
                  period: 10s
                scope: Local
              - name: bad-rule
                limit:
                  requests: 5
                  period: 10 parsecs
                scope: Local
            bypass:
              cidrs: [10.0.0.0/33]
            ",
        ),
    )
    .unwrap();
    let (status, out, err) = run_check(&[&bad]);
    assert!(!status.success(), "check accepted a broken policy:\n{out}");
    assert!(err.contains("spec.rules[1].limit.period"), "{err}");
    assert!(
        err.contains("spec.bypass.cidrs"),
        "second error not reported: {err}"
    );

    // Misspelled fields are errors, not silently different policies, reported with
    // the others.
    let typos = dir.path().join("typos.yaml");
    std::fs::write(
        &typos,
        policy(
            "typos",
            "
            failurMode: Closed
            rules:
              - name: ok-rule
                limit:
                  requests: 5
                  period: 10s
                  burts: 5
                scope: Local
              - name: bad-rule
                limit:
                  requests: 0
                  period: 10s
                scope: Local
            ",
        ),
    )
    .unwrap();
    let (status, out, typo_err) = run_check(&[&typos]);
    assert!(
        !status.success(),
        "check accepted misspelled fields:\n{out}"
    );
    for needle in [
        "typos.yaml: policy typos: spec.failurMode: unknown field (did you mean `failureMode`?)",
        "typos.yaml: policy typos: spec.rules[0].limit.burts: unknown field (did you mean `burst`?)",
        "spec.rules[1].limit.requests",
    ] {
        assert!(typo_err.contains(needle), "{needle:?} not in {typo_err}");
    }
    assert!(
        err.contains("bad.yaml"),
        "error does not name the file: {err}"
    );

    let syntax = dir.path().join("syntax.yaml");
    std::fs::write(
        &syntax,
        "apiVersion: tollgate.dev/v1alpha1\nkind: [unclosed\n",
    )
    .unwrap();
    let (status, _, err) = run_check(&[&syntax]);
    assert!(!status.success());
    assert!(err.contains("syntax.yaml"), "{err}");

    // One bad file among good ones still fails the whole check.
    let good = examples_dir().join("demo-local.yaml");
    let (status, out, _) = run_check(&[&good, &bad]);
    assert!(!status.success());
    assert!(out.contains("policy default/demo"), "{out}");

    let (status, _, err) = run_check(&[&dir.path().join("missing.yaml")]);
    assert!(!status.success());
    assert!(err.contains("missing.yaml"), "{err}");
}

/// Whether `line` is a Prometheus/OpenMetrics sample: `name{labels} value`.
fn is_sample(line: &str) -> bool {
    let Some((series, value)) = line.rsplit_once(' ') else {
        return false;
    };
    let value_ok = value.parse::<f64>().is_ok() || matches!(value, "+Inf" | "-Inf" | "NaN");
    let (name, labels) = match series.find('{') {
        Some(i) => (&series[..i], Some(&series[i..])),
        None => (series, None),
    };
    let name_ok = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    let labels_ok = labels.is_none_or(|l| {
        l.ends_with('}')
            && l[1..l.len() - 1].split(',').all(|pair| {
                pair.split_once('=').is_some_and(|(k, v)| {
                    !k.is_empty()
                        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        && v.len() >= 2
                        && v.starts_with('"')
                        && v.ends_with('"')
                })
            })
    });
    value_ok && name_ok && labels_ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_report_health_metrics_and_rules() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = policy(
            "admin",
            "
            rules:
              - name: per-key
                key:
                  - header: x-api-key
                limit:
                  requests: 1
                  period: 1m
                scope: Local
              - name: everyone
                limit:
                  requests: 1000
                  period: 1h
                  algorithm: SlidingWindow
                scope: Global
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        assert_eq!(
            statuses(&c, &sc.url("/"), &[("x-api-key", "a")], 2).await,
            [200, 429]
        );

        // The rejected key tops /debug/top-keys, hashed (raw keys are off by default).
        let top = sc.admin_json(&c, "/debug/top-keys").await;
        let first = &top["topKeys"][0];
        assert_eq!(first["rule"], "test/admin/per-key", "{top}");
        assert_eq!(first["rejected"], 1, "{top}");
        assert!(first["key"].is_null(), "raw key leaked: {top}");
        assert_eq!(first["keyHash"].as_str().map(str::len), Some(16), "{top}");

        let resp = c.get(sc.admin_url("/healthz")).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let resp = c.get(sc.admin_url("/readyz")).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let resp = c.get(sc.admin_url("/no-such-page")).send().await.unwrap();
        assert_eq!(resp.status(), 404);

        let m = sc.metrics(&c).await;
        let mut samples = 0;
        for line in m.lines() {
            if line.starts_with('#') {
                continue;
            }
            assert!(
                is_sample(line),
                "not a `name{{labels}} value` line: {line:?}"
            );
            samples += 1;
        }
        assert!(samples > 10, "{m}");
        let per_key = |d| {
            metric(
                &m,
                "tollgate_requests_total",
                &[
                    ("policy", "test/admin"),
                    ("rule", "per-key"),
                    ("decision", d),
                ],
            )
        };
        assert_eq!(per_key("allowed"), Some(1.0), "{m}");
        assert_eq!(per_key("rejected"), Some(1.0), "{m}");
        assert_eq!(metric(&m, "tollgate_rules_loaded", &[]), Some(2.0), "{m}");
        assert_eq!(
            metric(&m, "tollgate_config_last_reload_successful", &[]),
            Some(1.0),
            "{m}"
        );
        assert!(metric(&m, "tollgate_decision_duration_seconds_count", &[]).unwrap() >= 2.0);

        let resp = c.get(sc.admin_url("/debug/rules")).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let rules: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(rules["version"], 1, "{rules}");
        let described: Vec<&str> = rules["rules"]
            .as_array()
            .expect("rules array")
            .iter()
            .map(|r| r.as_str().expect("rule description"))
            .collect();
        assert_eq!(described.len(), 2, "{rules}");
        assert!(described[0].starts_with("per-key:"), "{described:?}");
        assert!(described[1].starts_with("everyone:"), "{described:?}");
        // No --redis: the Global rule runs on this sidecar alone, and the words must say so.
        assert!(
            described[1].contains("enforced by this sidecar on its own")
                && !described[1].contains("shared by all sidecars")
                && !described[1].contains("if Redis is unreachable"),
            "{described:?}"
        );
        assert_eq!(
            rules["globalRulesEnforcedLocally"].as_array().map(Vec::len),
            Some(1),
            "{rules}"
        );
        assert_eq!(
            rules["policies"].as_array().map(Vec::len),
            Some(1),
            "{rules}"
        );
        assert!(rules["configError"].is_null(), "{rules}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_exits_cleanly() {
    within(60, async {
        let up = Upstream::start().await;
        let mut sc = Sidecar::start(&up.url(), &limit_policy(100, "1m"), &[]).await;
        let c = client();
        let slow = tokio::spawn({
            let (c, url) = (c.clone(), sc.url("/slow?ms=2500"));
            async move {
                let resp = c.get(url).send().await.expect("in-flight request failed");
                let status = resp.status();
                (status, resp.text().await.expect("in-flight body"))
            }
        });
        poll_until(
            Duration::from_secs(5),
            "the slow request to reach the app",
            || {
                let n = up.in_flight();
                async move { (n == 1).then_some(()) }
            },
        )
        .await;
        sc.terminate();
        // New connections are refused while the old request drains.
        let listen = sc.listen;
        poll_until(
            Duration::from_secs(2),
            "the listener to close",
            || async move {
                tokio::net::TcpStream::connect(listen)
                    .await
                    .is_err()
                    .then_some(())
            },
        )
        .await;
        assert!(
            !slow.is_finished(),
            "the slow request ended before it was served"
        );
        let (status, body) = slow.await.unwrap();
        assert_eq!(status, 200, "in-flight request cut off by shutdown");
        assert_eq!(body, "slow ok");
        let exit = sc.wait_exit(Duration::from_secs(10)).await;
        assert_eq!(exit.code(), Some(0), "exit status {exit:?}");
        assert!(
            sc.logs()
                .iter()
                .any(|l| l.contains("tollgate-sidecar stopped")),
            "{:?}",
            sc.logs()
        );
    })
    .await;
}

/// Idle clients do not hold up a shutdown: neither a kept-alive connection between requests nor
/// one that was opened and never used (a pre-warmed pool). The second used to keep the sidecar
/// alive until the header read timeout (10 s) because it held a graceful-shutdown watcher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_does_not_wait_for_idle_or_unused_connections() {
    within(60, async {
        let up = Upstream::start().await;
        let mut sc = Sidecar::start(&up.url(), &limit_policy(100, "1m"), &[]).await;
        let c = client();
        let resp = c.get(sc.url("/")).send().await.expect("request");
        assert_eq!(resp.status(), 200);
        let _unused = tokio::net::TcpStream::connect(sc.listen)
            .await
            .expect("connect");
        // Let the sidecar accept it before the signal.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        sc.terminate();
        let exit = sc.wait_exit(Duration::from_secs(15)).await;
        let took = started.elapsed();
        assert_eq!(exit.code(), Some(0), "exit status {exit:?}");
        assert!(
            took < Duration::from_secs(3),
            "shutdown took {took:?} with only idle connections open"
        );
    })
    .await;
}
