//! Algorithms that hold or count requests in flight: leaky-bucket shaping and concurrency caps.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::time::{Duration, Instant};

use common::*;

fn leaky_policy() -> String {
    policy(
        "shaped",
        "
        rules:
          - name: smooth
            match:
              path:
                prefix: /shaped
            limit:
              requests: 5
              period: 1s
              algorithm: LeakyBucket
              maxDelay: 1s
            scope: Local
        ",
    )
}

/// Sends `n` GETs at once and returns (status, latency) for each, sorted by latency.
async fn burst(c: &reqwest::Client, url: &str, n: usize) -> Vec<(u16, Duration)> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (c, url) = (c.clone(), url.to_string());
            tokio::spawn(async move {
                let started = Instant::now();
                let resp = c.get(url).send().await.expect("request");
                let status = resp.status().as_u16();
                let _ = resp.bytes().await;
                (status, started.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out.sort_by_key(|(_, took)| *took);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaky_bucket_delays_instead_of_rejecting() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &leaky_policy(), &[]).await;
        let c = client();
        // Open the connections first (on a path no rule matches) so the burst measures
        // shaping, not connection setup.
        let warm = burst(&c, &sc.url("/"), 5).await;
        assert!(warm.iter().all(|(s, _)| *s == 200));
        let got = burst(&c, &sc.url("/shaped"), 5).await;
        assert!(
            got.iter().all(|(s, _)| *s == 200),
            "shaped requests rejected: {got:?}"
        );
        // 5 per second: requests leave 200 ms apart, so the k-th waits about k × 200 ms.
        for (k, (_, took)) in got.iter().enumerate() {
            let expected = Duration::from_millis(200 * k as u64);
            assert!(
                *took + Duration::from_millis(50) >= expected,
                "request {k} took {took:?}, less than its slot at {expected:?}: {got:?}"
            );
            assert!(
                *took < expected + Duration::from_millis(600),
                "request {k} took {took:?}, far beyond its slot at {expected:?}: {got:?}"
            );
        }
        for pair in got.windows(2) {
            assert!(
                pair[1].1 >= pair[0].1 + Duration::from_millis(120),
                "requests were not spread out: {got:?}"
            );
        }
        assert_eq!(up.hits(), 10);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaky_bucket_rejects_beyond_max_delay() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &leaky_policy(), &[]).await;
        let c = client();
        // Twelve at once: the first passes, the next ones wait 200 ms more each up to the 1 s
        // maxDelay (six in all); the rest would wait longer and are rejected at once.
        let got = burst(&c, &sc.url("/shaped"), 12).await;
        let admitted: Vec<Duration> = got
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, t)| *t)
            .collect();
        let rejected: Vec<Duration> = got
            .iter()
            .filter(|(s, _)| *s == 429)
            .map(|(_, t)| *t)
            .collect();
        assert_eq!(
            admitted.len() + rejected.len(),
            12,
            "unexpected statuses: {got:?}"
        );
        assert!(
            (5..=8).contains(&admitted.len()),
            "expected about 6 admitted within maxDelay: {got:?}"
        );
        for took in &admitted {
            assert!(
                *took < Duration::from_millis(1600),
                "a request was held for {took:?}, beyond maxDelay 1 s: {got:?}"
            );
        }
        for took in &rejected {
            assert!(
                *took < Duration::from_millis(500),
                "a rejection was delayed {took:?}"
            );
        }
        assert_eq!(up.hits(), admitted.len());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limit_caps_requests_in_flight() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = policy(
            "capped",
            "
            rules:
              - name: two-at-a-time
                limit:
                  requests: 2
                  algorithm: Concurrency
                scope: Local
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let held: Vec<_> = (0..2)
            .map(|_| {
                let (c, url) = (c.clone(), sc.url("/hold"));
                tokio::spawn(async move {
                    let resp = c.get(url).send().await.expect("held request");
                    let status = resp.status().as_u16();
                    (status, resp.text().await.unwrap_or_default())
                })
            })
            .collect();
        poll_until(
            Duration::from_secs(5),
            "two requests in flight at the app",
            || {
                let n = up.in_flight();
                async move { (n == 2).then_some(()) }
            },
        )
        .await;

        // A third one is refused while two are in flight, without reaching the app.
        let resp = c.get(sc.url("/fast")).send().await.unwrap();
        assert_eq!(resp.status(), 429);
        assert!(header_u64(&resp, "retry-after") >= 1);
        assert_eq!(
            header(&resp, "ratelimit-policy"),
            "\"two-at-a-time\";q=2;qu=\"concurrent-requests\""
        );
        let body: serde_json::Value = resp.json().await.unwrap();
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains("2 requests in flight"), "{detail}");
        assert_eq!(up.hits(), 2);

        up.release();
        for h in held {
            assert_eq!(h.await.unwrap(), (200, "held ok".to_string()));
        }
        // The permits are returned once the responses complete.
        poll_until(
            Duration::from_secs(3),
            "a new request to be admitted",
            || {
                let (c, url) = (c.clone(), sc.url("/fast"));
                async move { (status_of(&c, &url, &[]).await == 200).then_some(()) }
            },
        )
        .await;
        // And the cap applies again to the next pair.
        let got = burst(&c, &sc.url("/hold"), 2).await;
        assert!(got.iter().all(|(s, _)| *s == 200), "{got:?}");
    })
    .await;
}
