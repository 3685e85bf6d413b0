use super::*;
use crate::test_util::*;

fn names(rules: &PodRules) -> Vec<String> {
    rules.policies.iter().map(|p| p.id()).collect()
}

fn index_with_pods() -> Index {
    let mut index = Index::new("epoch-1");
    index.apply_pod(mk_pod("shop", "api-1", &[("app", "api")]));
    index.apply_pod(mk_pod("shop", "api-2", &[("app", "api")]));
    index.apply_pod(mk_pod("shop", "web-1", &[("app", "web")]));
    index
}

#[test]
fn policy_add_selects_matching_pods_only() {
    let mut index = index_with_pods();
    let mut api = index.pod_rx("shop", "api-1").unwrap();
    let mut web = index.pod_rx("shop", "web-1").unwrap();
    let before = index.version();

    assert!(index.apply_policy(input(&mk_policy("shop", "limits", "api", 10))));
    assert!(index.version() > before);
    assert!(api.has_changed().unwrap());
    let rules = api.borrow_and_update().clone();
    assert_eq!(names(&rules), ["shop/limits"]);
    assert_eq!(rules.version, index.version());
    assert_eq!(rules.policies[0].rules[0].limit.requests, 10);
    assert!(
        !web.has_changed().unwrap(),
        "an unselected pod is not woken"
    );
    assert!(web.borrow_and_update().policies.is_empty());
}

#[test]
fn policies_of_other_namespaces_never_apply() {
    let mut index = index_with_pods();
    index.apply_pod(mk_pod("other", "api-1", &[("app", "api")]));
    index.apply_policy(input(&mk_policy("other", "limits", "api", 10)));
    assert!(
        index
            .pod_rules("shop", "api-1")
            .unwrap()
            .policies
            .is_empty()
    );
    assert_eq!(
        names(&index.pod_rules("other", "api-1").unwrap()),
        ["other/limits"]
    );
}

#[test]
fn policy_update_bumps_version_and_noop_update_does_not() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let mut rx = index.pod_rx("shop", "api-1").unwrap();
    rx.borrow_and_update();
    let v1 = index.version();

    // The same object again (e.g. our own status write echoed by the watch): nothing moves.
    let mut same = mk_policy("shop", "limits", "api", 10);
    same.status = Some(RateLimitPolicyStatus {
        rule_count: Some(1),
        ..RateLimitPolicyStatus::default()
    });
    assert!(!index.apply_policy(input(&same)));
    assert_eq!(index.version(), v1);
    assert!(!rx.has_changed().unwrap());
    // The observed status is still recorded for the status writer.
    assert_eq!(
        index
            .policy_view("shop", "limits")
            .unwrap()
            .observed_status
            .unwrap()
            .rule_count,
        Some(1)
    );

    assert!(index.apply_policy(input(&mk_policy("shop", "limits", "api", 20))));
    let v2 = index.version();
    assert!(v2 > v1);
    assert!(rx.has_changed().unwrap());
    let rules = rx.borrow_and_update().clone();
    assert_eq!(rules.version, v2);
    assert_eq!(rules.policies[0].rules[0].limit.requests, 20);
    assert_eq!(index.policy_view("shop", "limits").unwrap().version, v2);
}

#[test]
fn bad_update_keeps_last_good_version_and_records_errors() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let mut rx = index.pod_rx("shop", "api-1").unwrap();
    rx.borrow_and_update();
    let v1 = index.version();

    assert!(!index.apply_policy(input(&mk_bad_policy("shop", "limits", "api", 2))));
    assert_eq!(index.version(), v1, "an invalid update changes no rules");
    assert!(!rx.has_changed().unwrap());
    assert_eq!(rx.borrow().policies[0].rules[0].limit.requests, 10);

    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!(view.generation, Some(2));
    assert!(view.compiled.is_some(), "last good version stays in force");
    let paths: Vec<&str> = view.errors.iter().map(|e| e.path.as_str()).collect();
    assert!(paths.contains(&"spec.rules[0].limit.requests"), "{paths:?}");
    assert!(
        paths.contains(&"spec.rules[0].match.path.regex"),
        "{paths:?}"
    );
    assert_eq!(index.summary().invalid_policies, 1);
    assert_eq!(index.stats().compiles_failed, 1);

    // Fixing it applies the new version and clears the errors.
    assert!(index.apply_policy(input(&mk_policy("shop", "limits", "api", 30))));
    assert!(rx.has_changed().unwrap());
    assert_eq!(
        rx.borrow_and_update().policies[0].rules[0].limit.requests,
        30
    );
    assert!(
        index
            .policy_view("shop", "limits")
            .unwrap()
            .errors
            .is_empty()
    );
    assert_eq!(index.summary().invalid_policies, 0);
}

/// An object stored with a misspelled field (the validating webhook was absent) decodes, as the
/// watch decodes it, and is not Accepted: the field is an error; the last good version stays.
#[test]
fn stored_unknown_field_is_an_error_and_keeps_last_good_version() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let v1 = index.version();
    let mut stored = serde_json::to_value(mk_policy("shop", "limits", "api", 20)).unwrap();
    stored["metadata"]["generation"] = serde_json::json!(2);
    stored["metadata"]["futureMetaField"] = serde_json::json!("not tollgate's business");
    stored["spec"]["rules"][0]["limit"]["burts"] = serde_json::json!(5);
    let decoded: tollgate_crd::Decoded = serde_json::from_value(stored).unwrap();
    assert!(!index.apply_policy(PolicyInput::from_decoded(&decoded).unwrap()));
    assert_eq!(index.version(), v1, "the misspelled version was applied");
    let view = index.policy_view("shop", "limits").unwrap();
    let errors: Vec<String> = view.errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        ["spec.rules[0].limit.burts: unknown field (did you mean `burst`?)"]
    );
    assert!(view.compiled.is_some(), "last good version stays in force");
}

#[test]
fn policy_invalid_from_the_start_is_not_enforced() {
    let mut index = index_with_pods();
    assert!(!index.apply_policy(input(&mk_bad_policy("shop", "limits", "api", 1))));
    assert!(
        index
            .pod_rules("shop", "api-1")
            .unwrap()
            .policies
            .is_empty()
    );
    let view = index.policy_view("shop", "limits").unwrap();
    assert!(view.compiled.is_none());
    assert!(!view.errors.is_empty());
}

#[test]
fn recreated_policy_with_new_uid_does_not_inherit_last_good() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let mut bad = mk_bad_policy("shop", "limits", "api", 1);
    bad.metadata.uid = Some("another-uid".into());
    assert!(index.apply_policy(input(&bad)));
    assert!(
        index
            .pod_rules("shop", "api-1")
            .unwrap()
            .policies
            .is_empty()
    );
}

#[test]
fn delete_policy_removes_its_rules() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    index.apply_policy(input(&mk_policy("shop", "extra", "api", 5)));
    let mut rx = index.pod_rx("shop", "api-1").unwrap();
    assert_eq!(
        names(&rx.borrow_and_update()),
        ["shop/extra", "shop/limits"],
        "ordered by name"
    );
    let v = index.version();
    assert!(index.delete_policy("shop", "extra"));
    assert!(index.version() > v);
    assert!(rx.has_changed().unwrap());
    assert_eq!(names(&rx.borrow_and_update()), ["shop/limits"]);
    assert!(index.policy_view("shop", "extra").is_none());
    assert!(
        !index.delete_policy("shop", "extra"),
        "second delete is a no-op"
    );
}

#[test]
fn pod_label_change_moves_pod_between_rule_sets() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "api-limits", "api", 10)));
    index.apply_policy(input(&mk_policy("shop", "web-limits", "web", 5)));
    let mut rx = index.pod_rx("shop", "api-1").unwrap();
    assert_eq!(names(&rx.borrow_and_update()), ["shop/api-limits"]);

    let v = index.version();
    assert!(index.apply_pod(mk_pod("shop", "api-1", &[("app", "web")])));
    assert!(rx.has_changed().unwrap());
    let rules = rx.borrow_and_update().clone();
    assert_eq!(names(&rules), ["shop/web-limits"]);
    assert!(rules.version > v);

    // A label change that selects the same policies is not a change.
    let v = index.version();
    assert!(!index.apply_pod(mk_pod("shop", "api-1", &[("app", "web"), ("tier", "x")])));
    assert_eq!(index.version(), v);
    assert!(!rx.has_changed().unwrap());

    // Losing every label loses every policy.
    assert!(index.apply_pod(mk_pod("shop", "api-1", &[])));
    assert!(rx.borrow_and_update().policies.is_empty());
}

#[test]
fn noop_updates_and_relists_do_not_bump_the_version() {
    let mut index = index_with_pods();
    let p = mk_policy("shop", "limits", "api", 10);
    index.apply_policy(input(&p));
    let mut rx = index.pod_rx("shop", "api-1").unwrap();
    rx.borrow_and_update();
    let v = index.version();

    assert!(!index.apply_pod(mk_pod("shop", "api-1", &[("app", "api")])));
    assert!(!index.apply_policy(input(&p)));
    assert!(!index.reset_policies(None, vec![input(&p)]));
    assert!(!index.reset_pods(
        Some("shop"),
        vec![
            mk_pod("shop", "api-1", &[("app", "api")]),
            mk_pod("shop", "api-2", &[("app", "api")]),
            mk_pod("shop", "web-1", &[("app", "web")]),
        ]
    ));
    assert_eq!(index.version(), v);
    assert!(!rx.has_changed().unwrap());
}

#[test]
fn relist_drops_missing_objects_within_scope_only() {
    let mut index = index_with_pods();
    index.apply_pod(mk_pod("other", "api-1", &[("app", "api")]));
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    index.apply_policy(input(&mk_policy("other", "limits", "api", 10)));

    // A relist of namespace "shop" that no longer has the policy.
    assert!(index.reset_policies(Some("shop"), vec![]));
    assert!(
        index
            .pod_rules("shop", "api-1")
            .unwrap()
            .policies
            .is_empty()
    );
    assert_eq!(index.pod_rules("other", "api-1").unwrap().policies.len(), 1);

    // A relist of all pods that lost api-2.
    index.reset_pods(
        None,
        vec![
            mk_pod("shop", "api-1", &[("app", "api")]),
            mk_pod("shop", "web-1", &[("app", "web")]),
            mk_pod("other", "api-1", &[("app", "api")]),
        ],
    );
    assert!(!index.has_pod("shop", "api-2"));
    assert!(index.has_pod("shop", "api-1"));
}

#[test]
fn new_pods_get_a_fresh_version_and_wake_waiters() {
    let mut index = index_with_pods();
    let mut pods = index.pods_rx();
    pods.borrow_and_update();
    let v = index.version();
    index.apply_pod(mk_pod("shop", "api-3", &[("app", "api")]));
    assert!(pods.has_changed().unwrap());
    assert!(index.version() > v);
    assert_eq!(
        index.pod_rules("shop", "api-3").unwrap().version,
        index.version()
    );
}

#[test]
fn deleting_a_pod_closes_its_channel() {
    let mut index = index_with_pods();
    let rx = index.pod_rx("shop", "api-1").unwrap();
    assert!(index.delete_pod("shop", "api-1"));
    assert!(rx.has_changed().is_err());
    assert!(index.pod_rules("shop", "api-1").is_none());
}

/// A StatefulSet pod re-created under the same name: a watch event with another UID (a relist
/// that missed the delete) replaces the pod, ending the old one's streams and counts; the same
/// UID with new labels is an ordinary update.
#[test]
fn a_pod_with_another_uid_is_a_new_pod() {
    let mut index = Index::new("epoch-1");
    index.apply_policy(input(&mk_policy("shop", "limits", "web", 10)));
    let pod = |uid: &str, app: &str| mk_pod_uid("shop", "web-0", uid, &[("app", app)]);
    index.apply_pod(pod("uid-1", "web"));
    assert_eq!(index.pod_uid("shop", "web-0").as_deref(), Some("uid-1"));
    let old = index.connect("shop", "web-0", None).unwrap();
    assert_eq!(index.summary().connected["shop/limits"], 1);

    index.apply_pod(pod("uid-1", "web-v2"));
    assert!(old.rx.has_changed().is_ok(), "same UID: the stream goes on");

    index.apply_pod(pod("uid-2", "web"));
    assert_eq!(index.pod_uid("shop", "web-0").as_deref(), Some("uid-2"));
    assert!(old.rx.has_changed().is_err(), "the old pod's stream ends");
    assert_eq!(index.summary().connected["shop/limits"], 0);
    let new = index.connect("shop", "web-0", None).unwrap();
    assert_ne!(new.pod_id, old.pod_id);
    index.disconnect("shop", "web-0", old.pod_id);
    assert_eq!(index.summary().connected["shop/limits"], 1);
}

#[test]
fn membership_counts_connected_pods_once() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let mut rx2 = index.pod_rx("shop", "api-2").unwrap();

    let a = index.connect("shop", "api-1", None).unwrap();
    assert_eq!(a.rx.borrow().members["shop/limits"], 1);
    let v = index.version();
    // The other (unconnected) pod also learns the count, without a version change.
    assert!(rx2.has_changed().unwrap());
    assert_eq!(rx2.borrow_and_update().members["shop/limits"], 1);

    let b = index.connect("shop", "api-2", None).unwrap();
    assert_eq!(b.rx.borrow().members["shop/limits"], 2);
    assert_eq!(a.rx.borrow().members["shop/limits"], 2);
    // A second stream of the same pod counts once.
    let b2 = index.connect("shop", "api-2", None).unwrap();
    assert_eq!(a.rx.borrow().members["shop/limits"], 2);
    assert_eq!(
        index.version(),
        v,
        "membership does not change rule versions"
    );
    assert_eq!(index.summary().connected["shop/limits"], 2);

    index.disconnect("shop", "api-2", b.pod_id);
    assert_eq!(a.rx.borrow().members["shop/limits"], 2);
    index.disconnect("shop", "api-2", b2.pod_id);
    assert_eq!(a.rx.borrow().members["shop/limits"], 1);
    // A stale disconnect (pod re-created meanwhile) is ignored.
    index.delete_pod("shop", "api-1");
    index.apply_pod(mk_pod("shop", "api-1", &[("app", "api")]));
    let c = index.connect("shop", "api-1", None).unwrap();
    index.disconnect("shop", "api-1", a.pod_id);
    assert_eq!(c.rx.borrow().members["shop/limits"], 1);
}

#[test]
fn membership_follows_rule_set_changes() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let a = index.connect("shop", "api-1", None).unwrap();
    let _b = index.connect("shop", "api-2", None).unwrap();
    assert_eq!(a.rx.borrow().members["shop/limits"], 2);
    // api-2 stops being selected: api-1's count drops.
    index.apply_pod(mk_pod("shop", "api-2", &[("app", "web")]));
    assert_eq!(a.rx.borrow().members["shop/limits"], 1);
}

#[test]
fn acks_drive_sync_counts_and_lag() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let a = index.connect("shop", "api-1", None).unwrap();
    let _b = index.connect("shop", "api-2", None).unwrap();
    let v = a.rx.borrow().version;

    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 0));

    // A change while sidecars are connected is pending until both ack it.
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 20)));
    let v2 = index.version();
    assert!(v2 > v);
    assert_eq!(
        index.ack("shop", "api-1", v2, "epoch-1").unwrap(),
        Vec::<Duration>::new()
    );
    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 1));
    let lags = index.ack("shop", "api-2", v2, "epoch-1").unwrap();
    assert_eq!(lags.len(), 1, "the last ack completes the change");
    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 2));

    // Duplicate acks are harmless; bad ones are refused.
    assert_eq!(
        index.ack("shop", "api-2", v2, "epoch-1").unwrap(),
        Vec::<Duration>::new()
    );
    assert!(matches!(
        index.ack("shop", "api-1", v2, "other"),
        Err(AckError::EpochMismatch { .. })
    ));
    assert!(matches!(
        index.ack("shop", "api-1", v2 + 10, "epoch-1"),
        Err(AckError::FutureVersion { .. })
    ));
    assert_eq!(
        index.ack("shop", "nope", v2, "epoch-1"),
        Err(AckError::UnknownPod)
    );
}

#[test]
fn an_ack_counts_only_for_policies_it_contains() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let _a = index.connect("shop", "api-1", None).unwrap();
    let v1 = index.version();
    index.ack("shop", "api-1", v1, "epoch-1").unwrap();
    // A second policy arrives: the old ack covers `limits` but not `extra`.
    index.apply_policy(input(&mk_policy("shop", "extra", "api", 5)));
    let limits = index.policy_view("shop", "limits").unwrap();
    let extra = index.policy_view("shop", "extra").unwrap();
    assert_eq!(limits.sidecars_in_sync, 1);
    assert_eq!(extra.sidecars_in_sync, 0);
    assert_eq!(extra.sidecars_total, 1);
}

#[test]
fn resume_in_the_same_epoch_counts_as_an_ack() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let v = index.pod_rules("shop", "api-1").unwrap().version;
    let s = index
        .connect("shop", "api-1", Some((v, "epoch-1")))
        .unwrap();
    assert!(s.resumed);
    assert_eq!(
        index
            .policy_view("shop", "limits")
            .unwrap()
            .sidecars_in_sync,
        1
    );
    let s2 = index
        .connect("shop", "api-2", Some((v, "old-epoch")))
        .unwrap();
    assert!(!s2.resumed);
    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 1));
}

/// Two replicas, each with one of two sidecars: after exchanging reports, both push the fleet
/// count, and each one's status counts both sidecars and who runs the current generation.
#[test]
fn reports_of_other_replicas_join_counts_and_status() {
    let mut a = index_with_pods();
    let mut b = index_with_pods();
    for index in [&mut a, &mut b] {
        index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    }
    let on_a = a.connect("shop", "api-1", None).unwrap();
    let on_b = b.connect("shop", "api-2", None).unwrap();
    assert_eq!(on_a.rx.borrow().members["shop/limits"], 1);

    // Nothing acknowledged yet: both pods are members, neither is in sync.
    assert!(a.set_report("b", b.membership_report()));
    assert!(b.set_report("a", a.membership_report()));
    assert!(
        !a.set_report("b", b.membership_report()),
        "same report: no-op"
    );
    assert_eq!(on_a.rx.borrow().members["shop/limits"], 2);
    assert_eq!(on_b.rx.borrow().members["shop/limits"], 2);
    let view = a.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 0));
    // The metric stays per replica (so `sum` over replicas is the fleet).
    assert_eq!(a.summary().connected["shop/limits"], 1);
    assert_eq!(a.summary().peers, 1);

    // api-2 acknowledges on b; a learns it from b's next report.
    b.ack("shop", "api-2", on_b.rx.borrow().version, "epoch-1")
        .unwrap();
    let report = b.membership_report();
    assert_eq!(report.namespaces["shop"]["api-2"]["limits/uid-limits"], 10);
    a.set_report("b", report);
    let view = a.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 1));

    // A new generation on a: b's report still names generation 10, so api-2 is behind.
    a.apply_policy(input(&mk_policy("shop", "limits", "api", 20)));
    let view = a.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (2, 0));

    // A pod connected to both replicas at once (reconnect overlap) counts once.
    let dup = a.connect("shop", "api-2", None).unwrap();
    assert_eq!(on_a.rx.borrow().members["shop/limits"], 2);
    a.disconnect("shop", "api-2", dup.pod_id);
    assert_eq!(on_a.rx.borrow().members["shop/limits"], 2, "still on b");

    // b goes away: only a's own sidecars remain.
    assert!(a.remove_report("b"));
    assert!(!a.remove_report("b"));
    assert_eq!(on_a.rx.borrow().members["shop/limits"], 1);
    assert_eq!(a.summary().peers, 0);
}

/// Propagation ends at the acknowledgement that completes a change, stamped in the index then
/// (not when a status pass notices it); the Pending view names the pods that lag.
#[tokio::test]
async fn the_completing_ack_stamps_the_propagation_and_lagging_pods_are_named() {
    let mut index = index_with_pods();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    let _a = index.connect("shop", "api-1", None).unwrap();
    let _b = index.connect("shop", "api-2", None).unwrap();
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 20)));
    let v2 = index.version();
    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!(view.programmed, None);
    assert_eq!(view.lagging, ["api-1", "api-2"]);
    index.ack("shop", "api-1", v2, "epoch-1").unwrap();
    let view = index.policy_view("shop", "limits").unwrap();
    assert_eq!(
        (view.programmed, view.lagging.as_slice()),
        (None, ["api-2".to_string()].as_slice())
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    index.ack("shop", "api-2", v2, "epoch-1").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let view = index.policy_view("shop", "limits").unwrap();
    let p = view.programmed.expect("stamped by the last ack");
    assert!(p.after >= Duration::from_millis(30), "{p:?}");
    assert!(
        p.after < Duration::from_millis(200),
        "measured at the ack, not now: {p:?}"
    );
    assert!(p.ago >= Duration::from_millis(200), "{p:?}");
    assert!(view.lagging.is_empty());
    // The next change starts a new measurement.
    index.apply_policy(input(&mk_policy("shop", "limits", "api", 30)));
    assert_eq!(
        index.policy_view("shop", "limits").unwrap().programmed,
        None
    );
}

/// A policy deleted and created again under its name starts its generations over: another
/// replica's report that a pod runs generation 10 of the deleted one must not count it as
/// running generation 1 of the new one.
#[test]
fn a_report_about_a_deleted_policy_does_not_program_its_successor() {
    let mut a = index_with_pods();
    let mut b = index_with_pods();
    for index in [&mut a, &mut b] {
        index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    }
    let on_b = b.connect("shop", "api-2", None).unwrap();
    b.ack("shop", "api-2", on_b.rx.borrow().version, "epoch-1")
        .unwrap();
    a.set_report("b", b.membership_report());
    let view = a.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (1, 1));
    // Re-created on a (new UID, generation 1); b's report still describes the old object.
    a.delete_policy("shop", "limits");
    let mut recreated = input(&mk_policy("shop", "limits", "api", 1));
    recreated.uid = Some("uid-limits-2".into());
    a.apply_policy(recreated);
    let view = a.policy_view("shop", "limits").unwrap();
    assert_eq!(
        (view.sidecars_total, view.sidecars_in_sync),
        (1, 0),
        "{view:?}"
    );
    assert_eq!(view.lagging, ["api-2"]);
}

/// Sidecars without Redis are counted per policy, here and at other replicas.
#[test]
fn sidecars_without_redis_are_counted_across_replicas() {
    let mut a = index_with_pods();
    let mut b = index_with_pods();
    for index in [&mut a, &mut b] {
        index.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    }
    let _on_a = a.connect_with("shop", "api-1", None, false).unwrap();
    let _on_b = b.connect_with("shop", "api-2", None, false).unwrap();
    assert_eq!(
        a.policy_view("shop", "limits")
            .unwrap()
            .sidecars_without_redis,
        1
    );
    let report = b.membership_report();
    assert!(report.without_redis["shop"].contains("api-2"));
    a.set_report("b", report);
    let view = a.policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_without_redis), (2, 2));
    // A report from a replica that does not know of it: its sidecars have Redis.
    let mut old = b.membership_report();
    old.without_redis.clear();
    a.set_report("b", old);
    assert_eq!(
        a.policy_view("shop", "limits")
            .unwrap()
            .sidecars_without_redis,
        1
    );
}
