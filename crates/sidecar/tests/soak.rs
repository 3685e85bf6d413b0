//! Soak: a steady request rate through three sidecars that share a real `redis-server` and a
//! global rule, with a policy edit every 30 s (15 s in the 60 s CI run), while each sidecar's
//! RSS and open file descriptors are sampled. It fails if, after a warm-up, RSS or fds grow
//! beyond a tolerance, if errors (statuses other than 200/429, connection errors) spike, if
//! the rate was not delivered or if a policy edit was not applied.
//!
//! The traffic mixes five hot keys (over their global limit: 200s and 429s), a fresh key on
//! 40 % of requests (a Redis round trip each, then idle and evicted: key-store churn) and a new
//! connection on every tenth request (accept/close churn).
//!
//! CI runs 60 s. `bench/soak.sh` runs the same test for 10 minutes on the release build and
//! keeps the report (`TOLLGATE_SOAK_REPORT`; `TOLLGATE_SOAK_PIDFILE` lists the child PIDs for
//! its clean-up). Knobs: `TOLLGATE_SOAK_SECS`, `TOLLGATE_SOAK_RATE`
//! (requests/s over all three sidecars), `TOLLGATE_SOAK_POLICY_EVERY`,
//! `TOLLGATE_SOAK_SAMPLE_EVERY` (seconds).
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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;

/// The two policy versions the soak alternates between: the global rule's limit changes (a new
/// bucket and lease state) and an extra header-matched rule comes and goes.
fn soak_policy(version: u64) -> String {
    let (requests, extra) = if version % 2 == 1 {
        (20, "")
    } else {
        (
            25,
            "
              - name: gold
                match: {headers: [{name: x-tier, value: gold}]}
                key: [{header: x-api-key}]
                limit: {requests: 1000, period: 1s}
                scope: Local",
        )
    };
    policy(
        "soak",
        &format!(
            "
            failureMode: Open
            rules:
              - name: shared
                key: [{{header: x-api-key}}]
                limit: {{requests: {requests}, period: 1s}}
                scope: Global
              - name: per-ip
                key: [{{clientIP: {{}}}}]
                limit: {{requests: 1000000, period: 1m}}
                scope: Local{extra}
            "
        ),
    )
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    limited: AtomicU64,
    bad_status: AtomicU64,
    conn_errors: AtomicU64,
}

impl Counts {
    fn snapshot(&self) -> [u64; 4] {
        [
            self.ok.load(Ordering::Relaxed),
            self.limited.load(Ordering::Relaxed),
            self.bad_status.load(Ordering::Relaxed),
            self.conn_errors.load(Ordering::Relaxed),
        ]
    }
}

/// One paced load worker: `per_sec` requests per second to `url` until `until`.
async fn worker(
    id: usize,
    url: String,
    per_sec: f64,
    until: Instant,
    counts: Arc<Counts>,
    fresh: Arc<AtomicU64>,
) {
    // Idle pooled connections are dropped before the sidecar's 10 s idle cut-off, so a reused
    // connection is never one the server is closing.
    let pooled = client_builder()
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let one_shot = client_builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_sec));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut i: u64 = 0;
    while Instant::now() < until {
        tick.tick().await;
        i += 1;
        let key = if i % 5 < 3 {
            format!("hot-{}", (i + id as u64) % 5)
        } else {
            format!("cold-{}", fresh.fetch_add(1, Ordering::Relaxed))
        };
        let c = if i.is_multiple_of(10) {
            &one_shot
        } else {
            &pooled
        };
        let mut req = c.get(&url).header("x-api-key", &key);
        if i.is_multiple_of(7) {
            req = req.header("x-tier", "gold");
        }
        match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let body = resp.bytes().await;
                match (status, body) {
                    (200, Ok(_)) => &counts.ok,
                    (429, Ok(_)) => &counts.limited,
                    (_, Ok(_)) => &counts.bad_status,
                    (_, Err(_)) => &counts.conn_errors,
                }
                .fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                counts.conn_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .expect("read /proc fd dir")
}

struct Sample {
    t: f64,
    rss: Vec<u64>,
    fds: Vec<usize>,
    /// ok, 429, bad status, connection errors: totals so far.
    counts: [u64; 4],
    redis_mem: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Least-squares slope of (t, y) in y units per minute.
fn slope_per_min(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mt, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let cov: f64 = points.iter().map(|p| (p.0 - mt) * (p.1 - my)).sum();
    let var: f64 = points.iter().map(|p| (p.0 - mt).powi(2)).sum();
    if var == 0.0 { 0.0 } else { cov / var * 60.0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_three_sidecars_with_policy_edits() {
    let secs = env_u64("TOLLGATE_SOAK_SECS", 60);
    let rate = env_u64("TOLLGATE_SOAK_RATE", 300) as f64;
    let policy_every = env_u64("TOLLGATE_SOAK_POLICY_EVERY", (secs / 4).clamp(5, 30));
    let sample_every = env_u64(
        "TOLLGATE_SOAK_SAMPLE_EVERY",
        if secs <= 120 { 2 } else { 5 },
    );
    let warmup = (secs / 5).max(10);
    within(secs + 120, async {
        let redis = Redis::start();
        let up = Upstream::start().await;
        let url = redis.url();
        let mut sidecars = Vec::new();
        for _ in 0..3 {
            sidecars.push(Sidecar::start(&up.url(), &soak_policy(1), &["--redis", &url]).await);
        }
        for s in &sidecars {
            s.wait_members("test/soak", 3, Duration::from_secs(20))
                .await;
        }
        let pids: Vec<u32> = sidecars.iter().map(|s| s.pid).collect();
        // For bench/soak.sh: what to kill by PID if it is interrupted before our Drop guards run.
        if let Ok(path) = std::env::var("TOLLGATE_SOAK_PIDFILE") {
            let mut text = format!("{} redis-server\n", redis.pid());
            for p in &pids {
                text.push_str(&format!("{p} tollgate-sideca\n"));
            }
            std::fs::write(path, text).expect("write pid file");
        }

        let counts = Arc::new(Counts::default());
        let fresh = Arc::new(AtomicU64::new(0));
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(secs);
        // Four workers per sidecar.
        let per_worker = rate / 12.0;
        let mut workers = Vec::new();
        for (i, s) in sidecars.iter().enumerate() {
            for j in 0..4 {
                workers.push(tokio::spawn(worker(
                    i * 4 + j,
                    s.url("/"),
                    per_worker,
                    until,
                    Arc::clone(&counts),
                    Arc::clone(&fresh),
                )));
            }
        }

        let mut samples: Vec<Sample> = Vec::new();
        let mut version = 1;
        let mut next_edit = Duration::from_secs(policy_every);
        let mut next_sample = Duration::ZERO;
        while Instant::now() < until {
            let el = t0.elapsed();
            if el >= next_sample {
                samples.push(Sample {
                    t: el.as_secs_f64(),
                    rss: pids.iter().map(|&p| rss_bytes(p)).collect(),
                    fds: pids.iter().map(|&p| open_fds(p)).collect(),
                    counts: counts.snapshot(),
                    redis_mem: redis.used_memory(),
                });
                next_sample += Duration::from_secs(sample_every);
            }
            if el >= next_edit {
                version += 1;
                for s in &sidecars {
                    s.write_policy(&soak_policy(version));
                }
                next_edit += Duration::from_secs(policy_every);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for w in workers {
            w.await.expect("load worker");
        }
        let elapsed = t0.elapsed().as_secs_f64();
        samples.push(Sample {
            t: elapsed,
            rss: pids.iter().map(|&p| rss_bytes(p)).collect(),
            fds: pids.iter().map(|&p| open_fds(p)).collect(),
            counts: counts.snapshot(),
            redis_mem: redis.used_memory(),
        });

        // Every edit was applied by every sidecar (the last one may still be in flight).
        let c = client();
        for s in &sidecars {
            poll_until(Duration::from_secs(10), "the last policy edit", || async {
                let m = s.metrics(&c).await;
                (metric(&m, "tollgate_rules_version", &[]) == Some(version as f64)
                    && metric(&m, "tollgate_config_last_reload_successful", &[]) == Some(1.0))
                .then_some(())
            })
            .await;
        }
        let (mut active, mut redis_errors, mut fallback) = (Vec::new(), 0.0, 0.0);
        for s in &sidecars {
            let m = s.metrics(&c).await;
            active.push(metric(&m, "tollgate_active_keys", &[]).unwrap_or(0.0) as u64);
            redis_errors += metric(&m, "tollgate_redis_errors_total", &[]).unwrap_or(0.0);
            fallback += metric(&m, "tollgate_fallback_admitted_total", &[]).unwrap_or(0.0);
        }

        // ---- Analysis
        let [ok, limited, bad, conn] = samples.last().expect("samples").counts;
        let total = ok + limited + bad + conn;
        let errors = bad + conn;
        let post: Vec<&Sample> = samples.iter().filter(|s| s.t >= warmup as f64).collect();
        assert!(post.len() >= 4, "too few samples after warm-up");
        let k = 3.min(post.len() / 2);
        let (first, last) = (&post[..k], &post[post.len() - k..]);
        let mut report = String::new();
        let mut failures = Vec::new();
        let line = |r: &mut String, s: String| {
            eprintln!("soak: {s}");
            r.push_str(&s);
            r.push('\n');
        };
        line(
            &mut report,
            format!(
                "{secs} s, target {rate:.0} req/s over 3 sidecars ({}), policy edit every \
                 {policy_every} s ({} edits), samples every {sample_every} s, warm-up {warmup} s",
                if cfg!(debug_assertions) {
                    "debug build"
                } else {
                    "release build"
                },
                version - 1
            ),
        );
        line(
            &mut report,
            format!(
                "requests {total} ({:.0}/s): 200 {ok}, 429 {limited}, other status {bad}, \
                 connection errors {conn}; fresh keys {}",
                total as f64 / elapsed,
                fresh.load(Ordering::Relaxed)
            ),
        );
        for (i, active) in active.iter().enumerate() {
            let base = median(first.iter().map(|s| s.rss[i] as f64).collect());
            let end = median(last.iter().map(|s| s.rss[i] as f64).collect());
            let slope = slope_per_min(
                &post
                    .iter()
                    .map(|s| (s.t, s.rss[i] as f64 / MIB))
                    .collect::<Vec<_>>(),
            );
            let tolerance = (3.0 * MIB).max(0.10 * base);
            let fd_base = first.iter().map(|s| s.fds[i]).max().unwrap_or(0);
            let fd_end = last.iter().map(|s| s.fds[i]).max().unwrap_or(0);
            line(
                &mut report,
                format!(
                    "sidecar {i}: RSS {:.1} MiB at start, {:.1} after warm-up, {:.1} at the end \
                     (slope {slope:+.3} MiB/min, tolerance +{:.1}); fds {} at start, {fd_base} \
                     after warm-up, {fd_end} at the end; active keys at the end {}",
                    samples[0].rss[i] as f64 / MIB,
                    base / MIB,
                    end / MIB,
                    tolerance / MIB,
                    samples[0].fds[i],
                    active
                ),
            );
            if end - base > tolerance {
                failures.push(format!(
                    "sidecar {i}: RSS grew {:.1} MiB after warm-up (tolerance {:.1})",
                    (end - base) / MIB,
                    tolerance / MIB
                ));
            }
            if fd_end > fd_base + 8 {
                failures.push(format!(
                    "sidecar {i}: open fds grew from {fd_base} to {fd_end}"
                ));
            }
        }
        line(
            &mut report,
            format!(
                "redis used_memory {:.1} MiB at start, {:.1} MiB at the end; sidecar-side Redis \
                 errors {redis_errors:.0} (timeouts on a busy machine fail open, not counted as \
                 errors), fail-open admissions {fallback:.0}",
                samples[0].redis_mem as f64 / MIB,
                samples.last().expect("samples").redis_mem as f64 / MIB
            ),
        );
        // Errors: at most 0.1 % overall and 1 % in any sampling window.
        if errors as f64 > 0.001 * total as f64 {
            failures.push(format!("{errors} errors in {total} requests"));
        }
        for w in samples.windows(2) {
            let n: u64 = (0..4).map(|j| w[1].counts[j] - w[0].counts[j]).sum();
            let e = (w[1].counts[2] + w[1].counts[3]) - (w[0].counts[2] + w[0].counts[3]);
            if n > 0 && e as f64 > 0.01 * n as f64 {
                failures.push(format!(
                    "error spike between {:.0} s and {:.0} s: {e} of {n}",
                    w[0].t, w[1].t
                ));
            }
        }
        if (total as f64) < 0.7 * rate * secs as f64 {
            failures.push(format!(
                "only {total} requests sent, {:.0} targeted",
                rate * secs as f64
            ));
        }
        if limited == 0 || ok == 0 {
            failures.push("the hot keys were never limited, or nothing was admitted".into());
        }

        let mut table = String::from(
            "\n| t (s) | RSS MiB (3 sidecars) | open fds | req/s | 429/s | errors | redis MiB |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for w in samples.windows(2) {
            let dt = w[1].t - w[0].t;
            let n: u64 = (0..4).map(|j| w[1].counts[j] - w[0].counts[j]).sum();
            let s = &w[1];
            table.push_str(&format!(
                "| {:.0} | {} | {} | {:.0} | {:.0} | {} | {:.1} |\n",
                s.t,
                s.rss
                    .iter()
                    .map(|b| format!("{:.1}", *b as f64 / MIB))
                    .collect::<Vec<_>>()
                    .join(" / "),
                s.fds
                    .iter()
                    .map(|f| f.to_string())
                    .collect::<Vec<_>>()
                    .join(" / "),
                n as f64 / dt,
                (s.counts[1] - w[0].counts[1]) as f64 / dt,
                (s.counts[2] + s.counts[3]) - (w[0].counts[2] + w[0].counts[3]),
                s.redis_mem as f64 / MIB
            ));
        }
        let verdict = if failures.is_empty() {
            "PASS".to_string()
        } else {
            format!("FAIL:\n- {}", failures.join("\n- "))
        };
        line(&mut report, verdict.clone());
        if let Ok(path) = std::env::var("TOLLGATE_SOAK_REPORT") {
            std::fs::write(&path, format!("{report}{table}")).expect("write soak report");
        }
        assert!(failures.is_empty(), "soak failed: {verdict}");
    })
    .await;
}
