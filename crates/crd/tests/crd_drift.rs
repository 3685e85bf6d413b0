//! The checked-in CRD must be exactly what the Rust types generate.

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
