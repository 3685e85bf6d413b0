//! plugins/krew/tollgate.yaml is a krew plugin manifest that installs this crate's binary on
//! every platform a release builds for.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::collections::BTreeSet;

fn manifest() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../plugins/krew/tollgate.yaml"
    );
    let text = std::fs::read_to_string(path).expect("read plugins/krew/tollgate.yaml");
    serde_norway::from_str(&text).expect("plugins/krew/tollgate.yaml is YAML")
}

#[test]
fn the_krew_manifest_installs_kubectl_tollgate_on_every_release_platform() {
    let m = manifest();
    assert_eq!(
        m["apiVersion"],
        "krew.googlecontainertools.github.com/v1alpha2"
    );
    assert_eq!(m["kind"], "Plugin");
    // krew names the command after metadata.name: `kubectl tollgate`.
    assert_eq!(m["metadata"]["name"], "tollgate");
    let spec = &m["spec"];
    assert_eq!(
        spec["version"],
        format!("v{}", env!("CARGO_PKG_VERSION")),
        "spec.version follows the crate's version"
    );
    for field in ["shortDescription", "description", "homepage"] {
        assert!(
            spec[field].as_str().is_some_and(|s| !s.trim().is_empty()),
            "spec.{field} is missing"
        );
    }
    let platforms = spec["platforms"].as_array().expect("spec.platforms");
    let mut seen = BTreeSet::new();
    for p in platforms {
        let labels = &p["selector"]["matchLabels"];
        let (os, arch) = (
            labels["os"].as_str().expect("os label"),
            labels["arch"].as_str().expect("arch label"),
        );
        assert!(
            seen.insert((os.to_string(), arch.to_string())),
            "{os}/{arch} twice"
        );
        assert_eq!(p["bin"], "kubectl-tollgate", "{os}/{arch}: bin");
        let files = p["files"].as_array().expect("files");
        assert!(
            files.iter().any(|f| f["from"] == "kubectl-tollgate"),
            "{os}/{arch}: the archive's binary is not installed"
        );
        let uri = p["uri"].as_str().expect("uri");
        assert!(
            uri.starts_with("https://") && uri.contains(&format!("{os}-{arch}")),
            "{os}/{arch}: uri {uri}"
        );
        let sha = p["sha256"].as_str().expect("sha256 (a string)");
        assert!(
            sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()),
            "{os}/{arch}: sha256 {sha:?} is not 64 hex digits"
        );
    }
    let want: BTreeSet<(String, String)> = ["linux", "darwin"]
        .iter()
        .flat_map(|os| ["amd64", "arm64"].map(|a| (os.to_string(), a.to_string())))
        .collect();
    assert_eq!(seen, want);
}
