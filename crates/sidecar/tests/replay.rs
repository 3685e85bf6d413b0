//! `tollgate-sidecar check --policy … --replay …`: a crafted access log replayed through the real
//! binary gives exact per-rule counts, a baseline comparison, hashed (or raw) top keys, and
//! reports malformed lines by number without failing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, policy};

/// 2025-05-01T12:00:00Z in Unix milliseconds: a whole minute, so fixed windows start here.
const T0_MS: u64 = 1_746_100_800_000;

fn ts(offset_s: u64) -> String {
    // RFC 3339 for whole seconds past T0 (all offsets in these tests are under an hour).
    format!("2025-05-01T12:{:02}:{:02}Z", offset_s / 60, offset_s % 60)
}

fn line(offset_s: u64, method: &str, path: &str, key: Option<&str>, ip: &str) -> String {
    let headers = match key {
        Some(k) => format!(r#"{{"x-api-key":"{k}","user-agent":"test"}}"#),
        None => "{}".to_string(),
    };
    format!(
        r#"{{"ts":"{}","method":"{method}","path":"{path}","headers":{headers},"client_ip":"{ip}","status":200}}"#,
        ts(offset_s)
    )
}

/// The rules new_rules() and old_rules() share; only the per-key limit differs.
const SHARED_RULES: &str = "
rules:
- name: per-key
  match: {path: {prefix: /api}}
  key: [{header: x-api-key}]
  limit: {requests: PER_KEY, period: 1m}
  scope: Local
- name: shadow-ip
  match: {methods: [GET]}
  key: [{clientIP: {trustedHops: 0}}]
  limit: {requests: 3, period: 1m, algorithm: FixedWindow}
  mode: Shadow
  scope: Local
";

/// The shared rules with `per_key` requests a minute, then `last_rule`.
fn rules(per_key: u64, last_rule: &str) -> String {
    SHARED_RULES.replace("PER_KEY", &per_key.to_string()) + last_rule
}

fn new_rules() -> String {
    rules(
        2,
        "- name: global-all
  match: {path: {exact: /checkout}}
  limit: {requests: 1, period: 1h}
  scope: Global
",
    )
}

fn old_rules() -> String {
    rules(
        3,
        "- name: legacy
  match: {path: {exact: /legacy}}
  limit: {requests: 1, period: 1m}
  scope: Local
",
    )
}

/// The crafted log; the comments give the expected decisions under new_rules() / old_rules().
fn crafted_log() -> String {
    let audit = r#"{"timestamp":"2025-05-01T12:00:05Z","level":"INFO","event":"rejected","rule":"test/replay/per-key","key_hash":"0123456789abcdef","limit":2,"retry_after_ms":1000,"message":"request rejected","target":"tollgate::audit"}"#;
    [
        line(0, "GET", "/api/x", Some("a"), "10.0.0.1"), // 1 per-key allow; shadow 1/3
        line(1, "GET", "/api/x", Some("a"), "10.0.0.1"), // 2 per-key allow; shadow 2/3
        line(2, "GET", "/api/x", Some("a"), "10.0.0.1"), // 3 new: 429 (a spent) | old: allow, shadow 3/3
        line(3, "GET", "/api/x", Some("a"), "10.0.0.1"), // 4 429 in both
        line(4, "GET", "/api/y?page=2", Some("b"), "10.0.0.1"), // 5 allow; new: shadow 3/3 | old: shadow-rejected
        "this is not json".to_string(),                         // 6 malformed
        line(5, "POST", "/checkout", None, "10.0.0.2"),         // 7 global-all allow
        line(6, "POST", "/checkout", None, "10.0.0.2"), // 8 new: 429 (global-all, 1/h) | old: no rule
        String::new(),                                  // 9 blank
        format!(
            r#"{{"ts":"{}","method":"GET","client_ip":"10.0.0.1"}}"#,
            ts(7)
        ), // 10 malformed
        audit.to_string(),                              // 11 audit line, skipped
        line(7, "GET", "/other", None, "10.0.0.1"), // 12 shadow-rejected (4th GET from .1 this minute)
        line(61, "GET", "/api/x", Some("a"), "10.0.0.1"), // 13 a refilled: allow; new minute for shadow
        line(10, "GET", "/api/x", Some("c"), "10.0.0.3"), // 14 out of order: replayed at 61 s; allow
        line(62, "DELETE", "/nothing", None, "10.0.0.4"), // 15 matches no rule
    ]
    .join("\n")
        + "\n"
}

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("new.yaml"), policy("replay", &new_rules())).unwrap();
        std::fs::write(dir.path().join("old.yaml"), policy("replay", &old_rules())).unwrap();
        std::fs::write(dir.path().join("access.log"), crafted_log()).unwrap();
        Files { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

/// Runs the binary with a time bound; returns (success, stdout, stderr).
fn run(args: &[&str]) -> (bool, String, String) {
    let (code, out, err) = run_code(args);
    (code == Some(0), out, err)
}

/// `tollgate-sidecar check --policy POLICY --replay LOG EXTRA…`: (exit code, stdout, stderr).
fn replay_of(policy: &str, log: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let mut args = vec!["check", "--policy", policy, "--replay", log];
    args.extend_from_slice(extra);
    run_code(&args)
}

/// Whether the run succeeded, with its output.
fn succeeded((code, out, err): (Option<i32>, String, String)) -> (bool, String, String) {
    (code == Some(0), out, err)
}

/// Runs the binary with a time bound; returns (exit code, stdout, stderr).
fn run_code(args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tollgate-sidecar");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            // Kills this child's PID only.
            let _ = child.kill();
            panic!("replay did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The report's lines for one rule (from `rule <id>` to the next rule or section).
fn rule_section<'a>(report: &'a str, id: &str) -> Vec<&'a str> {
    let mut lines = report
        .lines()
        .skip_while(|l| !l.starts_with(&format!("rule {id} ")));
    let mut out: Vec<&str> = lines.next().into_iter().collect();
    out.extend(lines.take_while(|l| l.starts_with("  ")));
    assert!(!out.is_empty(), "no section for {id} in:\n{report}");
    out
}

/// Asserts a line of `section` contains `needle` (the failure shows the section).
fn assert_has(section: &[&str], needle: &str) {
    assert!(section.iter().any(|l| l.contains(needle)), "{section:?}");
}

#[test]
fn replay_reports_exact_counts_per_rule() {
    let f = Files::new();
    let (ok, out, err) = succeeded(replay_of(&f.path("new.yaml"), &f.path("access.log"), &[]));
    assert!(ok, "exit status; stderr:\n{err}\nstdout:\n{out}");
    assert!(
        out.contains("15 lines: 11 requests replayed, 2 malformed, 1 audit lines skipped, 1 blank"),
        "{out}"
    );
    assert!(
        out.contains("log time 2025-05-01T12:00:00.000Z .. 2025-05-01T12:01:02.000Z (1m2s)"),
        "{out}"
    );
    assert!(
        out.contains("1 lines were earlier than a line before them"),
        "{out}"
    );
    assert!(out.contains("line 6: not JSON"), "{out}");
    assert!(out.contains("line 10: missing \"path\""), "{out}");
    assert!(
        out.contains("global rules are simulated locally at their full limit")
            && out.contains("test/replay/global-all"),
        "{out}"
    );
    assert!(
        out.contains("requests: 11, would be rejected: 3 (27.3%), admitted: 8, matched no rule: 1"),
        "{out}"
    );

    let per_key = rule_section(&out, "test/replay/per-key");
    assert!(per_key[0].contains("[Enforce]"), "{per_key:?}");
    assert_has(&per_key, "matched 7, would-allow 5, would-reject 2 (28.6%)");
    assert_has(
        &per_key,
        "top rejected keys (hashed; --raw-keys shows them):",
    );
    // One key ("a") was rejected twice, listed by its 16-hex-digit hash only.
    let keys: Vec<&&str> = per_key.iter().filter(|l| l.starts_with("    ")).collect();
    assert_eq!(keys.len(), 1, "{per_key:?}");
    let (hash, count) = keys[0].trim().split_once(": ").unwrap();
    assert_eq!(hash.len(), 16);
    assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(count, "2");

    let shadow = rule_section(&out, "test/replay/shadow-ip");
    assert!(shadow[0].contains("[Shadow]"), "{shadow:?}");
    assert_has(
        &shadow,
        "matched 6, would-allow 5, would-reject 1 (16.7%; Shadow: counted, not rejected)",
    );

    let global = rule_section(&out, "test/replay/global-all");
    assert_has(&global, "matched 2, would-allow 1, would-reject 1 (50.0%)");
}

#[test]
fn replay_against_a_baseline_shows_the_difference() {
    let f = Files::new();
    let (ok, out, err) = succeeded(replay_of(
        &f.path("new.yaml"),
        &f.path("access.log"),
        &["--baseline", &f.path("old.yaml"), "--raw-keys"],
    ));
    assert!(ok, "stderr:\n{err}\nstdout:\n{out}");
    assert!(
        out.contains(
            "vs baseline: would be rejected 1 -> 3 (+2), newly rejected: 2, no longer rejected: 0"
        ),
        "{out}"
    );
    let per_key = rule_section(&out, "test/replay/per-key");
    assert_has(&per_key, "matched 7, would-allow 5, would-reject 2");
    assert_has(
        &per_key,
        "baseline: matched 7, would-allow 6, would-reject 1 (would-reject +1)",
    );
    // --raw-keys: the key itself, then its hash.
    assert!(
        per_key
            .iter()
            .any(|l| l.trim_start().starts_with("a (") && l.ends_with("): 2")),
        "{per_key:?}"
    );
    let shadow = rule_section(&out, "test/replay/shadow-ip");
    assert_has(
        &shadow,
        "baseline: matched 7, would-allow 5, would-reject 2 (would-reject -1)",
    );
    let global = rule_section(&out, "test/replay/global-all");
    assert_has(&global, "baseline: (not in the baseline)");
    assert!(out.contains("rules only in the baseline:\n  test/replay/legacy: matched 0, would-allow 0, would-reject 0"), "{out}");
}

/// `--output json` carries the same counts as the text report, and `--max-newly-rejected` turns
/// the difference from the baseline into an exit status for CI (2 of 11 requests, 18.2 %).
#[test]
fn replay_as_json_and_the_newly_rejected_gate() {
    let f = Files::new();
    let (new, log, old) = (f.path("new.yaml"), f.path("access.log"), f.path("old.yaml"));
    let against_baseline =
        |extra: &[&str]| replay_of(&new, &log, &[&["--baseline", &old], extra].concat());

    let (code, out, err) = against_baseline(&["--output", "json"]);
    assert_eq!(code, Some(0), "stderr:\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(report["requests"], 11);
    assert_eq!(report["rejected"], 3);
    assert_eq!(report["log"]["malformed"], 2);
    assert_eq!(report["log"]["audit_lines"], 1);
    assert_eq!(report["keys"], "hashed");
    assert_eq!(report["vs_baseline"]["rejected"], 1);
    assert_eq!(report["vs_baseline"]["newly_rejected"], 2);
    assert_eq!(report["vs_baseline"]["no_longer_rejected"], 0);
    let rule = |id: &str| {
        report["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no rule {id} in {report:#}"))
            .clone()
    };
    let per_key = rule("test/replay/per-key");
    assert_eq!(
        (
            &per_key["matched"],
            &per_key["allowed"],
            &per_key["rejected"]
        ),
        (
            &serde_json::json!(7),
            &serde_json::json!(5),
            &serde_json::json!(2)
        )
    );
    assert_eq!(per_key["baseline"]["rejected"], 1);
    let top = &per_key["top_rejected_keys"][0];
    assert_eq!(top["rejections"], 2);
    assert_eq!(top["hash"].as_str().unwrap().len(), 16);
    assert!(top["key"].is_null(), "keys stay hashed without --raw-keys");
    assert_eq!(rule("test/replay/shadow-ip")["mode"], "Shadow");
    assert!(rule("test/replay/global-all")["baseline"].is_null());
    assert_eq!(report["baseline_only_rules"][0]["id"], "test/replay/legacy");

    // The gate: 18.2 % newly rejected.
    let (code, _, err) = against_baseline(&["--max-newly-rejected", "20"]);
    assert_eq!(code, Some(0), "under the gate: {err}");
    let (code, _, err) = against_baseline(&["--max-newly-rejected", "10%"]);
    assert_eq!(code, Some(3), "over the gate: {err}");
    assert!(err.contains("2 of 11 requests"), "{err}");
    // A gate needs a baseline, and a percentage.
    let (code, _, _) = replay_of(
        &f.path("new.yaml"),
        &f.path("access.log"),
        &["--max-newly-rejected", "5"],
    );
    assert_eq!(code, Some(2));
    let (code, _, err) = against_baseline(&["--max-newly-rejected", "150"]);
    assert_eq!(code, Some(2), "{err}");
}

#[test]
fn an_hour_of_traffic_replays_in_simulated_time() {
    // 10 requests per second for an hour against 100 per clock minute: exactly 100 of each
    // minute's 600 are admitted. Unix-millisecond timestamps, stdin input.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.yaml");
    std::fs::write(
        &p,
        policy(
            "hour",
            "rules:\n- name: per-minute\n  key: [{header: x-api-key}]\n  limit: {requests: 100, period: 1m, algorithm: FixedWindow}\n  scope: Local\n",
        ),
    )
    .unwrap();
    let mut log = String::with_capacity(36_000 * 110);
    for i in 0..36_000u64 {
        log.push_str(&format!(
            "{{\"ts\":{},\"method\":\"GET\",\"path\":\"/\",\"headers\":{{\"x-api-key\":\"k\"}},\"client_ip\":\"10.1.2.3\"}}\n",
            T0_MS + i * 100
        ));
    }
    let started = Instant::now();
    let mut child = Command::new(BIN)
        .args(["check", "--policy"])
        .arg(&p)
        .args(["--replay", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(log.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("replay of - against"), "{stdout}");
    assert!(stdout.contains("(59m59s900ms)"), "{stdout}");
    let rule = rule_section(&stdout, "test/hour/per-minute");
    assert_has(&rule, "matched 36000, would-allow 6000, would-reject 30000");
    // An hour of traffic, decided in far less than an hour (debug build, busy machine).
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn unusable_inputs_fail_cleanly() {
    let f = Files::new();
    // Every line malformed: reported by number, exit 1, no panic.
    let bad = f.path("bad.log");
    std::fs::write(&bad, "{\"ts\":1}\n\u{0}\u{1}garbage\n[]\n{\"ts\":\"2025-05-01T12:00:00Z\",\"method\":\"GET\",\"path\":\"/\",\"client_ip\":\"nope\"}\n").unwrap();
    let (ok, out, err) = succeeded(replay_of(&f.path("new.yaml"), &bad, &[]));
    assert!(!ok);
    assert!(
        out.contains("4 lines: 0 requests replayed, 4 malformed"),
        "{out}"
    );
    for n in 1..=4 {
        assert!(out.contains(&format!("line {n}: ")), "{out}");
    }
    assert!(err.contains("no line of"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Invalid UTF-8 is one malformed line, not a read error.
    let binary = f.path("binary.log");
    let mut bytes = crafted_log().into_bytes();
    bytes.extend_from_slice(b"\xff\xfe\n");
    std::fs::write(&binary, bytes).unwrap();
    let (ok, out, _) = succeeded(replay_of(&f.path("new.yaml"), &binary, &[]));
    assert!(ok);
    assert!(out.contains("line 16: not UTF-8"), "{out}");

    // A missing log and a broken policy are errors.
    let (ok, _, err) = succeeded(replay_of(&f.path("new.yaml"), &f.path("missing.log"), &[]));
    assert!(!ok && err.contains("missing.log"), "{err}");
    let broken = f.path("broken.yaml");
    std::fs::write(
        &broken,
        policy(
            "broken",
            "rules:\n- name: r\n  limit: {requests: 0, period: 1m}\n",
        ),
    )
    .unwrap();
    let (ok, _, err) = succeeded(replay_of(&broken, &f.path("access.log"), &[]));
    assert!(!ok && err.contains("requests"), "{err}");
    // So is a misspelled field: replaying a policy without the intended burst would report
    // numbers for another policy than the one written.
    let misspelled = f.path("misspelled.yaml");
    std::fs::write(
        &misspelled,
        policy(
            "misspelled",
            "rules:\n- name: r\n  limit: {requests: 5, period: 1m, burts: 10}\n  scope: Local\n",
        ),
    )
    .unwrap();
    let (ok, out, err) = succeeded(replay_of(&misspelled, &f.path("access.log"), &[]));
    assert!(!ok, "replayed a misspelled policy:\n{out}");
    assert!(
        err.contains("spec.rules[0].limit.burts: unknown field (did you mean `burst`?)"),
        "{err}"
    );
    let baseline_ok = f.path("baseline-ok.yaml");
    std::fs::write(
        &baseline_ok,
        policy(
            "baseline",
            "rules:\n- name: r\n  limit: {requests: 5, period: 1m}\n  scope: Local\n",
        ),
    )
    .unwrap();
    let (ok, _, err) = succeeded(replay_of(
        &baseline_ok,
        &f.path("access.log"),
        &["--baseline", &misspelled],
    ));
    assert!(
        !ok && err.contains("spec.rules[0].limit.burts"),
        "baseline: {err}"
    );

    // --baseline needs --replay; plain `check` still works with --policy or paths.
    let (ok, _, _) = run(&[
        "check",
        "--policy",
        &f.path("new.yaml"),
        "--baseline",
        &f.path("old.yaml"),
    ]);
    assert!(!ok);
    let (ok, out, _) = run(&["check", "--policy", &f.path("new.yaml")]);
    assert!(ok && out.contains("policy test/replay"), "{out}");
    assert!(Path::new(&f.path("access.log")).exists());
}

/// Response-side fields in the log settle rules whose cost is known at the response: failed
/// logins counted by status, tokens by response header.
#[test]
fn replay_settles_response_side_costs_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let rules = "
        rules:
          - name: failed-logins
            match: {path: {exact: /login}}
            key: [{header: x-user}]
            limit: {requests: 2, period: 15m}
            count: {statuses: [401]}
            scope: Local
          - name: tokens
            match: {path: {prefix: /v1}}
            key: [{header: x-user}]
            limit: {requests: 100, period: 1h}
            cost: {responseHeader: x-llm-tokens, max: 1000}
            scope: Local
    ";
    std::fs::write(dir.path().join("p.yaml"), policy("resp", rules)).unwrap();
    let line = |s: u64, path: &str, status: u16, tokens: Option<u64>| {
        let resp = tokens.map_or(String::new(), |t| {
            format!(",\"response_headers\":{{\"x-llm-tokens\":\"{t}\"}}")
        });
        format!(
            "{{\"ts\":{},\"method\":\"POST\",\"path\":\"{path}\",\"headers\":{{\"x-user\":\"u\"}},\
             \"client_ip\":\"10.0.0.1\",\"status\":{status}{resp}}}\n",
            1_746_100_800_000u64 + s * 1000
        )
    };
    let mut log = String::new();
    // Five successful logins never count; two failures do; the next attempt is rejected.
    for s in 0..5 {
        log.push_str(&line(s, "/login", 200, None));
    }
    log.push_str(&line(5, "/login", 401, None));
    log.push_str(&line(6, "/login", 401, None));
    log.push_str(&line(7, "/login", 200, None));
    // 60 + 60 tokens of 100: the third call is rejected (in debt).
    log.push_str(&line(8, "/v1/chat", 200, Some(60)));
    log.push_str(&line(9, "/v1/chat", 200, Some(60)));
    log.push_str(&line(10, "/v1/chat", 200, Some(1)));
    std::fs::write(dir.path().join("access.log"), log).unwrap();
    let (ok, out, err) = succeeded(replay_of(
        &dir.path().join("p.yaml").display().to_string(),
        &dir.path().join("access.log").display().to_string(),
        &[],
    ));
    assert!(ok, "{err}\n{out}");
    let logins = rule_section(&out, "test/resp/failed-logins");
    assert_has(&logins, "matched 8, would-allow 7, would-reject 1");
    let tokens = rule_section(&out, "test/resp/tokens");
    assert_has(&tokens, "matched 3, would-allow 2, would-reject 1");
}
