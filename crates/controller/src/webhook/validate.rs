//! Validating admission for RateLimitPolicy: everything the CRD's schema and CEL rules cannot
//! check (regexes that do not compile, cross-field rules) runs through the same
//! `tollgate_crd::compile` the controller and the sidecar use, and every error is reported
//! with its field path.
//!
//! Unknown fields under `spec` are denied too (`spec.rules[0].limit.burts: unknown field (did
//! you mean `burst`?)`). The CRD marks every object under `spec` with
//! `x-kubernetes-preserve-unknown-fields`, so the API server hands them to this webhook instead
//! of pruning them; without that, a client that does not ask for strict field validation (Helm,
//! GitOps tools) would get a different policy than written and no warning.

use kube::core::admission::Operation;
use serde_json::Value;
use tollgate_crd::{FieldError, compile_parts};

/// The result of validating one policy.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// The message lists every error, `field.path: message`, separated by `; `.
    Deny(String),
}

/// Validates a RateLimitPolicy admission. `object`/`old_object` are the raw JSON objects.
pub fn validate_policy(
    operation: &Operation,
    namespace: Option<&str>,
    name: &str,
    object: Option<&Value>,
    old_object: Option<&Value>,
) -> Verdict {
    match operation {
        Operation::Create | Operation::Update => {}
        // Deleting or connecting is never blocked.
        _ => return Verdict::Allow,
    }
    let Some(object) = object else {
        return Verdict::Allow;
    };
    // An update that leaves the spec alone (labels, annotations, finalizers) is allowed even
    // when the stored spec predates this webhook and is invalid, so it can still be cleaned up.
    if matches!(operation, Operation::Update)
        && old_object.and_then(|o| o.get("spec")).is_some()
        && old_object.and_then(|o| o.get("spec")) == object.get("spec")
    {
        return Verdict::Allow;
    }
    let decoded = match tollgate_crd::decode::from_json(object.clone()) {
        Ok(d) => d.only_spec(),
        Err(e) => return Verdict::Deny(format!("spec: cannot be decoded: {e}")),
    };
    let mut errors: Vec<FieldError> = decoded.unknown_fields;
    let policy = decoded.policy;
    let name = policy
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| name.to_string());
    let namespace = policy
        .metadata
        .namespace
        .clone()
        .or_else(|| namespace.map(str::to_string))
        .unwrap_or_else(|| "default".to_string());
    let generation = policy.metadata.generation.unwrap_or(0);
    if let Err(more) = compile_parts(&namespace, &name, generation, &policy.spec) {
        errors.extend(more.0);
    }
    if errors.is_empty() {
        Verdict::Allow
    } else {
        let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
        Verdict::Deny(lines.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(path: Value) -> Value {
        json!({"apiVersion":"tollgate.dev/v1alpha1","kind":"RateLimitPolicy",
        "metadata":{"name":"p","namespace":"shop"},
        "spec":{"targetRef":{"selector":{}},"rules":[
            {"name":"r","match":{"path":path},"limit":{"requests":1,"period":"1s"}},
            {"name":"s","match":{"headers":[{"name":"x","regex":"(b"}]},"limit":{"requests":1,"period":"1s"}}
        ]}})
    }

    #[test]
    fn denies_with_every_error_and_its_field() {
        let bad = policy(json!({"regex": "(unclosed"}));
        let Verdict::Deny(msg) =
            validate_policy(&Operation::Create, Some("shop"), "p", Some(&bad), None)
        else {
            panic!("allowed");
        };
        assert!(msg.contains("spec.rules[0].match.path.regex"), "{msg}");
        assert!(
            msg.contains("spec.rules[1].match.headers[0].regex"),
            "{msg}"
        );
    }

    #[test]
    fn denies_unknown_spec_fields_with_their_path_and_a_suggestion() {
        let mut bad = policy(json!({"prefix": "/a"}));
        bad["spec"]["rules"].as_array_mut().unwrap().pop();
        bad["spec"]["failurMode"] = json!("Closed");
        bad["spec"]["rules"][0]["limit"]["burts"] = json!(5);
        let Verdict::Deny(msg) =
            validate_policy(&Operation::Create, Some("shop"), "p", Some(&bad), None)
        else {
            panic!("allowed");
        };
        assert_eq!(
            msg,
            "spec.failurMode: unknown field (did you mean `failureMode`?); \
             spec.rules[0].limit.burts: unknown field (did you mean `burst`?)"
        );
        // An update that adds one is denied; metadata fields this controller does not know
        // (a newer API server's) and status fields are not its business.
        let mut good = bad.clone();
        good["spec"].as_object_mut().unwrap().remove("failurMode");
        good["spec"]["rules"][0]["limit"]
            .as_object_mut()
            .unwrap()
            .remove("burts");
        good["metadata"]["futureMetaField"] = json!("x");
        good["status"] = json!({"ruleCount": 1, "futureStatusField": true});
        assert_eq!(
            validate_policy(&Operation::Create, Some("shop"), "p", Some(&good), None),
            Verdict::Allow
        );
        assert!(matches!(
            validate_policy(&Operation::Update, Some("shop"), "p", Some(&bad), Some(&good)),
            Verdict::Deny(m) if m.contains("spec.rules[0].limit.burts")
        ));
    }

    #[test]
    fn allows_good_policies_deletes_and_metadata_only_updates() {
        let good = policy(json!({"prefix": "/a"}));
        let mut good = good;
        good["spec"]["rules"].as_array_mut().unwrap().pop();
        assert_eq!(
            validate_policy(&Operation::Create, Some("shop"), "p", Some(&good), None),
            Verdict::Allow
        );
        let bad = policy(json!({"regex": "("}));
        assert_eq!(
            validate_policy(&Operation::Delete, Some("shop"), "p", None, Some(&bad)),
            Verdict::Allow
        );
        let mut relabelled = bad.clone();
        relabelled["metadata"]["labels"] = json!({"a": "b"});
        assert_eq!(
            validate_policy(
                &Operation::Update,
                Some("shop"),
                "p",
                Some(&relabelled),
                Some(&bad)
            ),
            Verdict::Allow
        );
        let mut changed = bad.clone();
        changed["spec"]["failureMode"] = json!("Closed");
        assert!(matches!(
            validate_policy(
                &Operation::Update,
                Some("shop"),
                "p",
                Some(&changed),
                Some(&bad)
            ),
            Verdict::Deny(_)
        ));
    }
}
