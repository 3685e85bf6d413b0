use super::*;

impl FleetTopKeys {
    /// Records for policies without a UID.
    fn record_any(&self, report: &TopKeysReport, now: Instant) -> Result<(), Refused> {
        self.record(report, &|_, _| None, now)
    }
}
use tollgate_crd::stream::ReportedKey;

fn report(pod: &str, keys: &[(&str, &str, u64, u64)]) -> TopKeysReport {
    TopKeysReport {
        namespace: "shop".into(),
        pod: pod.into(),
        keys: keys
            .iter()
            .map(|(rule, hash, rejected, over)| ReportedKey {
                rule: (*rule).into(),
                key_hash: (*hash).into(),
                rejected: *rejected,
                max_overcount: *over,
            })
            .collect(),
    }
}

const A: &str = "00000000000000aa";
const B: &str = "00000000000000bb";

#[test]
fn reports_from_several_pods_add_up_per_policy_and_key() {
    let top = FleetTopKeys::new(Duration::from_secs(600));
    let now = Instant::now();
    top.record_any(
        &report(
            "api-0",
            &[
                ("shop/limits/per-key", A, 50, 1),
                ("shop/limits/per-key", B, 5, 0),
            ],
        ),
        now,
    )
    .unwrap();
    top.record_any(&report("api-1", &[("shop/limits/per-key", A, 30, 0)]), now)
        .unwrap();
    top.record_any(&report("api-1", &[("shop/other/r", B, 7, 0)]), now)
        .unwrap();
    top.refresh(now, "t1");
    let limits = top.of("shop", "limits", None).unwrap();
    assert_eq!(limits.window, "10m");
    assert_eq!(limits.updated, "t1");
    let first = &limits.keys[0];
    assert_eq!(
        (first.rule.as_str(), first.key_hash.as_str()),
        ("per-key", A)
    );
    assert_eq!(
        (first.rejected, first.max_overcount, first.pod_count),
        (80, 1, 2)
    );
    assert_eq!(first.pods, ["api-0", "api-1"]);
    assert_eq!(limits.keys[1].rejected, 5);
    assert_eq!(top.of("shop", "other", None).unwrap().keys[0].rejected, 7);
    assert!(top.of("shop", "nope", None).is_none());
}

#[test]
fn an_unchanged_list_keeps_its_stamp_and_wakes_nobody() {
    let top = FleetTopKeys::new(Duration::from_secs(600));
    let mut rx = top.published();
    let now = Instant::now();
    top.record_any(&report("api-0", &[("shop/limits/per-key", A, 3, 0)]), now)
        .unwrap();
    top.refresh(now, "t1");
    assert!(rx.has_changed().unwrap());
    rx.borrow_and_update();
    top.refresh(now, "t2");
    assert!(!rx.has_changed().unwrap());
    assert_eq!(top.of("shop", "limits", None).unwrap().updated, "t1");
    top.record_any(&report("api-0", &[("shop/limits/per-key", A, 1, 0)]), now)
        .unwrap();
    top.refresh(now, "t3");
    assert!(rx.has_changed().unwrap());
    assert_eq!(top.of("shop", "limits", None).unwrap().updated, "t3");
}

#[test]
fn counts_leave_with_the_window() {
    let window = Duration::from_secs(100);
    let top = FleetTopKeys::new(window);
    let t0 = Instant::now();
    top.record_any(&report("api-0", &[("shop/limits/per-key", A, 3, 0)]), t0)
        .unwrap();
    top.record_any(
        &report("api-0", &[("shop/limits/per-key", A, 4, 0)]),
        t0 + Duration::from_secs(50),
    )
    .unwrap();
    top.refresh(t0 + Duration::from_secs(95), "t");
    assert_eq!(top.of("shop", "limits", None).unwrap().keys[0].rejected, 7);
    top.refresh(t0 + Duration::from_secs(120), "t");
    assert_eq!(top.of("shop", "limits", None).unwrap().keys[0].rejected, 4);
    top.refresh(t0 + Duration::from_secs(200), "t");
    assert!(
        top.of("shop", "limits", None).is_none(),
        "an empty list leaves the status"
    );
}

#[test]
fn a_pod_reports_only_on_its_own_namespace_with_well_formed_hashes() {
    let top = FleetTopKeys::new(Duration::from_secs(600));
    let now = Instant::now();
    let foreign = report("api-0", &[("bank/limits/per-key", A, 3, 0)]);
    assert_eq!(
        top.record_any(&foreign, now),
        Err(Refused::ForeignRule("bank/limits/per-key".into()))
    );
    assert!(matches!(
        top.record_any(&report("api-0", &[("shop/limits", A, 3, 0)]), now),
        Err(Refused::ForeignRule(_))
    ));
    assert!(matches!(
        top.record_any(
            &report("api-0", &[("shop/limits/r", "raw-api-key", 3, 0)]),
            now
        ),
        Err(Refused::BadKeyHash(_))
    ));
    let many: Vec<(&str, &str, u64, u64)> = vec![("shop/limits/r", A, 1, 0); MAX_REPORTED_KEYS + 1];
    assert!(matches!(
        top.record_any(&report("api-0", &many), now),
        Err(Refused::TooManyKeys(_))
    ));
    top.refresh(now, "t");
    assert!(
        top.published().borrow().is_empty(),
        "nothing of a refused report is counted"
    );
}

#[test]
fn a_heavy_key_survives_a_flood_of_distinct_keys_within_the_documented_error() {
    let top = FleetTopKeys::new(Duration::from_secs(600));
    let now = Instant::now();
    let hashes: Vec<String> = (0..20_000u64)
        .map(|i| format!("{:016x}", 0x1000 + i))
        .collect();
    for (round, chunk) in hashes.chunks(60).enumerate() {
        let mut keys: Vec<(&str, &str, u64, u64)> = chunk
            .iter()
            .map(|h| ("shop/limits/r", h.as_str(), 1, 0))
            .collect();
        keys.push(("shop/limits/r", A, 10, 0));
        let pod = format!("api-{}", round % 7);
        top.record_any(&report(&pod, &keys), now).unwrap();
    }
    top.refresh(now, "t");
    let keys = top.of("shop", "limits", None).unwrap().keys;
    assert_eq!(keys.len(), TOP_N);
    let heavy = &keys[0];
    let sent = 10 * hashes.chunks(60).count() as u64;
    assert_eq!(heavy.key_hash, A);
    assert!(heavy.rejected >= sent, "{} < {sent}", heavy.rejected);
    assert!(heavy.rejected - heavy.max_overcount <= sent);
    assert_eq!(heavy.pod_count, 7);
    assert_eq!(heavy.pods.len(), PODS_NAMED);
}

#[test]
fn peers_summaries_join_the_fleet_view_until_they_leave() {
    let top = FleetTopKeys::new(Duration::from_secs(600));
    let now = Instant::now();
    top.record_any(&report("api-0", &[("shop/limits/per-key", A, 3, 0)]), now)
        .unwrap();
    top.refresh(now, "t");
    let local = top.local().borrow().clone();
    assert_eq!(local["shop/limits"][0].rejected, 3);
    let mut peer = Summary::new();
    peer.insert(
        "shop/limits".into(),
        vec![LimitedKey {
            rule: "per-key".into(),
            key_hash: A.into(),
            rejected: 10,
            max_overcount: 2,
            pods: vec!["api-9".into()],
            pod_count: 4,
        }],
    );
    top.set_peer("replica-b", peer);
    top.refresh(now, "t2");
    let k = &top.of("shop", "limits", None).unwrap().keys[0];
    assert_eq!((k.rejected, k.max_overcount, k.pod_count), (13, 2, 5));
    assert_eq!(k.pods, ["api-0", "api-9"]);
    top.forget_peer("replica-b");
    top.refresh(now, "t3");
    assert_eq!(top.of("shop", "limits", None).unwrap().keys[0].rejected, 3);
}

#[test]
fn a_policy_created_again_under_its_name_starts_without_the_old_keys() {
    let top = FleetTopKeys::new(Duration::from_secs(600));
    let now = Instant::now();
    let old = |_: &str, _: &str| Some("uid-1".to_string());
    top.record(
        &report("api-0", &[("shop/limits/per-key", A, 9, 0)]),
        &old,
        now,
    )
    .unwrap();
    top.refresh(now, "t1");
    assert_eq!(
        top.of("shop", "limits", Some("uid-1")).unwrap().keys[0].rejected,
        9
    );
    // Deleted and created again: the new object (uid-2) has rejected nobody yet.
    assert!(top.of("shop", "limits", Some("uid-2")).is_none());
    let new = |_: &str, _: &str| Some("uid-2".to_string());
    top.record(
        &report("api-0", &[("shop/limits/per-key", B, 2, 0)]),
        &new,
        now,
    )
    .unwrap();
    top.refresh(now, "t2");
    let keys = top.of("shop", "limits", Some("uid-2")).unwrap().keys;
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!((keys[0].key_hash.as_str(), keys[0].rejected), (B, 2));
}
