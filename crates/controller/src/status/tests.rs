use std::sync::Arc;

use http::{Request, Response};
use http_body_util::BodyExt;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use tollgate_crd::FieldError;
use tower_test::mock;

use super::*;
use crate::index::Index;
use crate::test_util::*;

fn time(secs: i64) -> Time {
    Time(Timestamp::from_second(secs).unwrap())
}

fn view(errors: Vec<FieldError>, compiled: bool, total: u32, in_sync: u32) -> PolicyView {
    let policy = tollgate_crd::compile(&mk_policy("shop", "limits", "api", 10)).unwrap();
    PolicyView {
        namespace: "shop".into(),
        name: "limits".into(),
        uid: Some("uid-limits".into()),
        generation: Some(3),
        errors,
        compiled: compiled.then(|| Arc::new(policy)),
        version: 7,
        sidecars_total: total,
        sidecars_in_sync: in_sync,
        observed_status: None,
        compiled_age: Duration::from_millis(420),
        programmed: None,
        lagging: Vec::new(),
        sidecars_without_redis: 0,
    }
}

fn cond<'a>(s: &'a RateLimitPolicyStatus, t: &str) -> &'a Condition {
    s.conditions.iter().find(|c| c.type_ == t).unwrap()
}

#[test]
fn accepted_and_programmed_when_all_sidecars_acked() {
    let s = desired_status(&view(vec![], true, 3, 3), None, &time(100));
    let a = cond(&s, conditions::ACCEPTED);
    assert_eq!((a.status.as_str(), a.reason.as_str()), ("True", "Accepted"));
    assert_eq!(a.observed_generation, Some(3));
    let p = cond(&s, conditions::PROGRAMMED);
    assert_eq!(
        (p.status.as_str(), p.reason.as_str()),
        ("True", "Programmed")
    );
    assert_eq!(s.rule_count, Some(1));
    assert_eq!(s.sidecars_total, Some(3));
    assert_eq!(s.sidecars_in_sync, Some(3));
    assert_eq!(s.rules_version, Some(7));
    assert_eq!(s.observed_generation, Some(3));
}

#[test]
fn propagation_is_measured_once_per_generation() {
    // Not every sidecar has it yet: nothing to report.
    let pending = desired_status(&view(vec![], true, 3, 1), None, &time(100));
    assert_eq!(pending.propagation, None);
    // The last ack: measured from the compile, stamped now.
    let done = desired_status(&view(vec![], true, 3, 3), Some(&pending), &time(101));
    let p = done.propagation.clone().expect("measured");
    assert_eq!(p.duration_millis, 420);
    assert_eq!(p.completed, time(101).0.to_string());
    // Later passes (a sidecar joins and syncs) keep the figure: the write is stable.
    let mut later = view(vec![], true, 4, 4);
    later.compiled_age = Duration::from_secs(60);
    let again = desired_status(&later, Some(&done), &time(160));
    assert_eq!(again.propagation, Some(p.clone()));
    // A new generation still in flight shows the previous one's figure.
    let mut next = view(vec![], true, 4, 2);
    next.compiled = next.compiled.map(|c| {
        let mut c = (*c).clone();
        c.generation = 4;
        Arc::new(c)
    });
    let in_flight = desired_status(&next, Some(&again), &time(170));
    assert_eq!(in_flight.propagation, Some(p));
}

/// The figure is the time to the acknowledgement that completed the change, as the index
/// stamped it, not the time to the status pass that noticed it (a debounce and the write
/// interval later).
#[test]
fn propagation_ends_at_the_completing_ack_not_at_the_status_write() {
    let mut done = view(vec![], true, 3, 3);
    done.compiled_age = Duration::from_millis(1_250);
    done.programmed = Some(crate::index::Programmed {
        after: Duration::from_millis(180),
        ago: Duration::from_millis(2_070),
    });
    let p = desired_status(&done, None, &time(1_000))
        .propagation
        .expect("measured");
    assert_eq!(p.duration_millis, 180);
    assert_eq!(p.completed, time(998).0.to_string(), "when the ack came");
}

#[test]
fn pending_names_the_pods_that_lag() {
    let mut v = view(vec![], true, 9, 2);
    v.lagging = ["api-0", "api-3", "api-4", "api-5", "api-6"]
        .map(String::from)
        .to_vec();
    let s = desired_status(&v, None, &time(100));
    let p = cond(&s, conditions::PROGRAMMED);
    assert!(
        p.message
            .ends_with("waiting for api-0, api-3, api-4, api-5, api-6 and 2 more to acknowledge"),
        "{}",
        p.message
    );
}

#[test]
fn pending_and_no_sidecars() {
    let s = desired_status(&view(vec![], true, 3, 1), None, &time(100));
    let p = cond(&s, conditions::PROGRAMMED);
    assert_eq!((p.status.as_str(), p.reason.as_str()), ("False", "Pending"));
    assert!(p.message.starts_with("1 of 3"), "{}", p.message);
    let s = desired_status(&view(vec![], true, 0, 0), None, &time(100));
    let p = cond(&s, conditions::PROGRAMMED);
    assert_eq!(
        (p.status.as_str(), p.reason.as_str()),
        ("False", "NoSidecars")
    );
}

#[test]
fn invalid_lists_every_error_with_its_path() {
    let errors = vec![
        FieldError {
            path: "spec.rules[0].limit.requests".into(),
            message: "0 must be between 1 and 1000000000".into(),
        },
        FieldError {
            path: "spec.rules[1].match.path.regex".into(),
            message: "\"([\" is not a valid regular expression".into(),
        },
    ];
    // With a last good version: Programmed still describes it.
    let s = desired_status(&view(errors.clone(), true, 2, 2), None, &time(100));
    let a = cond(&s, conditions::ACCEPTED);
    assert_eq!((a.status.as_str(), a.reason.as_str()), ("False", "Invalid"));
    assert!(
        a.message
            .contains("spec.rules[0].limit.requests: 0 must be"),
        "{}",
        a.message
    );
    assert!(
        a.message.contains("spec.rules[1].match.path.regex"),
        "{}",
        a.message
    );
    assert!(a.message.contains("stays in force"), "{}", a.message);
    assert_eq!(cond(&s, conditions::PROGRAMMED).status, "True");
    // Without one: nothing is programmed.
    let s = desired_status(&view(errors, false, 0, 0), None, &time(100));
    let p = cond(&s, conditions::PROGRAMMED);
    assert_eq!((p.status.as_str(), p.reason.as_str()), ("False", "Pending"));
    assert_eq!(s.rule_count, None);
    assert_eq!(s.rules_version, None);
}

#[test]
fn last_transition_time_moves_only_when_status_changes() {
    let first = desired_status(&view(vec![], true, 2, 1), None, &time(100));
    // Same statuses, different message (2 of 3): times kept.
    let second = desired_status(&view(vec![], true, 3, 1), Some(&first), &time(200));
    assert_eq!(
        cond(&second, conditions::PROGRAMMED).last_transition_time,
        time(100)
    );
    assert_eq!(
        cond(&second, conditions::ACCEPTED).last_transition_time,
        time(100)
    );
    // Programmed flips: only its time moves.
    let third = desired_status(&view(vec![], true, 3, 3), Some(&second), &time(300));
    assert_eq!(
        cond(&third, conditions::PROGRAMMED).last_transition_time,
        time(300)
    );
    assert_eq!(
        cond(&third, conditions::ACCEPTED).last_transition_time,
        time(100)
    );
}

#[test]
fn long_messages_are_truncated_at_a_char_boundary() {
    let s = truncate("é".repeat(100), 51);
    assert!(s.len() <= 51);
    assert!(s.ends_with("..."));
}

type Handle = mock::Handle<Request<Body>, Response<Body>>;

fn writer(index: &SharedIndex) -> (StatusWriter, Handle) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(svc, "default");
    let (metrics, _registry) = Metrics::new(index.clone());
    let w = StatusWriter::new(
        client,
        index.clone(),
        metrics,
        "test-0".into(),
        Duration::ZERO,
    );
    (w, handle)
}

/// Expects a status apply for shop/limits; answers with the object carrying that status.
async fn expect_status_patch(handle: &mut Handle) -> serde_json::Value {
    let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a status patch")
        .expect("service alive");
    assert_eq!(req.method(), http::Method::PATCH);
    assert_eq!(
        req.uri().path(),
        "/apis/tollgate.dev/v1alpha1/namespaces/shop/ratelimitpolicies/limits/status"
    );
    let query = req.uri().query().unwrap_or("");
    assert!(
        query.contains("fieldManager=tollgate-controller"),
        "{query}"
    );
    assert!(query.contains("force=true"), "{query}");
    assert_eq!(
        req.headers()[http::header::CONTENT_TYPE],
        "application/apply-patch+yaml"
    );
    let body: serde_json::Value =
        serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let mut obj = serde_json::to_value(mk_policy("shop", "limits", "api", 10)).unwrap();
    obj["status"] = body["status"].clone();
    send.send_response(
        Response::builder()
            .body(Body::from(serde_json::to_vec(&obj).unwrap()))
            .unwrap(),
    );
    body
}

async fn expect_event(handle: &mut Handle) -> serde_json::Value {
    let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("an event")
        .expect("service alive");
    assert_eq!(req.method(), http::Method::POST);
    assert_eq!(
        req.uri().path(),
        "/apis/events.k8s.io/v1/namespaces/shop/events"
    );
    let body: serde_json::Value =
        serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes()).unwrap();
    send.send_response(
        Response::builder()
            .status(201)
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap(),
    );
    body
}

async fn expect_silence(handle: &mut Handle) {
    assert!(
        tokio::time::timeout(Duration::from_millis(150), handle.next_request())
            .await
            .is_err(),
        "no API call expected"
    );
}

#[tokio::test]
async fn writes_status_once_and_skips_no_op_patches() {
    let index = Index::shared("e");
    index
        .write()
        .apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let (mut w, mut handle) = writer(&index);

    let (_, body) = tokio::join!(w.sync_once(), expect_status_patch(&mut handle));
    assert_eq!(body["apiVersion"], "tollgate.dev/v1alpha1");
    assert_eq!(body["kind"], "RateLimitPolicy");
    let status = &body["status"];
    assert_eq!(status["conditions"][0]["type"], "Accepted");
    assert_eq!(status["conditions"][0]["status"], "True");
    assert_eq!(status["conditions"][1]["type"], "Programmed");
    assert_eq!(status["conditions"][1]["reason"], "NoSidecars");
    assert_eq!(status["ruleCount"], 1);
    assert_eq!(status["observedGeneration"], 10);

    // Nothing changed: no second write, even before the watch echoes the first.
    let ((), ()) = tokio::join!(
        async {
            w.sync_once().await;
        },
        expect_silence(&mut handle)
    );

    // The watch echoes the status: still nothing to write.
    let mut echoed = mk_policy("shop", "limits", "api", 10);
    echoed.status = Some(serde_json::from_value(status.clone()).unwrap());
    index.write().apply_policy(input(&echoed));
    let ((), ()) = tokio::join!(
        async {
            w.sync_once().await;
        },
        expect_silence(&mut handle)
    );
}

#[tokio::test]
async fn rejected_policy_gets_an_event_and_invalid_condition() {
    let index = Index::shared("e");
    index
        .write()
        .apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    index
        .write()
        .apply_policy(input(&mk_bad_policy("shop", "limits", "api", 11)));
    let (mut w, mut handle) = writer(&index);

    let script = async {
        let event = expect_event(&mut handle).await;
        let patch = expect_status_patch(&mut handle).await;
        (event, patch)
    };
    let (_, (event, patch)) = tokio::join!(w.sync_once(), script);
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "Invalid");
    assert_eq!(event["regarding"]["kind"], "RateLimitPolicy");
    assert_eq!(event["regarding"]["name"], "limits");
    assert!(
        event["note"]
            .as_str()
            .unwrap()
            .contains("spec.rules[0].limit.requests"),
        "{event}"
    );
    let accepted = &patch["status"]["conditions"][0];
    assert_eq!(accepted["status"], "False");
    assert_eq!(accepted["reason"], "Invalid");
    assert_eq!(accepted["observedGeneration"], 11);
    assert!(
        accepted["message"]
            .as_str()
            .unwrap()
            .contains("spec.rules[0].match.path.regex"),
        "{accepted}"
    );
    // The last good version (generation 10) is still what sidecars enforce.
    assert_eq!(patch["status"]["ruleCount"], 1);

    // One event per generation: a later pass publishes none.
    let ((), ()) = tokio::join!(
        async {
            w.sync_once().await;
        },
        expect_silence(&mut handle)
    );
}

#[tokio::test]
async fn sidecar_acks_flip_programmed() {
    let index = Index::shared("e");
    {
        let mut i = index.write();
        i.apply_pod(mk_pod("shop", "api-1", &[("app", "api")]));
        i.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    }
    let (_conn, sub) = crate::membership::connect(&index, "shop", "api-1", None, true).unwrap();
    let (mut w, mut handle) = writer(&index);
    let (_, body) = tokio::join!(w.sync_once(), expect_status_patch(&mut handle));
    assert_eq!(body["status"]["conditions"][1]["reason"], "Pending");
    assert_eq!(body["status"]["sidecarsTotal"], 1);
    assert_eq!(body["status"]["sidecarsInSync"], 0);

    let v = sub.rx.borrow().version;
    crate::membership::ack(&index, "shop", "api-1", v, "e").unwrap();
    let (_, body) = tokio::join!(w.sync_once(), expect_status_patch(&mut handle));
    assert_eq!(body["status"]["conditions"][1]["status"], "True");
    assert_eq!(body["status"]["conditions"][1]["reason"], "Programmed");
    assert_eq!(body["status"]["sidecarsInSync"], 1);
}

#[tokio::test]
async fn writes_are_rate_limited_per_policy() {
    let index = Index::shared("e");
    {
        let mut i = index.write();
        i.apply_pod(mk_pod("shop", "api-1", &[("app", "api")]));
        i.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    }
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(svc, "default");
    let (metrics, _registry) = Metrics::new(index.clone());
    let mut w = StatusWriter::new(
        client,
        index.clone(),
        metrics,
        "t".into(),
        Duration::from_secs(30),
    );
    let (_, _) = tokio::join!(w.sync_once(), expect_status_patch(&mut handle));
    // A change right after the write is deferred, and the writer says when to come back.
    let _c = crate::membership::connect(&index, "shop", "api-1", None, true).unwrap();
    let (next, ()) = tokio::join!(w.sync_once(), expect_silence(&mut handle));
    let next = next.expect("a deferred write");
    assert!(next > Instant::now() + Duration::from_secs(20));
}

#[test]
fn status_says_how_each_global_rule_decides_with_the_sidecars_connected() {
    // The rule has 10 requests per minute (capacity 10) and the default accuracy: Auto.
    let modes =
        |total| desired_status(&view(vec![], true, total, total), None, &time(1)).global_rules;
    let two = modes(2);
    assert_eq!(two.len(), 1);
    assert_eq!(
        (two[0].name.as_str(), two[0].mode.as_str()),
        ("rule-0", "Leased")
    );
    assert!(
        two[0].reason.contains("10 tokens over 2 sidecars"),
        "{}",
        two[0].reason
    );
    let three = modes(3);
    assert_eq!(three[0].mode, "Exact", "a share of 3.3 tokens is under 5");
    assert!(three[0].reason.contains("under 5"), "{}", three[0].reason);
    assert!(
        desired_status(&view(vec![], false, 3, 3), None, &time(1))
            .global_rules
            .is_empty()
    );
}

#[test]
fn global_rules_say_when_sidecars_without_redis_enforce_them_per_pod() {
    let mut v = view(vec![], true, 3, 3);
    let reason = |v: &PolicyView| {
        desired_status(v, None, &time(1)).global_rules[0]
            .reason
            .clone()
    };
    assert!(!reason(&v).contains("Redis"), "{}", reason(&v));
    v.sidecars_without_redis = 1;
    assert!(
        reason(&v).ends_with("but 1 of the 3 selected sidecars have no Redis: each of those enforces the whole limit on its own"),
        "{}",
        reason(&v)
    );
    v.sidecars_without_redis = 3;
    assert!(
        reason(&v).contains("none of the 3 selected sidecars has Redis"),
        "{}",
        reason(&v)
    );
}
