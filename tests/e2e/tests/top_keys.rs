//! Fleet-wide top limited keys on real processes: kube-apiserver + etcd, two controller
//! replicas, three sidecars (two streaming from one replica, one from the other). Clients
//! are rejected in known numbers, among a flood of one-off keys that overflows the sidecars'
//! 64-counter sketches; the policy's `status.topLimitedKeys`, written by the leader, must list
//! the heavy keys with counts within the sketches' documented error, the pods that rejected
//! them, and the same stable key hashes the sidecars' `/debug/top-keys` shows.

use std::collections::BTreeMap;
use std::time::Duration;

use tollgate_e2e::{
    ControlPlane, Sidecar, app, free_port, install_crd_and_shop, pod_with_token, serial,
    shop_policy, start_controller, wait,
};

/// Rejections each pod answers per key: `(key, [per pod])`, limit 2 a minute per pod.
const LIMIT: u64 = 2;
const PLAN: [(&str, [u64; 3]); 3] = [
    ("k-heavy", [40, 40, 40]),
    ("k-mid", [25, 25, 0]),
    ("k-low", [0, 0, 12]),
];
/// One-off keys, each rejected once, all on the first pod.
const FLOOD: usize = 150;

fn top_limited_keys(cp: &ControlPlane) -> serde_json::Value {
    let out = cp.kubectl(&[
        "get",
        "rlp",
        "-n",
        "shop",
        "shop-api-keys",
        "-o",
        "jsonpath={.status.topLimitedKeys}",
    ]);
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

#[test]
fn the_fleets_most_limited_keys_reach_the_policy_status() {
    let _serial = serial();
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);
    // What the chart creates: an empty Secret the controller fills, so every sidecar hashes
    // a key to the same identity.
    cp.ok(&[
        "create",
        "secret",
        "generic",
        "tollgate-key-hash",
        "-n",
        "default",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<_> = (0..3)
        .map(|i| pod_with_token(&cp, &format!("p{i}"), dir.path()))
        .collect();

    let ports = [free_port(), free_port()];
    let replica = |identity: &str, port: u16| {
        start_controller(
            &cp,
            &format!("tollgate-controller {identity}"),
            port,
            &[
                "--identity",
                identity,
                "--lease-duration",
                "4s",
                "--heartbeat-interval",
                "1s",
                "--top-keys-interval",
                "1s",
                "--top-keys-window",
                "2m",
            ],
        )
    };
    let _a = replica("a", ports[0]);
    let _b = replica("b", ports[1]);
    cp.apply(&shop_policy(LIMIT).replace("limit: {", "scope: Local\n    limit: {"))
        .expect("apply policy");

    let app_port = app();
    let sidecars: Vec<Sidecar> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| {
            let sidecar = Sidecar::for_pod(
                &format!("p{i}"),
                app_port,
                ports[usize::from(i == 2)],
                token,
                &["--top-keys-report-interval", "1s", "--audit-raw-keys"],
            );
            sidecar.wait_ready(&format!("sidecar p{i} ready"), Duration::from_secs(20));
            sidecar
        })
        .collect();

    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let send = |pod: usize, key: &str| -> u16 {
        client
            .get(format!("http://127.0.0.1:{}/", sidecars[pod].listen))
            .header("x-api-key", key)
            .send()
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    // The planned keys round by round, the flood in the middle.
    let mut rejected: BTreeMap<(&str, usize), u64> = BTreeMap::new();
    let rounds = PLAN.iter().flat_map(|(_, n)| n).max().copied().unwrap_or(0) + LIMIT;
    for round in 0..rounds {
        for (key, per_pod) in PLAN {
            for (pod, n) in per_pod.iter().enumerate() {
                if *n > 0 && round < n + LIMIT && send(pod, key) == 429 {
                    *rejected.entry((key, pod)).or_default() += 1;
                }
            }
        }
        if round == rounds / 2 {
            // All at once: more distinct keys in one report interval than a sketch holds.
            for j in 0..FLOOD {
                for _ in 0..=LIMIT {
                    send(0, &format!("flood-{j}"));
                }
            }
        }
    }
    for (key, per_pod) in PLAN {
        for (pod, n) in per_pod.iter().enumerate() {
            assert_eq!(
                rejected.get(&(key, pod)).copied().unwrap_or(0),
                *n,
                "{key} on p{pod}: the local limit should reject exactly the excess"
            );
        }
    }

    // The key hashes the sidecars show for the planned keys: one identity in every pod.
    let mut hashes: BTreeMap<String, String> = BTreeMap::new();
    for s in &sidecars {
        let top: serde_json::Value = client
            .get(format!("http://127.0.0.1:{}/debug/top-keys", s.admin))
            .send()
            .unwrap()
            .json()
            .unwrap();
        for e in top["topKeys"].as_array().unwrap() {
            let key = e["key"].as_str().unwrap_or_default().to_string();
            let hash = e["keyHash"].as_str().unwrap().to_string();
            if let Some(seen) = hashes.insert(key.clone(), hash.clone()) {
                assert_eq!(seen, hash, "key {key} has two identities across pods");
            }
        }
    }

    let total = |key: &str| -> u64 {
        PLAN.iter()
            .find(|(k, _)| *k == key)
            .map(|(_, n)| n.iter().sum())
            .unwrap_or(0)
    };
    let mut last = serde_json::Value::Null;
    wait(
        "status.topLimitedKeys to count every planned rejection",
        Duration::from_secs(30),
        || {
            last = top_limited_keys(&cp);
            last["keys"].as_array().is_some_and(|keys| {
                PLAN.iter().all(|(key, _)| {
                    keys.iter().any(|e| {
                        Some(e["keyHash"].as_str().unwrap_or_default())
                            == hashes.get(*key).map(String::as_str)
                            && e["rejected"].as_u64().unwrap_or(0) >= total(key)
                    })
                })
            })
        },
    );
    eprintln!(
        "status.topLimitedKeys:\n{}",
        serde_json::to_string_pretty(&last).unwrap()
    );
    assert_eq!(last["window"], "2m");
    let keys = last["keys"].as_array().unwrap();
    assert!(keys.len() <= 10, "at most ten keys: {}", keys.len());
    for (rank, (key, per_pod)) in PLAN.iter().enumerate() {
        let e = &keys[rank];
        assert_eq!(
            e["keyHash"].as_str(),
            hashes.get(*key).map(String::as_str),
            "rank {rank} should be {key}: {last:#}"
        );
        assert_eq!(e["rule"], "per-api-key");
        let (count, over) = (
            e["rejected"].as_u64().unwrap(),
            e["maxOvercount"].as_u64().unwrap(),
        );
        // Space-Saving: never under the truth, over it by at most the recorded over-count.
        let sent = total(key);
        assert!(
            count >= sent && count - over <= sent,
            "{key}: {count} (over-count {over}) for {sent} sent"
        );
        let pods: Vec<String> = per_pod
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, _)| format!("p{i}"))
            .collect();
        assert_eq!(e["pods"], serde_json::json!(pods), "{key}");
        assert_eq!(e["podCount"].as_u64(), Some(pods.len() as u64), "{key}");
    }

    // Deleted and created again under its name: a new object that rejected nobody yet. The
    // counts of the deleted one (still in the window) must not show up in its status.
    cp.ok(&["delete", "rlp", "-n", "shop", "shop-api-keys"]);
    cp.apply(&shop_policy(LIMIT).replace("limit: {", "scope: Local\n    limit: {"))
        .expect("re-create policy");
    wait(
        "the re-created policy programmed on all 3 sidecars",
        Duration::from_secs(30),
        || {
            cp.ok(&[
                "get",
                "rlp",
                "-n",
                "shop",
                "shop-api-keys",
                "-o",
                "jsonpath={.status.sidecarsInSync}",
            ])
            .trim()
                == "3"
        },
    );
    // Several refreshes (1 s each) and status passes later, still nothing.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        top_limited_keys(&cp),
        serde_json::Value::Null,
        "a re-created policy starts without the deleted one's top keys"
    );
}
