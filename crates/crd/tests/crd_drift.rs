//! The checked-in CRD must be exactly what the Rust types generate.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

const CHECKED_IN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../manifests/crds/tollgate.dev_ratelimitpolicies.yaml"
);

#[test]
fn checked_in_crd_matches_the_types() {
    let generated = tollgate_crd::crd_yaml().expect("serialize CRD");
    let on_disk = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
    assert!(
        generated == on_disk,
        "manifests/crds/tollgate.dev_ratelimitpolicies.yaml is out of date; regenerate it with\n  \
         cargo run -q -p tollgate-crd --bin crdgen > manifests/crds/tollgate.dev_ratelimitpolicies.yaml"
    );
}

#[test]
fn crd_has_the_conventions_users_expect() {
    let yaml = tollgate_crd::crd_yaml().unwrap();
    for needle in [
        "shortNames:\n    - rlp",
        "x-kubernetes-validations",
        "x-kubernetes-list-type: map",
        "name: Accepted",
        "name: Programmed",
        "name: Sidecars",
        "subresources:\n      status: {}",
        "Token bucket capacity",
    ] {
        assert!(yaml.contains(needle), "CRD lacks {needle:?}");
    }
}

/// Every object node under `spec` keeps unknown fields (so the validating webhook sees a
/// misspelled field instead of the API server pruning it silently); maps, `status` and the
/// root do not.
#[test]
fn spec_objects_preserve_unknown_fields_for_the_webhook() {
    let crd = serde_json::to_value(tollgate_crd::crd()).unwrap();
    let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    const FLAG: &str = "x-kubernetes-preserve-unknown-fields";
    fn walk(node: &serde_json::Value, path: &str, objects: &mut usize) {
        if node["type"] == "object" {
            if node.get("additionalProperties").is_some() {
                assert!(
                    node.get(FLAG).is_none(),
                    "map {path} preserves unknown fields"
                );
            } else {
                assert_eq!(node[FLAG], true, "{path} prunes unknown fields");
                *objects += 1;
            }
        }
        if let Some(props) = node["properties"].as_object() {
            for (k, v) in props {
                walk(v, &format!("{path}.{k}"), objects);
            }
        }
        for key in ["items", "additionalProperties"] {
            if let Some(child) = node.get(key) {
                walk(child, &format!("{path}[]"), objects);
            }
        }
    }
    let mut objects = 0;
    walk(&root["properties"]["spec"], "spec", &mut objects);
    assert!(objects >= 15, "only {objects} object nodes under spec");
    assert!(
        root.get(FLAG).is_none(),
        "the root preserves unknown fields"
    );
    assert!(
        !serde_json::to_string(&root["properties"]["status"])
            .unwrap()
            .contains(FLAG),
        "status preserves unknown fields"
    );
    // `kubectl explain` still has the descriptions and the field list.
    let limit = &root["properties"]["spec"]["properties"]["rules"]["items"]["properties"]["limit"];
    assert!(limit["properties"]["burst"]["description"].is_string());
}
