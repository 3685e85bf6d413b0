//! The tollgate contract: the `RateLimitPolicy` API, the compiled-rule wire format shared by the
//! controller and the sidecar, and the one compile function that validates policies for all of
//! them, the answer of a sidecar's `/debug/why` as the sidecar writes it and `kubectl tollgate why`
//! reads it. Deliberately free of async runtimes and clients.

pub mod check;
pub mod compile;
pub mod compiled;
pub mod decode;
pub mod duration;
pub mod files;
pub mod policy;
pub mod stream;
pub mod why;

pub use compile::{CompileErrors, FieldError, compile, compile_parts};
pub use compiled::{CompiledPolicy, CompiledRule, WIRE_VERSION};
pub use decode::{DecodeError, Decoded, PolicyStatusView, parse_yaml, parse_yaml_documents};
pub use policy::{RateLimitPolicy, RateLimitPolicySpec, RateLimitPolicyStatus};

use kube::CustomResourceExt;

/// The CustomResourceDefinition, with schemars' unsigned formats mapped to the ones Kubernetes
/// knows (`uint64` → `int64`), so applying it prints no "unrecognized format" warnings, every
/// object under `spec` marked `x-kubernetes-preserve-unknown-fields` (see
/// [`preserve_unknown_fields`]) and no required fields under `spec` but list-map keys (see
/// [`leave_required_to_admission`]).
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    let crd = RateLimitPolicy::crd();
    let mut value = match serde_json::to_value(&crd) {
        Ok(v) => v,
        Err(_) => return crd,
    };
    fix_formats(&mut value);
    if let Some(versions) = value
        .pointer_mut("/spec/versions")
        .and_then(|v| v.as_array_mut())
    {
        for version in versions {
            if let Some(spec) = version.pointer_mut("/schema/openAPIV3Schema/properties/spec") {
                preserve_unknown_fields(spec);
                leave_required_to_admission(spec, &[]);
            }
        }
    }
    serde_json::from_value(value).unwrap_or(crd)
}

/// Marks every object node of `schema` (the flag is per node) with
/// `x-kubernetes-preserve-unknown-fields: true`, so the API server stores a misspelled field
/// instead of pruning it before admission. Pruning is silent for clients that do not ask for
/// strict field validation (Helm, most GitOps tools): `burts: 5` would become no burst at all.
/// Kept, the field reaches the validating webhook, which refuses it by name (see
/// [`decode`]). Maps (`additionalProperties`, e.g. `matchLabels`) are left alone: every key
/// is valid there.
fn preserve_unknown_fields(schema: &mut serde_json::Value) {
    let Some(node) = schema.as_object_mut() else {
        return;
    };
    let is_object = node.get("type").and_then(|t| t.as_str()) == Some("object");
    if is_object && !node.contains_key("additionalProperties") {
        node.insert(
            "x-kubernetes-preserve-unknown-fields".into(),
            serde_json::Value::Bool(true),
        );
    }
    if let Some(props) = node.get_mut("properties").and_then(|p| p.as_object_mut()) {
        props.values_mut().for_each(preserve_unknown_fields);
    }
    for key in ["items", "additionalProperties"] {
        if let Some(child) = node.get_mut(key) {
            preserve_unknown_fields(child);
        }
    }
}

/// Removes `required` from every node of `schema` except the keys of a list-map (`keys`, the
/// parent array's `x-kubernetes-list-map-keys`), which the API server needs to merge the list.
///
/// The API server checks `required` before any validating webhook runs, and it cannot see the
/// unknown fields it preserves. A misspelled required field (`limt:` for `limit:`) would get
/// only `spec.rules[0].limit: Required value` from it, never reaching the webhook that names
/// `limt` and suggests `limit`. Decoding a policy (the webhook, the controller, `check`)
/// reports a missing field as `Required value` at its path, after the unknown fields.
fn leave_required_to_admission(schema: &mut serde_json::Value, keys: &[serde_json::Value]) {
    let Some(node) = schema.as_object_mut() else {
        return;
    };
    if let Some(required) = node.get_mut("required").and_then(|r| r.as_array_mut()) {
        required.retain(|field| keys.contains(field));
        if required.is_empty() {
            node.remove("required");
        }
    }
    let list_map_keys: Vec<serde_json::Value> = node
        .get("x-kubernetes-list-map-keys")
        .and_then(|k| k.as_array())
        .cloned()
        .unwrap_or_default();
    if let Some(items) = node.get_mut("items") {
        leave_required_to_admission(items, &list_map_keys);
    }
    if let Some(props) = node.get_mut("properties").and_then(|p| p.as_object_mut()) {
        props
            .values_mut()
            .for_each(|p| leave_required_to_admission(p, &[]));
    }
    if let Some(child) = node.get_mut("additionalProperties") {
        leave_required_to_admission(child, &[]);
    }
}

fn fix_formats(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            if let Some(serde_json::Value::String(f)) = map.get_mut("format") {
                match f.as_str() {
                    "uint64" => *f = "int64".to_string(),
                    "uint32" | "uint16" | "uint8" => *f = "int32".to_string(),
                    _ => {}
                }
            }
            map.values_mut().for_each(fix_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(fix_formats),
        _ => {}
    }
}

/// The CustomResourceDefinition as YAML, exactly as checked in under `manifests/crds/`.
pub fn crd_yaml() -> Result<String, serde_norway::Error> {
    let body = serde_norway::to_string(&crd())?;
    Ok(format!(
        "# Generated by `cargo run -p tollgate-crd --bin crdgen`; do not edit.\n{body}"
    ))
}
