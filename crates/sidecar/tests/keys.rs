//! Key sources: each limits independently per key value; missing keys; X-Forwarded-For trust.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use base64::Engine;
use common::*;

/// A policy with one rule `r` (2 per minute, local) keyed by `key` (YAML list items).
fn keyed(key: &str, extra: &str) -> String {
    let mut spec = String::from("rules:\n  - name: r\n    key:\n");
    for line in dedent(key).lines() {
        spec.push_str("      ");
        spec.push_str(line);
        spec.push('\n');
    }
    spec.push_str("    limit:\n      requests: 2\n      period: 1m\n    scope: Local\n");
    for line in dedent(extra).lines() {
        spec.push_str("    ");
        spec.push_str(line);
        spec.push('\n');
    }
    policy("keys", &spec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_key_limits_each_value() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- header: x-api-key", ""), &[]).await;
        let c = client();
        let url = sc.url("/");
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", "a")], 3).await,
            [200, 200, 429]
        );
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", "b")], 3).await,
            [200, 200, 429]
        );
        // Values are compared exactly: "A" is not "a".
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", "A")], 2).await,
            [200, 200]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ip_key_limits_each_peer() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- clientIP: {}", ""), &[]).await;
        let url = sc.url("/");
        let one = client_from([127, 0, 0, 1]);
        let two = client_from([127, 0, 0, 2]);
        assert_eq!(statuses(&one, &url, &[], 3).await, [200, 200, 429]);
        // A client-supplied X-Forwarded-For does not matter with trustedHops 0.
        assert_eq!(
            statuses(&one, &url, &[("x-forwarded-for", "198.51.100.9")], 1).await,
            [429]
        );
        assert_eq!(statuses(&two, &url, &[], 3).await, [200, 200, 429]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_param_key_limits_each_value() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- queryParam: token", ""), &[]).await;
        let c = client();
        assert_eq!(
            statuses(&c, &sc.url("/x?token=t1"), &[], 3).await,
            [200, 200, 429]
        );
        // Same value, other parameters and path around it: same bucket.
        assert_eq!(
            statuses(&c, &sc.url("/y?a=1&token=t1"), &[], 1).await,
            [429]
        );
        // Percent-encoding decodes to the same value.
        assert_eq!(statuses(&c, &sc.url("/?token=%74%31"), &[], 1).await, [429]);
        assert_eq!(
            statuses(&c, &sc.url("/x?token=t2"), &[], 3).await,
            [200, 200, 429]
        );
    })
    .await;
}

/// An unsigned JWT whose payload is `payload`, as an `Authorization` value.
fn bearer(payload: &serde_json::Value) -> String {
    let e = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    format!(
        "Bearer {}.{}.c2lnbmF0dXJl",
        e.encode(br#"{"alg":"HS256","typ":"JWT"}"#),
        e.encode(payload.to_string())
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_claim_key_limits_each_claim_value() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- jwtClaim:\n    claim: org.id", ""), &[]).await;
        let c = client();
        let url = sc.url("/");
        let acme1 = bearer(&serde_json::json!({"sub": "u1", "org": {"id": "acme"}}));
        let acme2 = bearer(&serde_json::json!({"sub": "u2", "org": {"id": "acme"}}));
        let globex = bearer(&serde_json::json!({"sub": "u1", "org": {"id": "globex"}}));
        assert_eq!(
            statuses(&c, &url, &[("authorization", &acme1)], 2).await,
            [200, 200]
        );
        // Another user of the same organisation shares its bucket.
        assert_eq!(
            statuses(&c, &url, &[("authorization", &acme2)], 1).await,
            [429]
        );
        assert_eq!(
            statuses(&c, &url, &[("authorization", &globex)], 3).await,
            [200, 200, 429]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constant_key_shares_one_bucket() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- constant: tier-free", ""), &[]).await;
        let url = sc.url("/");
        let one = client_from([127, 0, 0, 1]);
        let two = client_from([127, 0, 0, 3]);
        assert_eq!(
            statuses(&one, &url, &[("x-api-key", "a")], 2).await,
            [200, 200]
        );
        // Whoever asks, it is the same counter.
        assert_eq!(
            statuses(&two, &sc.url("/other"), &[("x-api-key", "b")], 1).await,
            [429]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_key_limits_each_method_and_path() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- endpoint: {}", ""), &[]).await;
        let c = client();
        assert_eq!(statuses(&c, &sc.url("/a"), &[], 3).await, [200, 200, 429]);
        // The query string is not part of the endpoint.
        assert_eq!(statuses(&c, &sc.url("/a?page=2"), &[], 1).await, [429]);
        assert_eq!(statuses(&c, &sc.url("/b"), &[], 3).await, [200, 200, 429]);
        let post = |path: &str| c.post(sc.url(path)).send();
        assert_eq!(
            post("/a").await.unwrap().status(),
            200,
            "POST /a is its own bucket"
        );
        assert_eq!(post("/a").await.unwrap().status(), 200);
        assert_eq!(post("/a").await.unwrap().status(), 429);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_shares_one_bucket_by_default() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &keyed("- header: x-api-key", ""), &[]).await;
        let c = client();
        let url = sc.url("/");
        // Dropping the header is not a way around the limit.
        assert_eq!(statuses(&c, &url, &[], 3).await, [200, 200, 429]);
        assert_eq!(statuses(&c, &url, &[("x-other", "1")], 1).await, [429]);
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", "a")], 2).await,
            [200, 200]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_with_skip_is_not_limited() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(
            &up.url(),
            &keyed("- header: x-api-key", "onMissingKey: Skip"),
            &[],
        )
        .await;
        let c = client();
        let url = sc.url("/");
        let s = statuses(&c, &url, &[], 10).await;
        assert!(
            s.iter().all(|&s| s == 200),
            "requests without the key were limited: {s:?}"
        );
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", "a")], 3).await,
            [200, 200, 429]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_hops_ignore_client_written_forwarded_entries() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(
            &up.url(),
            &keyed("- clientIP:\n    trustedHops: 1", ""),
            &[],
        )
        .await;
        let c = client();
        let url = sc.url("/");
        // The client rotates a fake left-most entry; the entry the trusted proxy appended stays.
        let mut got = Vec::new();
        for i in 0..6 {
            let xff = format!("10.{}.{}.{}, 203.0.113.7", i, i * 7 % 256, 200 + i);
            let resp = c
                .get(&url)
                .header("x-forwarded-for", &xff)
                .send()
                .await
                .unwrap();
            got.push(resp.status().as_u16());
            if resp.status() == 200 {
                // The app sees the chain with the sidecar's peer appended.
                assert_eq!(header(&resp, "x-upstream-xff"), format!("{xff}, 127.0.0.1"));
            }
        }
        assert_eq!(
            got,
            [200, 200, 429, 429, 429, 429],
            "spoofing evaded the limit"
        );
        // A different client behind the same proxy has its own bucket.
        let s = statuses(
            &c,
            &url,
            &[("x-forwarded-for", "203.0.113.7, 198.51.100.20")],
            3,
        )
        .await;
        assert_eq!(s, [200, 200, 429]);
        // Without the header the peer address is used, and the app sees it as the only entry.
        let resp = c.get(&url).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(header(&resp, "x-upstream-xff"), "127.0.0.1");
    })
    .await;
}
