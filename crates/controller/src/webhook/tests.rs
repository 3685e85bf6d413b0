use std::time::SystemTime;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::certs::{Bundle, Renewal};
use super::*;

fn review(path: &str, kind: (&str, &str, &str), operation: &str, object: Value) -> Vec<u8> {
    let (group, version, k) = kind;
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("uid-{path}"),
            "kind": {"group": group, "version": version, "kind": k},
            "resource": {"group": group, "version": version, "resource": format!("{}s", k.to_lowercase())},
            "name": object["metadata"]["name"].as_str().unwrap_or(""),
            "namespace": "shop",
            "operation": operation,
            "userInfo": {"username": "admin"},
            "object": object,
            "oldObject": null,
            "dryRun": false,
        }
    }))
    .unwrap()
}

fn pod(annotations: Value) -> Value {
    json!({"apiVersion":"v1","kind":"Pod",
        "metadata":{"name":"api-1","namespace":"shop","annotations":annotations},
        "spec":{"containers":[{"name":"app","image":"app:1","ports":[{"containerPort":8080,"protocol":"TCP"}]}]}})
}

fn handler() -> Handler {
    Handler::new(InjectConfig::example(), WebhookMetrics::default())
}

fn response(r: AdmissionReview<DynamicObject>) -> Value {
    serde_json::to_value(r).unwrap()["response"].clone()
}

/// The JSON patch operations of a response. kube-core sends the patch bytes as a JSON array of
/// numbers (Go decodes []byte from both).
fn patch_ops(r: &Value) -> Vec<Value> {
    let bytes: Vec<u8> = serde_json::from_value(r["patch"].clone()).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

/// A review of a plain pod creation on the namespace-opt-in path.
fn namespace_review() -> Vec<u8> {
    review(
        PATH_INJECT_NAMESPACE,
        ("", "v1", "Pod"),
        "CREATE",
        pod(json!({})),
    )
}

#[test]
fn namespace_path_injects_and_pod_path_needs_the_pod_opt_in() {
    let h = handler();
    let body = namespace_review();
    let r = response(h.review(PATH_INJECT_NAMESPACE, &body).unwrap());
    assert_eq!(r["allowed"], true);
    assert_eq!(r["uid"], "uid-/inject/namespace");
    assert_eq!(r["patchType"], "JSONPatch");
    let ops = patch_ops(&r);
    assert!(
        ops.iter().any(|op| op["path"] == "/spec/initContainers"),
        "{ops:?}"
    );

    let r = response(h.review(PATH_INJECT_POD, &body).unwrap());
    assert_eq!(r["allowed"], true);
    assert!(r.get("patch").is_none(), "{r}");
    assert!(r.get("warnings").is_none(), "{r}");

    let body = review(
        PATH_INJECT_POD,
        ("", "v1", "Pod"),
        "CREATE",
        pod(json!({"tollgate.dev/inject": "enabled"})),
    );
    let r = response(h.review(PATH_INJECT_POD, &body).unwrap());
    assert!(r["patch"].is_array());
    assert_eq!(h.metrics.count("inject", "injected"), 2);
    assert_eq!(h.metrics.count("inject", "not_opted_in"), 1);
}

/// The sidecar env of the patch `h` makes for a namespace-injected pod.
fn injected_env(h: &Handler) -> Vec<Value> {
    let r = response(
        h.review(PATH_INJECT_NAMESPACE, &namespace_review())
            .unwrap(),
    );
    let ops = patch_ops(&r);
    let init = ops
        .iter()
        .find(|op| op["path"] == "/spec/initContainers")
        .expect("init containers added");
    init["value"][0]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn an_https_controller_url_gives_sidecars_the_current_ca() {
    let dir = std::env::temp_dir().join(format!("tollgate-ca-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.crt");
    let _ = std::fs::remove_file(&ca);
    let mut cfg = InjectConfig::example();
    cfg.controller_url = "https://tollgate-controller.tollgate-system.svc:8443".into();
    let h = Handler::new(cfg, WebhookMetrics::default()).with_controller_ca_file(ca.clone());
    let ca_env = |env: &[Value]| {
        env.iter()
            .find(|e| e["name"] == "TOLLGATE_CONTROLLER_CA")
            .map(|e| e["value"].as_str().unwrap_or_default().to_string())
    };

    // No CA yet (self-signed certificate still being issued): injected all the same, without.
    assert_eq!(ca_env(&injected_env(&h)), None);

    let first = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    std::fs::write(&ca, first).unwrap();
    assert_eq!(ca_env(&injected_env(&h)).as_deref(), Some(first));

    // A renewed CA bundle reaches pods created from then on, without a restart.
    let renewed = format!("{first}-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n");
    std::fs::write(&ca, &renewed).unwrap();
    assert_eq!(ca_env(&injected_env(&h)), Some(renewed));

    // Plain http: no CA, whatever the directory holds.
    assert_eq!(ca_env(&injected_env(&handler())), None);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ports_the_sidecar_does_not_cover_are_named_in_a_warning() {
    let h = handler();
    let mut p = pod(json!({}));
    p["spec"]["containers"][0]["ports"] =
        json!([{"name":"http","containerPort":8080},{"name":"metrics","containerPort":9090}]);
    let body = review(PATH_INJECT_NAMESPACE, ("", "v1", "Pod"), "CREATE", p);
    let r = response(h.review(PATH_INJECT_NAMESPACE, &body).unwrap());
    assert!(r["patch"].is_array(), "{r}");
    let w = r["warnings"][0].as_str().unwrap();
    assert!(
        w.contains("only port 8080") && w.contains("metrics:9090"),
        "{w}"
    );
    assert!(
        patch_ops(&r).iter().any(|op| op["path"]
            == "/metadata/annotations/tollgate.dev~1unprotected-ports"
            && op["value"] == "metrics:9090"),
        "{r}"
    );
}

#[test]
fn a_namespace_that_requires_the_sidecar_denies_pods_that_cannot_get_it() {
    let h = handler();
    // Injected as usual.
    let body = review(
        PATH_INJECT_REQUIRED,
        ("", "v1", "Pod"),
        "CREATE",
        pod(json!({})),
    );
    let r = response(h.review(PATH_INJECT_REQUIRED, &body).unwrap());
    assert_eq!(r["allowed"], true);
    assert!(r["patch"].is_array(), "{r}");
    // No port to forward to: denied with the reason, where the other paths admit it bare.
    let mut p = pod(json!({}));
    p["spec"]["containers"][0]["ports"] = json!([]);
    let body = review(PATH_INJECT_REQUIRED, ("", "v1", "Pod"), "CREATE", p.clone());
    let r = response(h.review(PATH_INJECT_REQUIRED, &body).unwrap());
    assert_eq!(r["allowed"], false, "{r}");
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("requires the rate-limiting sidecar") && msg.contains("no container port"),
        "{msg}"
    );
    let body = review(PATH_INJECT_NAMESPACE, ("", "v1", "Pod"), "CREATE", p);
    let r = response(h.review(PATH_INJECT_NAMESPACE, &body).unwrap());
    assert_eq!(r["allowed"], true, "{r}");
    // An explicit opt-out is still admitted.
    let body = review(
        PATH_INJECT_REQUIRED,
        ("", "v1", "Pod"),
        "CREATE",
        pod(json!({"tollgate.dev/inject": "disabled"})),
    );
    let r = response(h.review(PATH_INJECT_REQUIRED, &body).unwrap());
    assert_eq!(r["allowed"], true, "{r}");
    assert!(r.get("patch").is_none(), "{r}");
    assert_eq!(h.metrics.count("inject", "denied"), 1);
}

#[test]
fn never_denies_pods_and_warns_when_asked_but_impossible() {
    let h = handler();
    let mut p = pod(json!({"tollgate.dev/inject": "enabled", "tollgate.dev/rewrite-port": "web"}));
    p["spec"]["containers"][0]["ports"] = json!([]);
    let body = review(PATH_INJECT_POD, ("", "v1", "Pod"), "CREATE", p);
    let r = response(h.review(PATH_INJECT_POD, &body).unwrap());
    assert_eq!(r["allowed"], true);
    assert!(r.get("patch").is_none());
    let w = r["warnings"][0].as_str().unwrap();
    assert!(w.starts_with("tollgate: sidecar not injected:"), "{w}");

    // Updates and other kinds pass untouched.
    let body = review(
        PATH_INJECT_NAMESPACE,
        ("", "v1", "Pod"),
        "UPDATE",
        pod(json!({})),
    );
    let r = response(h.review(PATH_INJECT_NAMESPACE, &body).unwrap());
    assert_eq!(r["allowed"], true);
    assert!(r.get("patch").is_none());

    // Garbage is answered (not a 500) and counted.
    let r = response(h.review(PATH_INJECT_NAMESPACE, b"{").unwrap());
    assert_eq!(r["allowed"], false);
    assert!(h.review("/elsewhere", b"{}").is_none());
}

#[test]
fn validating_path_denies_naming_every_field() {
    let h = handler();
    let policy = json!({"apiVersion":"tollgate.dev/v1alpha1","kind":"RateLimitPolicy",
        "metadata":{"name":"p","namespace":"shop","generation":1},
        "spec":{"targetRef":{"selector":{}},"rules":[
            {"name":"r","match":{"path":{"regex":"(oops"}},"limit":{"requests":1,"period":"1s"}}]}});
    let body = review(
        PATH_VALIDATE_POLICY,
        ("tollgate.dev", "v1alpha1", "RateLimitPolicy"),
        "CREATE",
        policy,
    );
    let r = response(h.review(PATH_VALIDATE_POLICY, &body).unwrap());
    assert_eq!(r["allowed"], false);
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(msg.contains("spec.rules[0].match.path.regex"), "{msg}");
    assert_eq!(h.metrics.count("validate", "denied"), 1);
}

/// The TLS server answers with the certificate on disk, and a new certificate on disk is served
/// after a reload without restarting.
#[tokio::test]
async fn serves_https_and_picks_up_a_new_certificate() {
    let dir = std::env::temp_dir().join(format!("tollgate-webhook-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sans = vec!["127.0.0.1".to_string(), "localhost".to_string()];
    let now = SystemTime::now();
    let a = Bundle::issue(Renewal::NewCa("test"), None, &sans, now).unwrap();
    let b = Bundle::issue(Renewal::NewCert("test"), Some(&a), &sans, now).unwrap();
    tls::write_if_changed(&dir, tls::CERT_FILE, a.cert_pem.as_bytes(), 0o644).unwrap();
    tls::write_if_changed(&dir, tls::KEY_FILE, a.key_pem.as_bytes(), 0o600).unwrap();

    let store = CertStore::new();
    assert!(store.load_dir(&dir).unwrap());
    assert!(
        !store.load_dir(&dir).unwrap(),
        "unchanged files are not reloaded"
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_tx, rx) = watch::channel(false);
    let cfg = Arc::new(tls::server_config(store.clone()).unwrap());
    tokio::spawn(serve(listener, cfg, handler(), rx));

    let served = |expect: String| {
        let ca = a.ca_pem.clone();
        async move {
            use rustls::pki_types::pem::PemObject;
            let connector = connector_trusting(&ca);
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            let peer = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
            let want =
                rustls::pki_types::CertificateDer::from_pem_slice(expect.as_bytes()).unwrap();
            assert_eq!(peer, want);
            tls.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut out = String::new();
            tls.read_to_string(&mut out).await.unwrap();
            assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        }
    };
    served(a.cert_pem.clone()).await;
    tls::write_if_changed(&dir, tls::CERT_FILE, b.cert_pem.as_bytes(), 0o644).unwrap();
    tls::write_if_changed(&dir, tls::KEY_FILE, b.key_pem.as_bytes(), 0o600).unwrap();
    assert!(store.load_dir(&dir).unwrap());
    served(b.cert_pem.clone()).await;

    // A broken file keeps the previous certificate.
    std::fs::write(dir.join(tls::KEY_FILE), b"garbage").unwrap();
    assert!(store.load_dir(&dir).is_err());
    served(b.cert_pem.clone()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// At shutdown the server stops accepting, and a review already in flight is still answered
/// before `serve` returns.
#[tokio::test]
async fn a_review_in_flight_at_shutdown_is_answered() {
    let dir = std::env::temp_dir().join(format!("tollgate-webhook-drain-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sans = vec!["127.0.0.1".to_string()];
    let a = Bundle::issue(Renewal::NewCa("test"), None, &sans, SystemTime::now()).unwrap();
    tls::write_if_changed(&dir, tls::CERT_FILE, a.cert_pem.as_bytes(), 0o644).unwrap();
    tls::write_if_changed(&dir, tls::KEY_FILE, a.key_pem.as_bytes(), 0o600).unwrap();
    let store = CertStore::new();
    assert!(store.load_dir(&dir).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = watch::channel(false);
    let cfg = Arc::new(tls::server_config(store).unwrap());
    let server = tokio::spawn(serve(listener, cfg, handler(), rx));

    let connector = connector_trusting(&a.ca_pem);
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    let body = review(
        PATH_VALIDATE_POLICY,
        ("tollgate.dev", "v1alpha1", "RateLimitPolicy"),
        "CREATE",
        json!({"apiVersion":"tollgate.dev/v1alpha1","kind":"RateLimitPolicy",
            "metadata":{"name":"p","namespace":"shop"},"spec":{}}),
    );
    let head = format!(
        "POST {PATH_VALIDATE_POLICY} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let (first, rest) = body.split_at(body.len() / 2);
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.write_all(first).await.unwrap();
    tls.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    tx.send_replace(true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !server.is_finished(),
        "the server waits for the review in flight"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no new connection is accepted"
    );
    tls.write_all(rest).await.unwrap();
    let mut out = String::new();
    tls.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(
        out.contains("\"uid\":\"uid-/validate-ratelimitpolicy\""),
        "{out}"
    );
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("serve returns once the review is answered")
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TLS client that trusts only the CA in `ca_pem`, as the API server calling the webhook does.
fn connector_trusting(ca_pem: &str) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(client))
}
