//! Misspelled RateLimitPolicy fields on a real kube-apiserver, with the real
//! `tollgate-controller` binary serving the validating webhook as the chart registers it:
//!
//! - the CRD keeps unknown `spec` fields instead of pruning them (`x-kubernetes-preserve-unknown-
//!   fields`), so they reach the webhook, and `kubectl explain` still lists the fields;
//! - the controller's watch stays lenient: a policy stored with `burts:` while no webhook ran is
//!   `Accepted=False` naming the field, and the other policies keep working;
//! - the webhook denies unknown fields naming their path, whatever field validation the client
//!   asks for: `Ignore` and `Warn` (what Helm and most GitOps tools send, where the API server
//!   would otherwise drop the field silently), `Strict`, and a raw POST without the parameter;
//! - a misspelled *required* field (`limt:` for `limit:`) is named with its suggestion too: the
//!   schema leaves `required` to admission, because the API server checks it before any webhook
//!   runs and would answer only `spec.rules[0].limit: Required value`.
//!
//! Needs the binaries `cargo build -p tollgate-controller` builds (see webhook_and_chart.rs).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tollgate_e2e::{
    ControlPlane, free_port, install_crd, start_controller, text, wait, workspace_bin,
};

fn policy(name: &str, limit: Value) -> Value {
    json!({
        "apiVersion": "tollgate.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"targetRef": {"selector": {}}, "rules": [
            {"name": "r", "limit": limit, "scope": "Local"}
        ]}
    })
}

/// `kubectl <args> -f -` with `obj` on stdin; Ok(stdout) or Err(stderr).
fn kubectl_obj(cp: &ControlPlane, args: &[&str], obj: &Value) -> Result<String, String> {
    let mut a = args.to_vec();
    a.extend(["-f", "-"]);
    let out = cp.kubectl_stdin(&a, Some(&obj.to_string()));
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        Err(text(&out.stderr))
    }
}

fn accepted(cp: &ControlPlane, name: &str) -> (String, String) {
    let out = cp.kubectl(&["get", "rlp", name, "-n", "shop", "-o", "json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let cond = v["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"))
        .cloned()
        .unwrap_or_default();
    (
        cond["status"].as_str().unwrap_or_default().to_string(),
        cond["message"].as_str().unwrap_or_default().to_string(),
    )
}

fn base64(bytes: &[u8]) -> String {
    let mut child = Command::new("base64")
        .arg("-w0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run base64");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), bytes).unwrap();
    text(&child.wait_with_output().unwrap().stdout)
}

#[test]
fn unknown_fields_are_refused_even_without_strict_field_validation() {
    let cp = ControlPlane::start();
    install_crd(&cp);
    cp.ok(&["create", "namespace", "shop"]);
    const TYPO: &str = "spec.rules[0].limit.burts: unknown field (did you mean `burst`?)";
    const LIMT: &str = "spec.rules[0].limt: unknown field (did you mean `limit`?)";
    const NO_LIMIT: &str = "spec.rules[0].limit: Required value";

    // --- No webhook yet: the API server stores the misspelled field as written (before this
    // fix it pruned it: `burts` vanished and the policy had no burst, with no warning).
    let stored = policy("stored", json!({"requests": 5, "period": "1s", "burts": 5}));
    kubectl_obj(&cp, &["create", "--validate=false"], &stored).unwrap();
    let got: Value =
        serde_json::from_str(&cp.ok(&["get", "rlp", "stored", "-n", "shop", "-o", "json"]))
            .unwrap();
    assert_eq!(
        got["spec"]["rules"][0]["limit"]["burts"], 5,
        "pruned: {got}"
    );
    let good = policy("good", json!({"requests": 5, "period": "1s"}));
    kubectl_obj(&cp, &["create"], &good).unwrap();
    // `limt:` passes the schema (strict field validation, kubectl's default) and is kept, so
    // admission, or the controller after it, can name it.
    let mut limt = policy("limt", json!(null));
    let rule = limt["spec"]["rules"][0].as_object_mut().unwrap();
    rule.remove("limit");
    rule.insert("limt".into(), json!({"requests": 5, "period": "1s"}));
    let mut stored_limt = limt.clone();
    stored_limt["metadata"]["name"] = json!("stored-limt");
    kubectl_obj(&cp, &["create", "--validate=strict"], &stored_limt)
        .expect("the schema refused a policy only admission can explain");
    // Schema checks and `kubectl explain` are unchanged.
    let err = kubectl_obj(
        &cp,
        &["create", "--dry-run=server"],
        &policy("zero", json!({"requests": 0, "period": "1s"})),
    )
    .unwrap_err();
    assert!(err.contains("spec.rules[0].limit.requests"), "{err}");
    let explain = cp.ok(&["explain", "rlp.spec.rules.limit"]);
    assert!(
        explain.contains("burst") && explain.contains("Token bucket capacity"),
        "{explain}"
    );

    // --- The controller with the test PKI's webhook certificate.
    let pki = PathBuf::from(&cp.env["K8S_CA_FILE"])
        .parent()
        .unwrap()
        .to_path_buf();
    let certs = tempfile::tempdir().unwrap();
    std::fs::copy(pki.join("webhook.crt"), certs.path().join("tls.crt")).unwrap();
    std::fs::copy(pki.join("webhook.key"), certs.path().join("tls.key")).unwrap();
    let ca = std::fs::read(pki.join("ca.crt")).unwrap();
    let hook_port = free_port();
    let listen = format!("--webhook-listen=127.0.0.1:{hook_port}");
    let cert_dir = format!("--webhook-cert-dir={}", certs.path().display());
    let ctl = start_controller(
        &cp,
        "controller",
        free_port(),
        &[&listen, &cert_dir, "--leader-election=false"],
    );

    // The stored misspelling does not break the watch: it is not Accepted, naming the field;
    // the good policy is.
    wait("status on both policies", Duration::from_secs(60), || {
        accepted(&cp, "stored").0 == "False" && accepted(&cp, "good").0 == "True"
    });
    let (_, message) = accepted(&cp, "stored");
    assert!(message.contains(TYPO), "{message}");
    wait(
        "status on the misspelled limit",
        Duration::from_secs(30),
        || accepted(&cp, "stored-limt").0 == "False",
    );
    let (_, message) = accepted(&cp, "stored-limt");
    assert!(
        message.contains(LIMT) && message.contains(NO_LIMIT),
        "{message}"
    );
    // `kubectl tollgate status` still lists every policy, the undecodable one with its reason.
    let out = Command::new(workspace_bin("kubectl-tollgate"))
        .args(["status", "-n", "shop", "-o", "wide"])
        .env("KUBECONFIG", cp.kubeconfig())
        .output()
        .expect("run kubectl-tollgate");
    let table = text(&out.stdout);
    assert!(out.status.success(), "{table}{}", text(&out.stderr));
    for name in ["good", "stored", "stored-limt"] {
        assert!(
            table.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} missing:\n{table}"
        );
    }
    assert!(table.contains("limt"), "{table}");

    // --- The validating webhook as the chart registers it (failurePolicy Fail by default).
    let hook = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "tollgate-policy-validator-e2e"},
        "webhooks": [{
            "name": "ratelimitpolicy.validate.tollgate.dev",
            "admissionReviewVersions": ["v1"],
            "clientConfig": {
                "url": format!("https://127.0.0.1:{hook_port}/validate-ratelimitpolicy"),
                "caBundle": base64(&ca),
            },
            "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": ["tollgate.dev"],
                "apiVersions": ["v1alpha1"], "resources": ["ratelimitpolicies"], "scope": "Namespaced"}],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 10
        }]
    });
    kubectl_obj(&cp, &["create"], &hook).unwrap();
    let typo = policy("typo", json!({"requests": 5, "period": "1s", "burts": 5}));
    wait("the validating webhook", Duration::from_secs(30), || {
        kubectl_obj(
            &cp,
            &["create", "--dry-run=server", "--validate=false"],
            &typo,
        )
        .is_err_and(|e| e.contains("denied the request"))
    });

    // Every field validation mode gets the same answer: denied, naming the field.
    for validate in ["--validate=false", "--validate=warn", "--validate=strict"] {
        let err = kubectl_obj(&cp, &["create", validate], &typo).unwrap_err();
        assert!(err.contains("denied the request"), "{validate}: {err}");
        assert!(err.contains(TYPO), "{validate}: {err}");
    }
    // A raw POST without `fieldValidation`, as Helm sends it.
    let err = kubectl_obj(
        &cp,
        &[
            "create",
            "--raw",
            "/apis/tollgate.dev/v1alpha1/namespaces/shop/ratelimitpolicies",
        ],
        &typo,
    )
    .unwrap_err();
    assert!(err.contains(TYPO), "raw POST: {err}");
    // An update that adds a misspelled field to a good policy.
    let mut edited = good.clone();
    edited["spec"]["failurMode"] = json!("Closed");
    let err = kubectl_obj(&cp, &["apply", "--validate=false"], &edited).unwrap_err();
    assert!(
        err.contains("spec.failurMode: unknown field (did you mean `failureMode`?)"),
        "update: {err}"
    );
    let out = cp.kubectl(&["get", "rlp", "typo", "-n", "shop"]);
    assert!(!out.status.success(), "a misspelled policy was stored");

    // `kubectl apply` as a user types it (strict field validation): the misspelled required
    // field is named, with its suggestion, then the missing one.
    let err = kubectl_obj(&cp, &["apply"], &limt).unwrap_err();
    assert!(err.contains("denied the request"), "{err}");
    assert!(err.contains(LIMT), "{err}");
    assert!(err.contains(NO_LIMIT), "{err}");
    assert!(
        err.find(LIMT) < err.find(NO_LIMIT),
        "the misspelling should come first: {err}"
    );

    // Correctly spelled, the same policy is admitted.
    let fixed = policy("typo", json!({"requests": 5, "period": "1s", "burst": 5}));
    kubectl_obj(&cp, &["create", "--validate=false"], &fixed).unwrap();
    drop(ctl);
}
