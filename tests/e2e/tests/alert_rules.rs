//! The shipped alerts (`charts/tollgate/alerts/tollgate-alerts.yaml`), tested three ways:
//! - promtool: `check rules` on the file and `test rules` on `tollgate-alerts.test.yaml`, unit
//!   tests with the shipped windows and `for` durations. Every alert must have a case there in
//!   which it fires and one in which it stays silent, and each alert's cases must fail when the
//!   alert is broken;
//! - the chart: the PrometheusRule `helm template` renders holds exactly that file's groups;
//! - a real Prometheus scraping three real sidecars and the real controller, with the windows
//!   and `for` durations scaled down: `TollgateHighRejectionRate` fires during an abusive burst
//!   and `TollgateFailOpen` during a Redis outage, both resolve afterwards, nothing fires while
//!   traffic is healthy, and every query of the Grafana dashboard returns data.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tollgate_e2e::{
    ControlPlane, Proc, Redis, Sidecar, app, free_port, helm_offline, install_crd_and_shop,
    pod_with_token, prometheus_bin, repo_root, serial, start_controller,
};

const ALERTS: &str = "charts/tollgate/alerts/tollgate-alerts.yaml";
const ALERT_TESTS: &str = "charts/tollgate/alerts/tollgate-alerts.test.yaml";

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn yaml(path: &str) -> serde_norway::Value {
    serde_norway::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

/// (alert name, expression) of every rule in a rule file.
fn alerts_of(rules: &serde_norway::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            out.push((
                rule["alert"].as_str().expect("alert name").to_string(),
                rule["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out
}

/// Runs promtool in `dir`; (success, stdout + stderr).
fn promtool(dir: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(prometheus_bin("promtool"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run promtool");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn promtool_checks_the_alerts_and_passes_their_unit_tests() {
    let root = repo_root();
    let (ok, out) = promtool(&root, &["check", "rules", "--lint-fatal", ALERTS]);
    assert!(ok, "promtool check rules {ALERTS}:\n{out}");
    let n = alerts_of(&yaml(ALERTS)).len();
    assert!(
        out.contains(&format!("SUCCESS: {n} rules found")),
        "promtool found a different number of rules than the {n} alerts:\n{out}"
    );
    let (ok, out) = promtool(&root, &["test", "rules", ALERT_TESTS]);
    assert!(ok, "promtool test rules {ALERT_TESTS}:\n{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

/// The unit tests cover every alert: one case where it fires, one where it must stay silent,
/// and no case names an alert that does not exist. A new alert without tests fails here.
#[test]
fn every_alert_has_a_firing_and_a_silent_unit_test() {
    let tests = yaml(ALERT_TESTS);
    let files: Vec<&str> = tests["rule_files"]
        .as_sequence()
        .expect("rule_files")
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    assert_eq!(
        files,
        ["tollgate-alerts.yaml"],
        "the unit tests must load the shipped rule file"
    );
    let mut firing: BTreeMap<String, usize> = BTreeMap::new();
    let mut silent: BTreeMap<String, usize> = BTreeMap::new();
    for case in tests["tests"].as_sequence().expect("tests") {
        for eval in case["alert_rule_test"]
            .as_sequence()
            .expect("alert_rule_test")
        {
            let name = eval["alertname"].as_str().expect("alertname").to_string();
            let expected = eval["exp_alerts"]
                .as_sequence()
                .unwrap_or_else(|| panic!("{name}: exp_alerts must be a list ([] for silent)"));
            let count = if expected.is_empty() {
                &mut silent
            } else {
                &mut firing
            };
            *count.entry(name).or_default() += 1;
        }
    }
    let names: BTreeSet<String> = alerts_of(&yaml(ALERTS))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.len() >= 8, "{names:?}");
    let no_firing: Vec<&String> = names.iter().filter(|n| !firing.contains_key(*n)).collect();
    let no_silent: Vec<&String> = names.iter().filter(|n| !silent.contains_key(*n)).collect();
    let unknown: Vec<&String> = firing
        .keys()
        .chain(silent.keys())
        .filter(|n| !names.contains(*n))
        .collect();
    assert!(
        no_firing.is_empty() && no_silent.is_empty() && unknown.is_empty(),
        "{ALERT_TESTS}: alerts without a case where they fire: {no_firing:?}; without a case \
         where they stay silent (exp_alerts: []): {no_silent:?}; cases for alerts that do not \
         exist: {unknown:?}"
    );
}

/// Each alert's unit tests really pin it down: with that one alert's expression replaced by one
/// that never fires, `promtool test rules` fails and names it.
#[test]
fn the_unit_tests_fail_when_an_alert_never_fires() {
    let rules = yaml(ALERTS);
    let tests = read(ALERT_TESTS);
    for (name, _) in alerts_of(&rules) {
        let dir = tempfile::tempdir().unwrap();
        let mut broken = rules.clone();
        for group in broken["groups"].as_sequence_mut().expect("groups") {
            for rule in group["rules"].as_sequence_mut().expect("rules") {
                if rule["alert"].as_str() == Some(name.as_str()) {
                    rule["expr"] = serde_norway::Value::String("vector(1) == 0".into());
                }
            }
        }
        std::fs::write(
            dir.path().join("tollgate-alerts.yaml"),
            serde_norway::to_string(&broken).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.path().join("tollgate-alerts.test.yaml"), &tests).unwrap();
        let (ok, out) = promtool(dir.path(), &["test", "rules", "tollgate-alerts.test.yaml"]);
        assert!(
            !ok && out.contains(&name),
            "{name} never fires, yet promtool test rules did not fail on it:\n{out}"
        );
    }
}

/// What is tested is what ships: the chart's PrometheusRule holds exactly the rule file's groups.
#[test]
fn the_chart_ships_the_tested_rule_file() {
    let out = helm_offline(&[
        "template",
        "tollgate",
        "charts/tollgate",
        "--namespace",
        "tollgate-system",
        "--set",
        "prometheusRule.enabled=true",
        "--show-only",
        "templates/prometheusrule.yaml",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered: serde_norway::Value =
        serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    assert_eq!(rendered["kind"].as_str(), Some("PrometheusRule"), "{text}");
    assert_eq!(
        rendered["spec"],
        yaml(ALERTS),
        "the PrometheusRule's spec is not the rule file:\n{text}"
    );
}

// ---- a real Prometheus ----------------------------------------------------------------------

/// A minute of the shipped alerts lasts this many seconds in the end-to-end test.
const SECONDS_PER_MINUTE: u64 = 2;

/// The shipped rule file with every duration in minutes scaled to [`SECONDS_PER_MINUTE`]
/// seconds a minute: `[5m]` → `[10s]`, `[10m]` → `[20s]`, `for: 10m` → `for: 20s`,
/// `for: 1m` → `for: 2s`. Nothing else changes: the expressions, labels and annotations are the
/// shipped ones. A test cannot wait ten minutes; the promtool unit tests above run the shipped
/// durations.
fn scaled_rules(text: &str) -> String {
    let scale = |n: &str| n.parse::<u64>().expect("minutes") * SECONDS_PER_MINUTE;
    let window = regex::Regex::new(r"\[(\d+)m\]").unwrap();
    let for_ = regex::Regex::new(r"(?m)^(\s*for:\s*)(\d+)m\s*$").unwrap();
    let out = window.replace_all(text, |c: &regex::Captures| format!("[{}s]", scale(&c[1])));
    let out = for_.replace_all(&out, |c: &regex::Captures| {
        format!("{}{}s", &c[1], scale(&c[2]))
    });
    // A duration in another unit would keep its shipped length: make the next author scale it.
    let unscaled = regex::Regex::new(r"\[\d+[mhdwy]\]|\[\d+[a-z]*:|for:\s*\d+[mhd]").unwrap();
    assert!(
        !unscaled.is_match(&out),
        "{ALERTS} has a duration scaled_rules does not scale: {:?}",
        unscaled.find(&out).map(|m| m.as_str())
    );
    out.into_owned()
}

#[test]
fn scaled_rules_change_only_durations() {
    let shipped = read(ALERTS);
    let scaled = scaled_rules(&shipped);
    assert!(scaled.contains("[10s]") && scaled.contains("for: 20s"));
    // Mapping the scaled durations back gives the shipped file, byte for byte.
    let back = regex::Regex::new(r"\[(\d+)s\]|(for: )(\d+)s").unwrap();
    let restored = back.replace_all(&scaled, |c: &regex::Captures| {
        let mins = |s: &str| s.parse::<u64>().unwrap() / SECONDS_PER_MINUTE;
        match c.get(1) {
            Some(n) => format!("[{}m]", mins(n.as_str())),
            None => format!("{}{}m", &c[2], mins(&c[3])),
        }
    });
    assert_eq!(restored, shipped);
}

/// A `prometheus` process on a free loopback port with its TSDB in a temp dir; stopped on drop.
struct Prometheus {
    proc: Proc,
    url: String,
    client: reqwest::blocking::Client,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(config: &str, rules: &str) -> Prometheus {
        let bin = prometheus_bin("prometheus");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        std::fs::write(dir.path().join("tollgate-alerts.yaml"), rules).unwrap();
        let port = free_port();
        let mut cmd = Command::new(bin);
        cmd.arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .current_dir(dir.path());
        let prom = Prometheus {
            proc: Proc::spawn("prometheus", cmd),
            url: format!("http://127.0.0.1:{port}"),
            client: tollgate_e2e::http_client()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .unwrap(),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !prom
            .client
            .get(format!("{}/-/ready", prom.url))
            .send()
            .is_ok_and(|r| r.status().is_success())
        {
            assert!(
                Instant::now() < deadline,
                "Prometheus was not ready within 30 s; log:\n{}",
                prom.proc.logs().join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        prom
    }

    /// `data` of an API answer; panics unless it is a success.
    fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), params)
            .expect("API URL");
        let body: Value = self
            .client
            .get(url)
            .send()
            .and_then(|r| r.json())
            .unwrap_or_else(|e| panic!("Prometheus {path} {params:?}: {e}"));
        assert_eq!(body["status"], "success", "{path} {params:?}: {body}");
        body["data"].clone()
    }

    /// Every alert Prometheus holds (pending or firing).
    fn alerts(&self) -> Vec<Value> {
        self.api("/api/v1/alerts", &[])["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The first sample of an instant query, if any.
    fn scalar(&self, query: &str) -> Option<f64> {
        self.api("/api/v1/query", &[("query", query)])["result"]
            .as_array()
            .and_then(|r| r.first())
            .and_then(|s| s["value"][1].as_str())
            .and_then(|v| v.parse().ok())
    }

    /// Alerts and the given alert's expression right now, for failure messages.
    fn state(&self, expr: &str) -> String {
        let now = self.api("/api/v1/query", &[("query", expr)]);
        format!(
            "alerts: {:#}\n{expr} = {:#}",
            Value::Array(self.alerts()),
            now["result"]
        )
    }
}

/// Waits until alert `name` is firing (`Some(alert)`) or, with `firing` false, until Prometheus
/// holds it in no state at all (resolved). Panics after `timeout` with Prometheus's alert state.
fn wait_alert(
    prom: &Prometheus,
    name: &str,
    expr: &str,
    firing: bool,
    timeout: Duration,
) -> (Duration, Option<Value>) {
    let start = Instant::now();
    loop {
        let alerts = prom.alerts();
        let mine: Vec<&Value> = alerts
            .iter()
            .filter(|a| a["labels"]["alertname"] == name)
            .collect();
        if firing {
            if let Some(a) = mine.iter().find(|a| a["state"] == "firing") {
                return (start.elapsed(), Some((*a).clone()));
            }
        } else if mine.is_empty() {
            return (start.elapsed(), None);
        }
        assert!(
            start.elapsed() < timeout,
            "{name} did not {} within {timeout:?}; Prometheus's {}",
            if firing { "fire" } else { "resolve" },
            prom.state(expr)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn policy(shadow_requests: u64) -> String {
    // per-api-key: a Global rule failing open (the policy's failureMode), 10 a second per key
    // with bursts of 10. shadow-per-key: a Shadow rule per sidecar that the healthy keys exceed,
    // so the dashboard's would-reject panel has something to show.
    format!(
        r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: alerts, namespace: shop}}
spec:
  targetRef:
    selector: {{matchLabels: {{app: shop-api}}}}
  failureMode: Open
  rules:
  - name: per-api-key
    key: [{{header: x-api-key}}]
    limit: {{requests: 600, period: 1m, burst: 10}}
  - name: shadow-per-key
    key: [{{header: x-api-key}}]
    scope: Local
    mode: Shadow
    limit: {{requests: {shadow_requests}, period: 1m, burst: 2}}
"#
    )
}

/// Requests per (phase, sender, status).
type Counts = BTreeMap<(&'static str, &'static str, u16), u64>;

const PHASES: [&str; 5] = [
    "baseline",
    "burst",
    "after burst",
    "redis down",
    "redis back",
];

/// Client traffic: steady keys (about 3 requests a second each, and a new, cold key every
/// second so requests wait for leases), and while `abuse` is set one key sent every 10 ms. Statuses are counted per phase and per sender.
struct Traffic {
    stop: Arc<AtomicBool>,
    abuse: Arc<AtomicBool>,
    phase: Arc<AtomicUsize>,
    counts: Arc<Mutex<Counts>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(ports: Vec<u16>) -> Traffic {
        let t = Traffic {
            stop: Arc::new(AtomicBool::new(false)),
            abuse: Arc::new(AtomicBool::new(false)),
            phase: Arc::new(AtomicUsize::new(0)),
            counts: Arc::default(),
            threads: Vec::new(),
        };
        let client = tollgate_e2e::http_client()
            .timeout(Duration::from_secs(2))
            .no_proxy()
            .build()
            .unwrap();
        let mut threads = Vec::new();
        for who in ["steady", "abuser"] {
            let (stop, abuse, phase, counts, client, ports) = (
                t.stop.clone(),
                t.abuse.clone(),
                t.phase.clone(),
                t.counts.clone(),
                client.clone(),
                ports.clone(),
            );
            threads.push(std::thread::spawn(move || {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = match who {
                        "steady" if n.is_multiple_of(10) => format!("cold-{n}"),
                        "steady" => format!("steady-{}", n % 3),
                        _ if abuse.load(Ordering::Relaxed) => "abuser".to_string(),
                        _ => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                    };
                    let port = ports[n % ports.len()];
                    let status = client
                        .get(format!("http://127.0.0.1:{port}/orders"))
                        .header("x-api-key", key)
                        .send()
                        .map(|r| r.status().as_u16())
                        .unwrap_or(0);
                    let p = PHASES[phase.load(Ordering::Relaxed)];
                    if let Ok(mut c) = counts.lock() {
                        *c.entry((p, who, status)).or_default() += 1;
                    }
                    std::thread::sleep(Duration::from_millis(if who == "steady" {
                        100
                    } else {
                        10
                    }));
                }
            }));
        }
        Traffic { threads, ..t }
    }

    fn set_phase(&self, name: &str) {
        let i = PHASES.iter().position(|p| *p == name).expect("phase");
        self.phase.store(i, Ordering::Relaxed);
    }

    fn finish(self) -> Counts {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Every dashboard query with its Grafana variables filled in: `$namespace` as the "All"
/// option (`.*`), `$__rate_interval` as 10 s (at least four 1 s scrape intervals, as Grafana
/// computes it, and the scaled length of the alerts' 5 m windows).
fn dashboard_queries() -> Vec<(String, String)> {
    let dash: Value = serde_json::from_str(&read("charts/tollgate/dashboards/tollgate.json"))
        .expect("dashboard is JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            out.push((
                panel["title"].as_str().unwrap_or("?").to_string(),
                expr.replace("$__rate_interval", "10s")
                    .replace("$namespace", ".*"),
            ));
        }
    }
    out
}

/// Queries whose only value in this scenario is 0, each with the reason; every other query
/// must return a non-zero value at some point of the run.
const ZERO_IS_THE_ANSWER: &[(&str, &str)] = &[(
    "sum(tollgate_controller_compile_errors)",
    "the scenario applies only valid policies; the unit tests of TollgatePolicyRejected \
     cover a non-zero count",
)];

#[test]
fn alerts_fire_and_resolve_on_a_real_prometheus() {
    let _serial = serial();
    let test_start = Instant::now();
    // Fail before starting anything if a binary is missing.
    prometheus_bin("prometheus");
    let rules = scaled_rules(&read(ALERTS));
    let exprs: BTreeMap<String, String> = alerts_of(&serde_norway::from_str(&rules).unwrap())
        .into_iter()
        .collect();

    let mut redis = Redis::start();
    let redis_port = redis.port;
    let redis_url = redis.url();
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);
    cp.apply(&policy(30)).expect("apply policy");
    let controller_port = free_port();
    let mut controller = start_controller(
        &cp,
        "tollgate-controller",
        controller_port,
        &["--heartbeat-interval", "1s"],
    );
    let tokens = tempfile::tempdir().unwrap();
    let app_port = app();
    let mut sidecars: Vec<Sidecar> = (0..3)
        .map(|i| {
            let pod = format!("p{i}");
            let token = pod_with_token(&cp, &pod, tokens.path());
            Sidecar::for_pod(
                &pod,
                app_port,
                controller_port,
                &token,
                &["--redis", &redis_url, "--redis-timeout", "200ms"],
            )
        })
        .collect();
    for s in &sidecars {
        s.wait_ready("a sidecar to hold rules", Duration::from_secs(30));
    }

    // The chart's scrape configuration: the controller through its ServiceMonitor (port
    // `metrics`, path /metrics, plain HTTP) and each sidecar on its admin port (named
    // `tollgate-admin` in injected pods, for a PodMonitor), path /metrics. Static targets stand
    // in for Kubernetes service discovery; their `namespace` and `pod` labels are the ones
    // discovery attaches and the alerts group by.
    let mut config = format!(
        r#"global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [tollgate-alerts.yaml]
scrape_configs:
- job_name: tollgate-controller
  scheme: http
  metrics_path: /metrics
  static_configs:
  - targets: ['127.0.0.1:{controller_port}']
    labels: {{namespace: tollgate-system, pod: tollgate-controller-0}}
- job_name: tollgate-sidecars
  scheme: http
  metrics_path: /metrics
  static_configs:
"#
    );
    for (i, s) in sidecars.iter().enumerate() {
        config.push_str(&format!(
            "  - targets: ['127.0.0.1:{}']\n    labels: {{namespace: shop, pod: p{i}}}\n",
            s.admin
        ));
    }
    let mut prom = Prometheus::start(&config, &rules);
    let prom_start = unix_now();
    let loaded: usize = prom.api("/api/v1/rules", &[])["groups"]
        .as_array()
        .expect("rule groups")
        .iter()
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(loaded, exprs.len(), "Prometheus loaded {loaded} rules");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let targets = prom.api("/api/v1/targets", &[("state", "active")]);
        let targets = targets["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if targets.len() == 4 && targets.iter().all(|t| t["health"] == "up") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus's targets are not all up: {targets:#?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while prom.scalar(r#"min(tollgate_live_sidecars{policy="shop/alerts"})"#) != Some(3.0)
        || prom.scalar("sum(tollgate_controller_connected)") != Some(3.0)
    {
        assert!(
            Instant::now() < deadline,
            "Prometheus does not see three connected members: {:#}",
            prom.api("/api/v1/query", &[("query", "tollgate_live_sidecars")])
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let traffic = Traffic::start(sidecars.iter().map(|s| s.listen).collect());

    // A policy edit once Prometheus has scraped the controller: the rule-stream lag histogram
    // gets an observation inside the run.
    let lag_count = "sum(tollgate_controller_stream_lag_seconds_count)";
    let before = prom.scalar(lag_count).unwrap_or(0.0);
    cp.apply(&policy(31)).expect("edit policy");
    let deadline = Instant::now() + Duration::from_secs(30);
    while prom.scalar(lag_count).unwrap_or(0.0) <= before {
        assert!(Instant::now() < deadline, "the policy edit was never acked");
        std::thread::sleep(Duration::from_millis(200));
    }

    // Healthy: for a whole scaled 5-minute window no alert is pending or firing.
    let healthy_until = Instant::now() + Duration::from_secs(5 * SECONDS_PER_MINUTE + 2);
    while Instant::now() < healthy_until {
        let alerts = prom.alerts();
        assert!(
            alerts.is_empty(),
            "alerts while traffic is healthy: {:#}",
            Value::Array(alerts)
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // An abusive burst: one key far past its limit.
    let name = "TollgateHighRejectionRate";
    traffic.set_phase("burst");
    traffic.abuse.store(true, Ordering::Relaxed);
    let (burst_fired, alert) = wait_alert(&prom, name, &exprs[name], true, Duration::from_secs(60));
    let alert = alert.expect("firing alert");
    for (k, v) in [
        ("namespace", "shop"),
        ("policy", "shop/alerts"),
        ("rule", "per-api-key"),
        ("severity", "warning"),
    ] {
        assert_eq!(alert["labels"][k], v, "{alert:#}");
    }
    let summary = alert["annotations"]["summary"].as_str().unwrap_or("");
    assert!(
        summary.starts_with("Rule shop/alerts/per-api-key rejects ")
            && summary.ends_with("% of requests"),
        "{alert:#}"
    );
    let during_burst: Vec<Value> = prom.alerts();
    traffic.abuse.store(false, Ordering::Relaxed);
    traffic.set_phase("after burst");
    let (burst_resolved, _) = wait_alert(&prom, name, &exprs[name], false, Duration::from_secs(60));
    eprintln!(
        "{name}: firing {burst_fired:.1?} after the burst started ({summary}), resolved \
         {burst_resolved:.1?} after it stopped"
    );
    assert!(
        !during_burst
            .iter()
            .any(|a| a["labels"]["alertname"] == "TollgateFailOpen"),
        "TollgateFailOpen during the burst, with Redis up: {:#}",
        Value::Array(during_burst)
    );

    // A Redis outage under steady traffic: the fail-open rule serves from the fallback share.
    let name = "TollgateFailOpen";
    traffic.set_phase("redis down");
    redis.kill();
    let (outage_fired, alert) =
        wait_alert(&prom, name, &exprs[name], true, Duration::from_secs(60));
    let alert = alert.expect("firing alert");
    assert_eq!(alert["labels"]["namespace"], "shop", "{alert:#}");
    assert_eq!(alert["labels"]["severity"], "warning", "{alert:#}");
    assert_eq!(
        alert["annotations"]["summary"],
        "Sidecars in shop are enforcing global limits from their local fallback share",
        "{alert:#}"
    );
    let during_outage = prom.alerts();
    // A few more seconds of outage so the fallback series have several points.
    std::thread::sleep(Duration::from_secs(2));
    redis = Redis::start_on(redis_port, &[]);
    traffic.set_phase("redis back");
    let (outage_resolved, _) =
        wait_alert(&prom, name, &exprs[name], false, Duration::from_secs(60));
    eprintln!(
        "{name}: firing {outage_fired:.1?} after redis-server was killed, resolved \
         {outage_resolved:.1?} after it was back; alerts during the outage: {:?}",
        during_outage
            .iter()
            .map(|a| format!("{} {}", a["labels"]["alertname"], a["state"]))
            .collect::<Vec<_>>()
    );
    assert!(
        !during_outage
            .iter()
            .any(|a| a["labels"]["alertname"] == "TollgateHighRejectionRate"),
        "TollgateHighRejectionRate during the outage under steady traffic: {:#}",
        Value::Array(during_outage)
    );
    let counts = traffic.finish();

    // Every rule evaluated without errors.
    for group in prom.api("/api/v1/rules", &[])["groups"]
        .as_array()
        .expect("groups")
    {
        for rule in group["rules"].as_array().expect("rules") {
            assert_eq!(rule["health"], "ok", "rule evaluation failed: {rule:#}");
        }
    }

    // Every dashboard query returned data during the run.
    let (start, end) = (format!("{prom_start:.3}"), format!("{:.3}", unix_now()));
    let mut empty = Vec::new();
    for (panel, query) in dashboard_queries() {
        let data = prom.api(
            "/api/v1/query_range",
            &[
                ("query", &query),
                ("start", &start),
                ("end", &end),
                ("step", "1"),
            ],
        );
        let values: Vec<f64> = data["result"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["values"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v[1].as_str().and_then(|x| x.parse::<f64>().ok()))
            .filter(|v| v.is_finite())
            .collect();
        let zero_ok = ZERO_IS_THE_ANSWER.iter().any(|(q, _)| *q == query);
        if values.is_empty() || (!zero_ok && values.iter().all(|v| *v == 0.0)) {
            empty.push(format!("{panel:?}: {query} -> {}", data["result"]));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data in the run:\n{}",
        empty.join("\n")
    );

    // The clients saw what the alerts describe: the abuser was limited, steady keys kept
    // getting answers from the fail-open rule while Redis was down, nothing failed.
    let count = |phase: &str, who: &str, status: u16| counts.get(&(phase, who, status)).copied();
    eprintln!("client statuses (phase, sender, status): {counts:?}");
    assert!(
        count("burst", "abuser", 429).unwrap_or(0) > 100,
        "{counts:?}"
    );
    assert!(
        count("redis down", "steady", 200).unwrap_or(0) > 10,
        "{counts:?}"
    );
    let failed: Vec<_> = counts
        .iter()
        .filter(|((_, _, s), _)| !matches!(s, 200 | 429))
        .collect();
    assert!(failed.is_empty(), "requests that failed: {failed:?}");

    prom.proc.stop(Duration::from_secs(10));
    for s in &mut sidecars {
        s.proc.stop(Duration::from_secs(10));
    }
    controller.stop(Duration::from_secs(10));
    drop(redis);
    eprintln!(
        "alerts_fire_and_resolve_on_a_real_prometheus took {:.1?}",
        test_start.elapsed()
    );
}
