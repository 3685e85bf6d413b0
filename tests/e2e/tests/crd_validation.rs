//! The RateLimitPolicy CRD on a real kube-apiserver: it installs and becomes Established, every
//! example policy is accepted, malformed policies are rejected by the schema and CEL rules with
//! messages naming the field, and kubectl shows the printer columns and descriptions.

use tollgate_e2e::{ControlPlane, repo_root};

fn install_crd(cp: &ControlPlane) {
    let crd = repo_root().join("manifests/crds/tollgate.dev_ratelimitpolicies.yaml");
    let out = cp.kubectl(&["apply", "-f", crd.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "CRD apply failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("Warning"), "CRD apply warned: {stderr}");
    cp.ok(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/ratelimitpolicies.tollgate.dev",
    ]);
}

fn policy(name: &str, rules: &str) -> String {
    format!(
        r#"{{"apiVersion":"tollgate.dev/v1alpha1","kind":"RateLimitPolicy","metadata":{{"name":"{name}","namespace":"shop"}},"spec":{{"targetRef":{{"selector":{{}}}},"rules":{rules}}}}}"#
    )
}

#[test]
fn crd_installs_accepts_examples_and_rejects_mistakes_naming_the_field() {
    let cp = ControlPlane::start();
    install_crd(&cp);
    cp.ok(&["create", "namespace", "shop"]);

    // Every example is accepted as written.
    let examples = repo_root().join("manifests/examples");
    let mut applied = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.contains("kind: RateLimitPolicy") {
            continue;
        }
        let text = text.replace("namespace: default", "namespace: shop");
        cp.apply(&text)
            .unwrap_or_else(|e| panic!("{} rejected: {e}", path.display()));
        applied += 1;
    }
    assert!(applied >= 4);

    // Ten different mistakes, each rejected with a message naming the field.
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "period-unit",
            r#"[{"name":"r","limit":{"requests":1,"period":"2d"}}]"#,
            &["spec.rules[0].limit.period"],
        ),
        (
            "period-too-long",
            r#"[{"name":"r","limit":{"requests":1,"period":"25h"}}]"#,
            &["spec.rules[0].limit.period", "at most 24h"],
        ),
        (
            "burst-on-window",
            r#"[{"name":"r","limit":{"requests":1,"period":"1s","burst":5,"algorithm":"FixedWindow"}}]"#,
            &[
                "spec.rules[0].limit.burst",
                "only applies to algorithm TokenBucket",
            ],
        ),
        (
            "zero-requests",
            r#"[{"name":"r","limit":{"requests":0,"period":"1s"}}]"#,
            &["spec.rules[0].limit.requests"],
        ),
        (
            "bad-algorithm",
            r#"[{"name":"r","limit":{"requests":1,"period":"1s","algorithm":"Magic"}}]"#,
            &["spec.rules[0].limit.algorithm", "Unsupported value"],
        ),
        (
            "bad-rule-name",
            r#"[{"name":"Bad_Name","limit":{"requests":1,"period":"1s"}}]"#,
            &["spec.rules[0].name"],
        ),
        (
            "duplicate-names",
            r#"[{"name":"a","limit":{"requests":1,"period":"1s"}},{"name":"a","limit":{"requests":2,"period":"1s"}}]"#,
            &["spec.rules[1]", "Duplicate value"],
        ),
        (
            "two-path-kinds",
            r#"[{"name":"r","match":{"path":{"exact":"/a","prefix":"/b"}},"limit":{"requests":1,"period":"1s"}}]"#,
            &[
                "spec.rules[0].match.path",
                "exactly one of exact, prefix or regex",
            ],
        ),
        (
            "empty-key-part",
            r#"[{"name":"r","key":[{}],"limit":{"requests":1,"period":"1s"}}]"#,
            &["spec.rules[0].key[0]", "exactly one of header, clientIP"],
        ),
        (
            "concurrency-global",
            r#"[{"name":"r","limit":{"requests":5,"algorithm":"Concurrency"}}]"#,
            &[
                "spec.rules[0].scope",
                "must be Local for a Concurrency limit",
            ],
        ),
        (
            "too-many-hops",
            r#"[{"name":"r","key":[{"clientIP":{"trustedHops":40}}],"limit":{"requests":1,"period":"1s"}}]"#,
            &["spec.rules[0].key[0].clientIP.trustedHops"],
        ),
        ("no-rules", "[]", &["spec.rules"]),
    ];
    for (name, rules, needles) in cases {
        match cp.apply(&policy(name, rules)) {
            Ok(out) => panic!("{name} was accepted: {out}"),
            Err(err) => {
                for needle in *needles {
                    assert!(
                        err.contains(needle),
                        "{name}: expected {needle:?} in\n{err}"
                    );
                }
            }
        }
    }

    // A CIDR that is not one is refused by CEL's isCIDR, and the API server's own message names
    // the entry's index and value, as `check` and the webhook do.
    for (cidrs, needles) in [
        (
            r#"["10.0.0.1"]"#,
            [
                "spec.bypass.cidrs[0]",
                r#""10.0.0.1" is not a CIDR such as 10.0.0.0/8 (a single address needs a prefix length"#,
            ],
        ),
        (
            r#"["10.0.0.0/8","fd00::/8","10.1.2.0/33"]"#,
            [
                "spec.bypass.cidrs[2]",
                r#""10.1.2.0/33" is not a CIDR such as 10.0.0.0/8"#,
            ],
        ),
    ] {
        let bad_cidr = format!(
            r#"{{"apiVersion":"tollgate.dev/v1alpha1","kind":"RateLimitPolicy","metadata":{{"name":"cidr","namespace":"shop"}},"spec":{{"targetRef":{{"selector":{{}}}},"rules":[{{"name":"r","limit":{{"requests":1,"period":"1s"}}}}],"bypass":{{"cidrs":{cidrs}}}}}}}"#
        );
        let err = cp.apply(&bad_cidr).expect_err("bad CIDR accepted");
        for needle in needles {
            assert!(err.contains(needle), "expected {needle:?} in\n{err}");
        }
        assert!(!err.contains("cidrs[1]"), "a good entry was named:\n{err}");
    }

    // Printer columns and short name.
    let table = cp.ok(&["get", "rlp", "-n", "shop"]);
    let header = table.lines().next().unwrap_or_default();
    for col in ["NAME", "RULES", "ACCEPTED", "PROGRAMMED", "SIDECARS", "AGE"] {
        assert!(header.contains(col), "missing column {col} in {header:?}");
    }
    assert!(table.contains("shop-api-keys"), "{table}");

    // Doc comments are the schema descriptions kubectl explain prints.
    let explain = cp.ok(&["explain", "rlp.spec.rules.limit"]);
    assert!(explain.contains("Token bucket capacity"), "{explain}");
    assert!(explain.contains("algorithm"), "{explain}");
}
