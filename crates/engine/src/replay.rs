//! Replay dry-run: `tollgate-sidecar check --policy new.yaml --replay access.log
//! [--baseline old.yaml]` runs a recorded access log through the sidecar's own rule engine and
//! reports, per rule, what it would have done.
//!
//! Every request goes through [`RuleSet::evaluate_observed`], the code the proxy runs (matching,
//! key extraction, bypass, cost, the limiter algorithms), so the replay decides exactly as
//! enforcement would. Time is simulated: each request is decided at its logged timestamp, so an
//! hour of log replays in well under a second. `scope: Global` rules are simulated as a single
//! sidecar holding the whole limit (what the fleet enforces together), and the report says so.
//!
//! The log is JSON lines, one request per line:
//!
//! ```json
//! {"ts":"2025-05-01T12:00:00.250Z","method":"GET","path":"/api/items?page=2",
//!  "headers":{"x-api-key":"k-123","x-forwarded-for":"203.0.113.9"},"client_ip":"10.0.0.7"}
//! ```
//!
//! `ts` is RFC 3339 or a number of Unix milliseconds; `path` may carry the query string;
//! `headers` values are strings or arrays of strings; `client_ip` is the TCP peer the sidecar
//! would see (an address, optionally with a port). An optional `duration_ms` holds concurrency
//! permits for that long (without it a request ends at once). Optional `status` (the response
//! status) and `response_headers` (same form as `headers`) settle rules whose cost is known only
//! at the response (`cost.responseHeader`, `count.statuses`); without them such a rule keeps
//! each request's reservation. Other fields are ignored. Lines
//! that cannot be replayed are counted and listed with their line numbers; the sidecar's
//! rejection audit lines (`target: tollgate::audit`) are recognised and skipped, since they name
//! no method or path.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Instant;

use http::{HeaderName, HeaderValue, Method};
use tollgate_crd::CompiledPolicy;
use tollgate_crd::compiled::{Algorithm, Mode};
use tollgate_limiter::{Nanos, Permit, StoreConfig};

use crate::metrics::Metrics;
use crate::rules::{Fingerprinter, RuleEvent, RuleSet};

/// What `check --replay` was asked to do (the sidecar's command line parses it).
#[derive(Debug, Clone, Default)]
pub struct ReplayArgs {
    /// The access log (JSON lines, `-` for stdin).
    pub replay: Option<PathBuf>,
    /// Policies to replay the log against as well, to show the difference.
    pub baseline: Vec<PathBuf>,
    /// Show the most-rejected keys in clear instead of as hashes.
    pub raw_keys: bool,
    /// How many of the most-rejected keys to list per rule.
    pub top: usize,
    pub output: ReportFormat,
    /// Exit with [`EXIT_GATE`] when more than this percentage of the requests would be newly
    /// rejected.
    pub max_newly_rejected: Option<f64>,
}

/// How `check --replay` prints its report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReportFormat {
    /// For people.
    #[default]
    Text,
    /// One object on stdout, for pipelines.
    Json,
}

/// Exit status of `check --replay` when `--max-newly-rejected` is exceeded (1 is an error, 2 a
/// usage error).
pub const EXIT_GATE: u8 = 3;

/// Malformed lines listed in the report; the rest are only counted.
const MAX_LISTED_ERRORS: usize = 20;
/// Longest line read; longer ones are malformed.
const MAX_LINE_BYTES: usize = 1 << 20;
/// Distinct rejected keys counted per rule; rejections of further keys are counted as untracked.
const MAX_TRACKED_KEYS: usize = 100_000;
/// Idle keys are evicted this often (simulated time), as the running sidecar does.
const EVICT_EVERY: Nanos = 10_000_000_000;

/// `check --replay`: loads the policies (and baseline), replays the log, prints the report.
/// Exits 1 when the policies do not compile, the log cannot be read, or no line was replayable.
pub fn run(policies: &[PathBuf], args: &ReplayArgs) -> std::process::ExitCode {
    use std::process::ExitCode;
    let Some(log_path) = &args.replay else {
        return ExitCode::FAILURE;
    };
    let Some(new) = load_policies(policies) else {
        return ExitCode::FAILURE;
    };
    let baseline = if args.baseline.is_empty() {
        None
    } else {
        match load_policies(&args.baseline) {
            Some(b) => Some(b),
            None => return ExitCode::FAILURE,
        }
    };
    let input: Box<dyn Read> = if log_path.as_os_str() == "-" {
        Box::new(std::io::stdin())
    } else {
        match std::fs::File::open(log_path) {
            Ok(f) => Box::new(f),
            Err(e) => {
                eprintln!("error: {}: {e}", log_path.display());
                return ExitCode::FAILURE;
            }
        }
    };
    let options = Options {
        raw_keys: args.raw_keys,
        top: args.top,
    };
    let report = match replay(BufReader::new(input), new, baseline, &options) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {}: {e}", log_path.display());
            return ExitCode::FAILURE;
        }
    };
    let names = Names {
        log: log_path.display().to_string(),
        policies: join_paths(policies),
        baseline: (!args.baseline.is_empty()).then(|| join_paths(&args.baseline)),
    };
    match args.output {
        ReportFormat::Text => print!("{}", report.render(&names, &options)),
        ReportFormat::Json => println!("{}", report.to_json(&names, &options)),
    }
    if report.requests == 0 {
        eprintln!("error: no line of {} could be replayed", names.log);
        return ExitCode::FAILURE;
    }
    if let Some(max) = args.max_newly_rejected {
        let share = report.newly_rejected_percent();
        if share > max {
            eprintln!(
                "gate: {} of {} requests ({share:.3} %) would be newly rejected, more than --max-newly-rejected {max} %",
                report.newly_rejected, report.requests
            );
            return ExitCode::from(EXIT_GATE);
        }
    }
    ExitCode::SUCCESS
}

fn join_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Compiles every policy under `paths`, printing errors like `check` does.
fn load_policies(paths: &[PathBuf]) -> Option<Vec<CompiledPolicy>> {
    let mut out: Vec<CompiledPolicy> = Vec::new();
    let mut failed = false;
    for path in paths {
        match tollgate_crd::files::load(path) {
            Ok(policies) => {
                for p in policies {
                    if out.iter().any(|q| q.id() == p.id()) {
                        eprintln!(
                            "error: {}: policy {} is defined more than once",
                            path.display(),
                            p.id()
                        );
                        failed = true;
                    } else {
                        out.push(p);
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
    (!failed).then_some(out)
}

/// Report options.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub raw_keys: bool,
    pub top: usize,
}

/// What the report calls its inputs.
pub struct Names {
    pub log: String,
    pub policies: String,
    pub baseline: Option<String>,
}

/// One request of the log, ready for the rule engine.
struct LogRequest {
    at: Nanos,
    parts: http::request::Parts,
    peer: SocketAddr,
    /// How long concurrency permits are held.
    duration: Nanos,
    /// The response, when the log has it: settles costs known at the response
    /// (`cost.responseHeader`, `count.statuses`).
    status: Option<u16>,
    response_headers: http::HeaderMap,
}

/// What the log contained besides requests.
#[derive(Default, Debug)]
pub struct LogStats {
    pub lines: u64,
    pub blank: u64,
    pub audit_lines: u64,
    pub malformed: u64,
    /// `(line number, problem)` for the first [`MAX_LISTED_ERRORS`] malformed lines.
    pub errors: Vec<(u64, String)>,
    pub out_of_order: u64,
    pub first: Option<Nanos>,
    pub last: Option<Nanos>,
}

/// Counts for one rule.
#[derive(Default, Debug, Clone)]
pub struct RuleStats {
    pub id: String,
    pub mode: Option<Mode>,
    pub algorithm: Option<Algorithm>,
    pub description: String,
    /// Requests that matched the rule and were decided by it.
    pub matched: u64,
    pub allowed: u64,
    pub rejected: u64,
    /// Admitted after a leaky-bucket delay.
    pub delayed: u64,
    pub max_delay: Nanos,
    pub bypassed: u64,
    /// Matched, but without a key part under `onMissingKey: Skip`.
    pub skipped: u64,
    /// Rejections per key hash, with the printable key when raw keys are shown.
    keys: HashMap<u64, (u64, Option<String>)>,
    /// Rejections of keys beyond [`MAX_TRACKED_KEYS`].
    pub untracked: u64,
}

impl RuleStats {
    /// The most-rejected keys: (hash, printable key if shown, rejections), most first.
    pub fn top_keys(&self, n: usize) -> Vec<(u64, Option<&str>, u64)> {
        let mut v: Vec<(u64, Option<&str>, u64)> = self
            .keys
            .iter()
            .map(|(h, (c, k))| (*h, k.as_deref(), *c))
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

/// One replay of the log against one rule set.
struct Run {
    rules: RuleSet,
    stats: Vec<RuleStats>,
    /// Concurrency permits held until (release time, sequence number).
    held: BTreeMap<(Nanos, u64), Vec<Permit>>,
    requests: u64,
    rejected: u64,
    unmatched: u64,
    last_evict: Option<Nanos>,
}

/// A request's outcome in one run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Rejected,
    Admitted,
}

impl Run {
    fn new(policies: Vec<CompiledPolicy>) -> Result<Run, String> {
        let rules = RuleSet::build(
            1,
            policies,
            None,
            &StoreConfig::default(),
            &Metrics::new(),
            None,
        )?;
        let stats = rules
            .rules
            .iter()
            .map(|r| RuleStats {
                id: r.rule.id.clone(),
                mode: Some(r.rule.mode),
                algorithm: Some(r.rule.limit.algorithm),
                description: r.rule.describe(),
                ..RuleStats::default()
            })
            .collect();
        Ok(Run {
            rules,
            stats,
            held: BTreeMap::new(),
            requests: 0,
            rejected: 0,
            unmatched: 0,
            last_evict: None,
        })
    }

    fn replay_one(
        &mut self,
        req: &LogRequest,
        seq: u64,
        fingerprinter: &Fingerprinter,
        options: &Options,
        key_buf: &mut Vec<u8>,
    ) -> Outcome {
        // Requests that ended by now give their concurrency permits back first.
        while let Some(entry) = self.held.first_entry() {
            if entry.key().0 > req.at {
                break;
            }
            drop(entry.remove());
        }
        match self.last_evict {
            Some(t) if req.at.saturating_sub(t) < EVICT_EVERY => {}
            _ => {
                self.rules.evict_idle(req.at);
                self.last_evict = Some(req.at);
            }
        }
        self.requests += 1;
        let stats = &mut self.stats;
        let mut decided = false;
        let verdict = self.rules.evaluate_observed(
            &req.parts,
            &req.peer,
            req.at,
            key_buf,
            fingerprinter,
            &mut |ri, event| {
                let Some(s) = stats.get_mut(ri) else {
                    return;
                };
                match event {
                    RuleEvent::Bypassed => s.bypassed += 1,
                    RuleEvent::SkippedMissingKey => s.skipped += 1,
                    RuleEvent::Decided {
                        key,
                        fingerprint,
                        decision,
                    } => {
                        decided = true;
                        s.matched += 1;
                        if decision.allowed {
                            s.allowed += 1;
                            if decision.delay > 0 {
                                s.delayed += 1;
                                s.max_delay = s.max_delay.max(decision.delay);
                            }
                        } else {
                            s.rejected += 1;
                            let tracked = s.keys.len() < MAX_TRACKED_KEYS;
                            match s.keys.get_mut(&fingerprint) {
                                Some(entry) => entry.0 += 1,
                                None if tracked => {
                                    let raw =
                                        options.raw_keys.then(|| crate::audit::printable(key));
                                    s.keys.insert(fingerprint, (1, raw));
                                }
                                None => s.untracked += 1,
                            }
                        }
                    }
                }
            },
        );
        if !decided {
            self.unmatched += 1;
        }
        let outcome = if verdict.rejected.is_some() || verdict.unavailable.is_some() {
            self.rejected += 1;
            Outcome::Rejected
        } else {
            Outcome::Admitted
        };
        if let (Outcome::Admitted, Some(status)) = (&outcome, req.status)
            && !verdict.settlements.is_empty()
        {
            self.rules
                .settle(&verdict.settlements, status, &req.response_headers, req.at);
        }
        if !verdict.permits.is_empty() && req.duration > 0 {
            self.held
                .insert((req.at.saturating_add(req.duration), seq), verdict.permits);
        }
        outcome
    }
}

/// The replay's results.
pub struct Report {
    pub log: LogStats,
    pub requests: u64,
    pub new: RunSummary,
    pub baseline: Option<RunSummary>,
    /// Requests the baseline admitted and the new policies reject, and the reverse.
    pub newly_rejected: u64,
    pub no_longer_rejected: u64,
    /// Global rules simulated locally at their full limit.
    pub simulated_global: Vec<String>,
    pub elapsed: std::time::Duration,
}

/// One run's totals.
pub struct RunSummary {
    pub rejected: u64,
    pub unmatched: u64,
    pub rules: Vec<RuleStats>,
}

impl From<Run> for RunSummary {
    fn from(r: Run) -> RunSummary {
        RunSummary {
            rejected: r.rejected,
            unmatched: r.unmatched,
            rules: r.stats,
        }
    }
}

/// Replays `log` against `policies` (and `baseline`).
pub fn replay(
    mut log: impl BufRead,
    policies: Vec<CompiledPolicy>,
    baseline: Option<Vec<CompiledPolicy>>,
    options: &Options,
) -> Result<Report, String> {
    let started = Instant::now();
    let mut new = Run::new(policies)?;
    let mut simulated_global = new.rules.local_fallback_rules.clone();
    let mut old = match baseline {
        Some(b) => {
            let run = Run::new(b)?;
            for id in &run.rules.local_fallback_rules {
                if !simulated_global.contains(id) {
                    simulated_global.push(id.clone());
                }
            }
            Some(run)
        }
        None => None,
    };
    let fingerprinter = Fingerprinter::random();
    let mut key_buf = Vec::with_capacity(256);
    let mut stats = LogStats::default();
    let mut newly_rejected = 0;
    let mut no_longer_rejected = 0;
    let mut clock: Option<Nanos> = None;
    let mut line = Vec::new();
    loop {
        let mut req = match next_line(&mut log, &mut line, &mut stats)? {
            Line::End => break,
            Line::Skipped => continue,
            Line::Request(req) => req,
        };
        let n = stats.lines;
        stats.first = Some(stats.first.map_or(req.at, |f| f.min(req.at)));
        stats.last = Some(stats.last.map_or(req.at, |l| l.max(req.at)));
        // The limiters expect time not to go backwards: a late line is decided at the latest
        // time seen (sampled and merged logs are rarely strictly ordered).
        match clock {
            Some(c) if req.at < c => {
                stats.out_of_order += 1;
                req.at = c;
            }
            _ => clock = Some(req.at),
        }
        let outcome = new.replay_one(&req, n, &fingerprinter, options, &mut key_buf);
        if let Some(old) = &mut old {
            match (
                old.replay_one(&req, n, &fingerprinter, options, &mut key_buf),
                outcome,
            ) {
                (Outcome::Admitted, Outcome::Rejected) => newly_rejected += 1,
                (Outcome::Rejected, Outcome::Admitted) => no_longer_rejected += 1,
                _ => {}
            }
        }
    }
    Ok(Report {
        requests: new.requests,
        log: stats,
        new: new.into(),
        baseline: old.map(Into::into),
        newly_rejected,
        no_longer_rejected,
        simulated_global,
        elapsed: started.elapsed(),
    })
}

/// What one line of the log holds.
enum Line {
    End,
    /// Blank, an audit line, or malformed: counted in the stats, nothing to decide.
    Skipped,
    Request(Box<LogRequest>),
}

/// Reads and parses the next line into `line`, at most [`MAX_LINE_BYTES`] of it: a longer
/// line is skipped to its end, so one runaway line cannot hold the whole log in memory.
fn next_line(
    log: &mut impl BufRead,
    line: &mut Vec<u8>,
    stats: &mut LogStats,
) -> Result<Line, String> {
    line.clear();
    let read = log
        .take(MAX_LINE_BYTES as u64 + 1)
        .read_until(b'\n', line)
        .map_err(|e| format!("read failed after line {}: {e}", stats.lines))?;
    if read == 0 {
        return Ok(Line::End);
    }
    stats.lines += 1;
    let n = stats.lines;
    if line.len() > MAX_LINE_BYTES && line.last() != Some(&b'\n') {
        // Skip the rest of the overlong line.
        loop {
            let mut rest = Vec::new();
            let more = log
                .take(MAX_LINE_BYTES as u64)
                .read_until(b'\n', &mut rest)
                .map_err(|e| format!("read failed at line {n}: {e}"))?;
            if more == 0 || rest.last() == Some(&b'\n') {
                break;
            }
        }
        malformed(stats, n, format!("longer than {MAX_LINE_BYTES} bytes"));
        return Ok(Line::Skipped);
    }
    let text = match std::str::from_utf8(line) {
        Ok(t) => t.trim(),
        Err(_) => {
            malformed(stats, n, "not UTF-8".to_string());
            return Ok(Line::Skipped);
        }
    };
    if text.is_empty() {
        stats.blank += 1;
        return Ok(Line::Skipped);
    }
    match parse_line(text) {
        Ok(Parsed::Request(r)) => Ok(Line::Request(r)),
        Ok(Parsed::Audit) => {
            stats.audit_lines += 1;
            Ok(Line::Skipped)
        }
        Err(e) => {
            malformed(stats, n, e);
            Ok(Line::Skipped)
        }
    }
}

fn malformed(stats: &mut LogStats, line: u64, problem: String) {
    stats.malformed += 1;
    if stats.errors.len() < MAX_LISTED_ERRORS {
        stats.errors.push((line, problem));
    }
}

enum Parsed {
    Request(Box<LogRequest>),
    /// A sidecar audit line: only rejections, without method or path.
    Audit,
}

/// Parses one JSON log line.
fn parse_line(text: &str) -> Result<Parsed, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let obj = value.as_object().ok_or("not a JSON object")?;
    if obj.get("target").and_then(|t| t.as_str()) == Some("tollgate::audit")
        || (obj.contains_key("key_hash") && obj.contains_key("rule") && !obj.contains_key("path"))
    {
        return Ok(Parsed::Audit);
    }
    let at = parse_ts(obj.get("ts"))?;
    let method = match obj.get("method") {
        Some(serde_json::Value::String(m)) => Method::from_bytes(m.as_bytes())
            .map_err(|_| format!("method: {m:?} is not an HTTP method"))?,
        Some(_) => return Err("method: not a string".into()),
        None => return Err("missing \"method\"".into()),
    };
    let path = match obj.get("path") {
        Some(serde_json::Value::String(p)) => p,
        Some(_) => return Err("path: not a string".into()),
        None => return Err("missing \"path\"".into()),
    };
    if !path.starts_with('/') {
        return Err(format!("path: {path:?} does not start with /"));
    }
    let uri: http::Uri = path
        .parse()
        .map_err(|e| format!("path: {path:?} is not a valid request path: {e}"))?;
    let peer = match obj.get("client_ip") {
        Some(serde_json::Value::String(s)) => {
            parse_peer(s).ok_or_else(|| format!("client_ip: {s:?} is not an IP address"))?
        }
        Some(_) => return Err("client_ip: not a string".into()),
        None => return Err("missing \"client_ip\" (the TCP peer's address)".into()),
    };
    let duration = match obj.get("duration_ms") {
        None | Some(serde_json::Value::Null) => 0,
        Some(v) => match v.as_f64().filter(|d| *d >= 0.0 && *d < 86_400_000.0) {
            Some(ms) => (ms * 1e6) as Nanos,
            None => {
                return Err(format!(
                    "duration_ms: {v} is not a number of milliseconds under a day"
                ));
            }
        },
    };
    let mut parts = http::Request::builder()
        .method(method)
        .uri(uri)
        .body(())
        .map_err(|e| format!("cannot build the request: {e}"))?
        .into_parts()
        .0;
    parse_headers(obj.get("headers"), "headers", &mut parts.headers)?;
    let mut response_headers = http::HeaderMap::new();
    parse_headers(
        obj.get("response_headers"),
        "response_headers",
        &mut response_headers,
    )?;
    let status = match obj.get("status") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|s| (100..=599).contains(s))
                .map(|s| s as u16)
                .ok_or_else(|| format!("status: {v} is not an HTTP status"))?,
        ),
    };
    Ok(Parsed::Request(Box::new(LogRequest {
        at,
        parts,
        peer,
        duration,
        status,
        response_headers,
    })))
}

/// The line's time: an RFC 3339 string, or Unix milliseconds (a fraction kept to the
/// nanosecond).
fn parse_ts(ts: Option<&serde_json::Value>) -> Result<Nanos, String> {
    match ts {
        None => Err("missing \"ts\"".into()),
        Some(serde_json::Value::String(s)) => parse_rfc3339(s).ok_or_else(|| {
            format!("ts: {s:?} is not an RFC 3339 time such as 2025-05-01T12:00:00Z")
        }),
        Some(serde_json::Value::Number(n)) => {
            // Up to the year 2500: nanoseconds since 1970 fit in u64 (584 years).
            const MAX_MS: u64 = 16_725_225_600_000;
            let whole = n.as_u64().filter(|ms| *ms < MAX_MS);
            let fractional = n
                .as_f64()
                .filter(|ms| ms.is_finite() && *ms >= 0.0 && *ms < MAX_MS as f64);
            match (whole, fractional) {
                (Some(ms), _) => Ok(ms * 1_000_000),
                // Whole milliseconds exactly, the fraction to the nearest nanosecond.
                (None, Some(ms)) => {
                    Ok(ms.trunc() as Nanos * 1_000_000 + (ms.fract() * 1e6).round() as Nanos)
                }
                _ => Err(format!("ts: {n} is not a Unix time in milliseconds")),
            }
        }
        Some(other) => Err(format!(
            "ts: {other} is neither an RFC 3339 string nor Unix milliseconds"
        )),
    }
}

/// A JSON object of header name → string or array of strings, appended to `into`; `field`
/// names it in errors.
fn parse_headers(
    value: Option<&serde_json::Value>,
    field: &str,
    into: &mut http::HeaderMap,
) -> Result<(), String> {
    match value {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(headers)) => {
            for (name, value) in headers {
                let header = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| format!("{field}: {name:?} is not a header name"))?;
                let values: Vec<&str> = match value {
                    serde_json::Value::String(s) => vec![s.as_str()],
                    serde_json::Value::Array(items) => items
                        .iter()
                        .map(|i| {
                            i.as_str()
                                .ok_or_else(|| format!("{field}: {name}: values must be strings"))
                        })
                        .collect::<Result<_, _>>()?,
                    _ => return Err(format!("{field}: {name}: a string or an array of strings")),
                };
                for v in values {
                    let v = HeaderValue::from_str(v).map_err(|_| {
                        format!("{field}: {name}: {v:?} is not a valid header value")
                    })?;
                    into.append(header.clone(), v);
                }
            }
        }
        Some(_) => return Err(format!("{field}: not an object of name → value")),
    }
    Ok(())
}

/// `10.0.0.7`, `10.0.0.7:5123`, `2001:db8::1` or `[2001:db8::1]:443`; the port is irrelevant.
fn parse_peer(s: &str) -> Option<SocketAddr> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, 0));
    }
    s.parse::<SocketAddr>().ok()
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01 (`civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (
        if m <= 2 {
            yoe + era * 400 + 1
        } else {
            yoe + era * 400
        },
        m,
        d,
    )
}

/// Nanoseconds since the Unix epoch of an RFC 3339 timestamp
/// (`2025-05-01T12:00:00Z`, `2025-05-01 14:00:00.123456+02:00`); `None` if malformed or
/// before 1970 or after 2500.
pub fn parse_rfc3339(s: &str) -> Option<Nanos> {
    let b = s.trim().as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let digits = b.get(r)?;
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(digits).ok()?.parse().ok()
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1970..=2500).contains(&year)
        || !(1..=12).contains(&month)
        || day < 1
        || day > month_days[(month - 1) as usize]
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut i = 19;
    let mut frac_nanos: i64 = 0;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            if i - start < 9 {
                frac_nanos = frac_nanos * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        if i == start {
            return None;
        }
        for _ in (i - start)..9 {
            frac_nanos *= 10;
        }
    }
    let offset_secs = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let off = oh * 3600 + om * 60;
            if *sign == b'+' { off } else { -off }
        }
        _ => return None,
    };
    // A leap second (:60) is counted as the last instant of its minute.
    let (second, frac_nanos) = if second == 60 {
        (59, 999_999_999)
    } else {
        (second, frac_nanos)
    };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second
        - offset_secs;
    let nanos = i128::from(secs) * 1_000_000_000 + i128::from(frac_nanos);
    u64::try_from(nanos).ok()
}

/// `2025-05-01T12:00:00.250Z` (milliseconds, UTC).
fn format_rfc3339(nanos: Nanos) -> String {
    let secs = (nanos / 1_000_000_000) as i64;
    let ms = (nanos / 1_000_000) % 1000;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".to_string()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / whole as f64)
    }
}

fn signed(n: i128) -> String {
    if n > 0 {
        format!("+{n}")
    } else {
        n.to_string()
    }
}

impl Report {
    /// Requests the baseline admitted and the new policies reject, in percent of all replayed.
    pub fn newly_rejected_percent(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.newly_rejected as f64 * 100.0 / self.requests as f64
        }
    }

    /// The report as one JSON object, for pipelines. The same facts as [`Report::render`];
    /// times are RFC 3339, durations milliseconds, key hashes 16 hex digits.
    pub fn to_json(&self, names: &Names, options: &Options) -> serde_json::Value {
        use serde_json::json;
        let log = &self.log;
        let rules: Vec<serde_json::Value> = self
            .new
            .rules
            .iter()
            .map(|r| self.rule_json(r, options.top))
            .collect();
        let baseline_only: Vec<serde_json::Value> = self
            .baseline
            .iter()
            .flat_map(|b| &b.rules)
            .filter(|b| !self.new.rules.iter().any(|r| r.id == b.id))
            .map(|b| {
                let mut v = rule_counts_json(b);
                v["id"] = json!(b.id);
                v
            })
            .collect();
        let errors: Vec<serde_json::Value> = log
            .errors
            .iter()
            .map(|(line, problem)| json!({"line": line, "problem": problem}))
            .collect();
        json!({
            "log": {
                "path": names.log,
                "lines": log.lines,
                "requests": self.requests,
                "malformed": log.malformed,
                "malformed_listed": errors,
                "audit_lines": log.audit_lines,
                "blank": log.blank,
                "out_of_order": log.out_of_order,
                "first": log.first.map(format_rfc3339),
                "last": log.last.map(format_rfc3339),
            },
            "policies": names.policies,
            "baseline": names.baseline,
            "simulated_ms": self.elapsed.as_millis() as u64,
            "simulated_global_rules": self.simulated_global,
            "keys": if options.raw_keys { "raw" } else { "hashed" },
            "requests": self.requests,
            "rejected": self.new.rejected,
            "admitted": self.requests - self.new.rejected,
            "unmatched": self.new.unmatched,
            "vs_baseline": self.baseline.as_ref().map(|b| json!({
                "rejected": b.rejected,
                "unmatched": b.unmatched,
                "newly_rejected": self.newly_rejected,
                "newly_rejected_percent": self.newly_rejected_percent(),
                "no_longer_rejected": self.no_longer_rejected,
            })),
            "rules": rules,
            "baseline_only_rules": baseline_only,
        })
    }

    /// One rule of the new policies in [`Report::to_json`], with the baseline's counts for it.
    fn rule_json(&self, r: &RuleStats, top: usize) -> serde_json::Value {
        use serde_json::json;
        let baseline = self
            .baseline
            .as_ref()
            .and_then(|b| b.rules.iter().find(|x| x.id == r.id))
            .map(rule_counts_json);
        let top: Vec<serde_json::Value> = r
            .top_keys(top)
            .into_iter()
            .map(|(hash, key, count)| {
                json!({"hash": format!("{hash:016x}"), "key": key, "rejections": count})
            })
            .collect();
        json!({
            "id": r.id,
            "mode": r.mode.unwrap_or_default(),
            "algorithm": r.algorithm,
            "description": r.description,
            "matched": r.matched,
            "allowed": r.allowed,
            "rejected": r.rejected,
            "delayed": r.delayed,
            "max_delay_ms": r.max_delay / 1_000_000,
            "bypassed": r.bypassed,
            "skipped_missing_key": r.skipped,
            "top_rejected_keys": top,
            "untracked_rejected_keys": r.untracked,
            "baseline": baseline,
        })
    }

    /// The human-readable report.
    pub fn render(&self, names: &Names, options: &Options) -> String {
        let mut o = String::new();
        self.render_log(&mut o, names);
        self.render_totals(&mut o);
        let hashed_note = if options.raw_keys {
            ""
        } else {
            " (hashed; --raw-keys shows them)"
        };
        for r in &self.new.rules {
            self.render_rule(&mut o, r, options.top, hashed_note);
        }
        self.render_baseline_only(&mut o);
        let concurrency = self
            .new
            .rules
            .iter()
            .any(|r| r.algorithm == Some(Algorithm::Concurrency));
        if concurrency {
            let _ = writeln!(
                o,
                "note: concurrency rules hold a request's permits for its duration_ms (0 when the log has none)"
            );
        }
        o
    }

    /// What was replayed: the files, the log's lines and time span, and what was skipped and
    /// why, so a surprising total can be traced to the log before the policies.
    fn render_log(&self, o: &mut String, names: &Names) {
        let _ = writeln!(o, "replay of {} against {}", names.log, names.policies);
        if let Some(b) = &names.baseline {
            let _ = writeln!(o, "baseline: {b}");
        }
        let log = &self.log;
        let _ = writeln!(
            o,
            "  {} lines: {} requests replayed, {} malformed, {} audit lines skipped, {} blank",
            log.lines, self.requests, log.malformed, log.audit_lines, log.blank
        );
        if let (Some(first), Some(last)) = (log.first, log.last) {
            let _ = writeln!(
                o,
                "  log time {} .. {} ({}), simulated in {} ms",
                format_rfc3339(first),
                format_rfc3339(last),
                tollgate_crd::duration::format(std::time::Duration::from_nanos(last - first)),
                self.elapsed.as_millis()
            );
        }
        if log.out_of_order > 0 {
            let _ = writeln!(
                o,
                "  {} lines were earlier than a line before them and were replayed at the latest time seen",
                log.out_of_order
            );
        }
        if !self.simulated_global.is_empty() {
            let _ = writeln!(
                o,
                "  note: global rules are simulated locally at their full limit (one sidecar holding the whole quota, as the fleet shares it): {}",
                self.simulated_global.join(", ")
            );
        }
        if log.audit_lines > 0 {
            let _ = writeln!(
                o,
                "  note: sidecar audit lines record rejections only, without method or path; replay needs an access log"
            );
        }
        if !log.errors.is_empty() {
            let _ = writeln!(
                o,
                "malformed lines ({} listed of {}):",
                log.errors.len(),
                log.malformed
            );
            for (line, problem) in &log.errors {
                let _ = writeln!(o, "  line {line}: {problem}");
            }
        }
    }

    /// The totals of the new policies, and how they differ from the baseline's.
    fn render_totals(&self, o: &mut String) {
        let admitted = self.requests - self.new.rejected;
        let _ = writeln!(
            o,
            "requests: {}, would be rejected: {} ({}), admitted: {}, matched no rule: {}",
            self.requests,
            self.new.rejected,
            percent(self.new.rejected, self.requests),
            admitted,
            self.new.unmatched
        );
        if let Some(b) = &self.baseline {
            let _ = writeln!(
                o,
                "  vs baseline: would be rejected {} -> {} ({}), newly rejected: {}, no longer rejected: {}",
                b.rejected,
                self.new.rejected,
                signed(i128::from(self.new.rejected) - i128::from(b.rejected)),
                self.newly_rejected,
                self.no_longer_rejected
            );
        }
    }

    /// One rule of the new policies: its counts, the baseline's for the same rule, and the
    /// keys it would reject most.
    fn render_rule(&self, o: &mut String, r: &RuleStats, top: usize, hashed_note: &str) {
        let mode = match r.mode {
            Some(Mode::Shadow) => "Shadow",
            _ => "Enforce",
        };
        let _ = writeln!(o, "rule {} [{mode}]", r.id);
        let _ = writeln!(o, "  {}", r.description);
        let shadow_note = if r.mode == Some(Mode::Shadow) {
            "; Shadow: counted, not rejected"
        } else {
            ""
        };
        let _ = writeln!(
            o,
            "  matched {}, would-allow {}, would-reject {} ({}{shadow_note})",
            r.matched,
            r.allowed,
            r.rejected,
            percent(r.rejected, r.matched)
        );
        if let Some(b) = self
            .baseline
            .as_ref()
            .and_then(|b| b.rules.iter().find(|x| x.id == r.id))
        {
            let _ = writeln!(
                o,
                "  baseline: matched {}, would-allow {}, would-reject {} (would-reject {})",
                b.matched,
                b.allowed,
                b.rejected,
                signed(i128::from(r.rejected) - i128::from(b.rejected))
            );
        } else if self.baseline.is_some() {
            let _ = writeln!(o, "  baseline: (not in the baseline)");
        }
        if r.bypassed > 0 || r.skipped > 0 {
            let _ = writeln!(
                o,
                "  exempt: {} bypassed, {} without a key part (onMissingKey: Skip)",
                r.bypassed, r.skipped
            );
        }
        if r.delayed > 0 {
            let _ = writeln!(
                o,
                "  delayed: {} (longest {} ms)",
                r.delayed,
                r.max_delay / 1_000_000
            );
        }
        render_top_keys(o, r, top, hashed_note);
    }

    /// Rules the baseline has and the new policies do not: what removing them changes.
    fn render_baseline_only(&self, o: &mut String) {
        let Some(b) = &self.baseline else {
            return;
        };
        let removed: Vec<&RuleStats> = b
            .rules
            .iter()
            .filter(|b| !self.new.rules.iter().any(|r| r.id == b.id))
            .collect();
        if !removed.is_empty() {
            let _ = writeln!(o, "rules only in the baseline:");
            for r in removed {
                let _ = writeln!(
                    o,
                    "  {}: matched {}, would-allow {}, would-reject {}",
                    r.id, r.matched, r.allowed, r.rejected
                );
            }
        }
    }
}

/// A rule's counts, as the baseline's side of a rule and as a rule only the baseline has.
fn rule_counts_json(r: &RuleStats) -> serde_json::Value {
    serde_json::json!({"matched": r.matched, "allowed": r.allowed, "rejected": r.rejected})
}

/// The keys a rule would reject most, raw when the options allow it, then how many more were
/// not tracked.
fn render_top_keys(o: &mut String, r: &RuleStats, top: usize, hashed_note: &str) {
    let top = r.top_keys(top);
    if top.is_empty() {
        return;
    }
    let _ = writeln!(o, "  top rejected keys{hashed_note}:");
    for (hash, key, count) in top {
        match key {
            Some(k) => {
                let _ = writeln!(o, "    {k} ({hash:016x}): {count}");
            }
            None => {
                let _ = writeln!(o, "    {hash:016x}: {count}");
            }
        }
    }
    if r.untracked > 0 {
        let _ = writeln!(
            o,
            "    (rejections of {} more distinct keys not tracked)",
            r.untracked
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339("2025-05-01T12:00:00.250Z"),
            Some(1_746_100_800_250_000_000)
        );
        assert_eq!(
            parse_rfc3339("2025-05-01T14:00:00.25+02:00"),
            parse_rfc3339("2025-05-01T12:00:00.250Z")
        );
        assert_eq!(
            parse_rfc3339("2025-05-01 12:00:00.123456789123z"),
            Some(1_746_100_800_123_456_789)
        );
        assert_eq!(
            parse_rfc3339("2024-02-29T23:59:60Z"),
            Some(parse_rfc3339("2024-03-01T00:00:00Z").unwrap() - 1)
        );
        for bad in [
            "2025-05-01",
            "2025-05-01T12:00:00",
            "2025-02-29T12:00:00Z",
            "2025-13-01T12:00:00Z",
            "1969-12-31T23:59:59Z",
            "2025-05-01T12:00:00.Z",
            "2025-05-01T12:00:00+0200",
            "2025-05-01T24:00:00Z",
            "２025-05-01T12:00:00Z",
            "",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
        assert_eq!(
            format_rfc3339(parse_rfc3339("2025-05-01T12:00:00.250Z").unwrap()),
            "2025-05-01T12:00:00.250Z"
        );
        for days in [0, 59, 365, 10_957, 20_000, 30_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    fn compiled(rules: &str) -> Vec<CompiledPolicy> {
        let yaml = format!(
            "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: p, namespace: n}}\nspec:\n  targetRef: {{selector: {{}}}}\n  rules:\n{rules}"
        );
        tollgate_crd::parse_yaml(&yaml)
            .unwrap()
            .iter()
            .map(|p| tollgate_crd::compile(p).unwrap())
            .collect()
    }

    #[test]
    fn concurrency_permits_are_held_for_the_logged_duration() {
        let policies = compiled(
            "  - name: one-at-a-time\n    limit: {requests: 1, algorithm: Concurrency}\n    scope: Local\n",
        );
        let line = |ms: u64, duration: Option<u64>| {
            let d = duration.map_or(String::new(), |d| format!(",\"duration_ms\":{d}"));
            format!(
                "{{\"ts\":{ms},\"method\":\"GET\",\"path\":\"/\",\"client_ip\":\"10.0.0.1\"{d}}}\n"
            )
        };
        let log = [
            line(0, Some(1000)),  // holds the only slot until 1000 ms
            line(500, None),      // rejected
            line(999, Some(5)),   // rejected
            line(1000, Some(10)), // the first ended: admitted, holds until 1010
            line(1005, None),     // rejected
            line(2000, None),     // admitted, ends at once
            line(2000, None),     // admitted
        ]
        .concat();
        let report = replay(log.as_bytes(), policies, None, &Options::default()).unwrap();
        let r = &report.new.rules[0];
        assert_eq!((r.matched, r.allowed, r.rejected), (7, 4, 3));
        assert_eq!(report.new.rejected, 3);
    }

    #[test]
    fn lines_parse_or_explain() {
        let ok = parse_line(
            r#"{"ts":1746100800250,"method":"POST","path":"/a?x=1","headers":{"X-Api-Key":"k","x-multi":["1","2"]},"client_ip":"10.0.0.1:5000","duration_ms":20}"#,
        );
        let Ok(Parsed::Request(r)) = ok else {
            panic!("valid line refused")
        };
        assert_eq!(r.at, 1_746_100_800_250_000_000);
        assert_eq!(r.parts.method, Method::POST);
        assert_eq!(r.parts.uri.query(), Some("x=1"));
        assert_eq!(r.parts.headers["x-api-key"], "k");
        assert_eq!(r.parts.headers.get_all("x-multi").iter().count(), 2);
        assert_eq!(r.peer.ip().to_string(), "10.0.0.1");
        assert_eq!(r.duration, 20_000_000);
        let Ok(Parsed::Request(r)) =
            parse_line(r#"{"ts":1746100800250.5,"method":"GET","path":"/","client_ip":"::1"}"#)
        else {
            panic!("fractional milliseconds refused")
        };
        assert_eq!(r.at, 1_746_100_800_250_500_000);
        assert!(matches!(
            parse_line(
                r#"{"timestamp":"x","level":"INFO","event":"rejected","rule":"a/b/c","key_hash":"00ff","target":"tollgate::audit"}"#
            ),
            Ok(Parsed::Audit)
        ));
        for (line, why) in [
            ("nope", "not JSON"),
            ("[1]", "not a JSON object"),
            (
                r#"{"method":"GET","path":"/","client_ip":"1.2.3.4"}"#,
                "missing \"ts\"",
            ),
            (
                r#"{"ts":"yesterday","method":"GET","path":"/","client_ip":"1.2.3.4"}"#,
                "ts:",
            ),
            (
                r#"{"ts":-5,"method":"GET","path":"/","client_ip":"1.2.3.4"}"#,
                "ts:",
            ),
            (
                r#"{"ts":0,"method":"G ET","path":"/","client_ip":"1.2.3.4"}"#,
                "method:",
            ),
            (
                r#"{"ts":0,"method":"GET","path":"x","client_ip":"1.2.3.4"}"#,
                "path:",
            ),
            (r#"{"ts":0,"method":"GET","path":"/"}"#, "client_ip"),
            (
                r#"{"ts":0,"method":"GET","path":"/","client_ip":"me"}"#,
                "client_ip:",
            ),
            (
                r#"{"ts":0,"method":"GET","path":"/","client_ip":"1.2.3.4","headers":{"a b":"1"}}"#,
                "headers:",
            ),
            (
                r#"{"ts":0,"method":"GET","path":"/","client_ip":"1.2.3.4","headers":{"a":"\u0001"}}"#,
                "headers: a",
            ),
            (
                r#"{"ts":0,"method":"GET","path":"/","client_ip":"1.2.3.4","headers":{"a":5}}"#,
                "headers: a",
            ),
            (
                r#"{"ts":0,"method":"GET","path":"/","client_ip":"1.2.3.4","duration_ms":"x"}"#,
                "duration_ms",
            ),
        ] {
            match parse_line(line) {
                Err(e) => assert!(e.contains(why), "{line}: {e}"),
                Ok(_) => panic!("{line} accepted"),
            }
        }
    }
}
