//! Golden tests of sidecar injection: for each `tests/data/<case>.pod.json` the patch must equal
//! `<case>.patch.json` and the pod after applying it must equal `<case>.injected.json` (whole
//! pods, not fragments). Each result is then decoded into a typed `Pod` and checked field by
//! field. Regenerate the goldens after an intended change with
//! `TOLLGATE_BLESS=1 cargo test -p tollgate-controller --test inject_golden` and review the diff.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;
use tollgate_controller::webhook::inject::{
    self, CaRef, InjectConfig, Outcome, RedisConfig, SecretKeyRef, Skip,
};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn read(name: &str) -> Value {
    let text = std::fs::read_to_string(data(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn golden(name: &str, actual: &Value) {
    let text = serde_json::to_string_pretty(actual).unwrap() + "\n";
    if std::env::var_os("TOLLGATE_BLESS").is_some() {
        std::fs::write(data(name), &text).unwrap();
        return;
    }
    let expected = read(name);
    assert!(
        &expected == actual,
        "{name} differs (TOLLGATE_BLESS=1 regenerates it); actual:\n{text}"
    );
}

/// Runs one case: returns the typed pod after the patch (the input when nothing is injected).
fn case(name: &str, namespace_opted_in: bool, cfg: &InjectConfig) -> (Option<Skip>, Pod) {
    let input = read(&format!("{name}.pod.json"));
    let outcome = inject::inject(&input, namespace_opted_in, cfg).expect("pod decodes");
    let (skip, patch) = match outcome {
        Outcome::Injected(p, _) => (None, p),
        Outcome::Skipped(s) => (Some(s), json_patch::Patch(Vec::new())),
    };
    golden(
        &format!("{name}.patch.json"),
        &serde_json::to_value(&patch).unwrap(),
    );
    let mut output = input.clone();
    json_patch::patch(&mut output, &patch).expect("the patch applies to its pod");
    golden(&format!("{name}.injected.json"), &output);
    let pod: Pod = serde_json::from_value(output).expect("the result is a valid Pod");
    (skip, pod)
}

fn sidecar(pod: &Pod) -> &Container {
    let spec = pod.spec.as_ref().unwrap();
    let init = spec.init_containers.as_ref().expect("initContainers");
    let c = init.last().unwrap();
    assert_eq!(
        c.name, "tollgate-sidecar",
        "the sidecar is the last init container"
    );
    c
}

fn args(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

fn env<'a>(c: &'a Container, name: &str) -> &'a k8s_openapi::api::core::v1::EnvVar {
    c.env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == name)
        .unwrap_or_else(|| panic!("env {name}"))
}

/// The container port a Service `targetPort: <name>` reaches, resolved like the EndpointSlice
/// controller does (app containers first, then native sidecars).
fn service_target(pod: &Pod, name: &str) -> Option<i32> {
    let spec = pod.spec.as_ref().unwrap();
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"));
    spec.containers
        .iter()
        .chain(sidecars)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name))
        .map(|p| p.container_port)
}

fn check_hardened_native_sidecar(c: &Container, cfg: &InjectConfig) {
    assert_eq!(
        c.restart_policy.as_deref(),
        Some("Always"),
        "native sidecar"
    );
    assert_eq!(c.image.as_deref(), Some(cfg.image.as_str()));
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.run_as_user, Some(65532));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    for (probe, path) in [
        (&c.startup_probe, "/healthz"),
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::String("tollgate-admin".into()));
    }
    let a = args(c);
    assert!(
        a.contains(&format!("--admin=0.0.0.0:{}", cfg.admin_port)),
        "{a:?}"
    );
    assert!(
        a.contains(&format!("--listen=0.0.0.0:{}", cfg.listen_port)),
        "{a:?}"
    );
    assert!(
        a.contains(&format!("--controller={}", cfg.controller_url)),
        "{a:?}"
    );
    assert_eq!(
        env(c, "TOLLGATE_POD_NAME")
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "metadata.name"
    );
    assert_eq!(
        env(c, "TOLLGATE_POD_NAMESPACE")
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "metadata.namespace"
    );
    let mount = &c.volume_mounts.as_ref().unwrap()[0];
    assert_eq!(mount.name, "tollgate-token");
    assert_eq!(mount.mount_path, "/var/run/secrets/tollgate");
    assert_eq!(mount.read_only, Some(true));
    assert_eq!(c.resources.as_ref(), Some(&cfg.resources));
}

fn check_token_volume(pod: &Pod, cfg: &InjectConfig) {
    let vols = pod.spec.as_ref().unwrap().volumes.as_ref().unwrap();
    let v = vols.iter().find(|v| v.name == "tollgate-token").unwrap();
    let sat = v.projected.as_ref().unwrap().sources.as_ref().unwrap()[0]
        .service_account_token
        .as_ref()
        .unwrap();
    assert_eq!(sat.audience.as_deref(), Some(cfg.token_audience.as_str()));
    assert_eq!(sat.path, "token");
}

fn version_annotation(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("tollgate.dev/sidecar-version"))
        .map(String::as_str)
}

#[test]
fn plain_pod_in_a_labelled_namespace() {
    let cfg = InjectConfig::example();
    let (skip, pod) = case("plain", true, &cfg);
    assert_eq!(skip, None);
    let c = sidecar(&pod);
    check_hardened_native_sidecar(c, &cfg);
    check_token_volume(&pod, &cfg);
    assert!(args(c).contains(&"--upstream=http://127.0.0.1:8080".to_string()));
    assert_eq!(version_annotation(&pod), Some("0.1.0"));
    assert_eq!(
        pod.spec
            .as_ref()
            .unwrap()
            .init_containers
            .as_ref()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(service_target(&pod, "tollgate-http"), Some(8081));
    assert_eq!(
        pod.spec.as_ref().unwrap().service_account_name.as_deref(),
        Some("shop-api"),
        "an existing serviceAccountName is kept"
    );
    // The app container is untouched.
    assert_eq!(pod.spec.as_ref().unwrap().containers.len(), 1);
    assert_eq!(
        pod.spec.as_ref().unwrap().containers[0]
            .ports
            .as_ref()
            .unwrap()[0]
            .container_port,
        8080
    );
}

#[test]
fn pod_with_init_containers_volumes_and_annotations() {
    let cfg = InjectConfig::example();
    let (skip, pod) = case("existing-init", false, &cfg);
    assert_eq!(skip, None);
    let spec = pod.spec.as_ref().unwrap();
    let names: Vec<&str> = spec
        .init_containers
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, ["migrate", "log-shipper", "tollgate-sidecar"]);
    let vols: Vec<&str> = spec
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(vols, ["config", "tollgate-token", "tollgate-rules-cache"]);
    let ann = pod.metadata.annotations.as_ref().unwrap();
    assert_eq!(ann["example.com/owner"], "team-a");
    assert_eq!(ann["tollgate.dev/sidecar-version"], "0.1.0");
    let c = sidecar(&pod);
    check_hardened_native_sidecar(c, &cfg);
    // tollgate.dev/upstream-port wins over the first container port (9100).
    assert!(args(c).contains(&"--upstream=http://127.0.0.1:9000".to_string()));
}

#[test]
fn opted_out_pod_is_unchanged() {
    let cfg = InjectConfig::example();
    let (skip, pod) = case("opted-out", true, &cfg);
    assert_eq!(skip, Some(Skip::OptedOut));
    assert!(pod.spec.as_ref().unwrap().init_containers.is_none());
    assert_eq!(read("opted-out.injected.json"), read("opted-out.pod.json"));
}

#[test]
fn already_injected_pod_is_unchanged() {
    let cfg = InjectConfig::example();
    // The input is the result of the plain case: injecting twice changes nothing.
    assert_eq!(
        read("already-injected.pod.json"),
        read("plain.injected.json")
    );
    let (skip, pod) = case("already-injected", true, &cfg);
    assert_eq!(skip, Some(Skip::AlreadyInjected));
    assert_eq!(
        pod.spec
            .as_ref()
            .unwrap()
            .init_containers
            .as_ref()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        read("already-injected.injected.json"),
        read("already-injected.pod.json")
    );
}

#[test]
fn named_port_handed_to_the_sidecar() {
    let cfg = InjectConfig::example();
    let (skip, pod) = case("rewrite-port", false, &cfg);
    assert_eq!(skip, None);
    let spec = pod.spec.as_ref().unwrap();
    let web = &spec.containers[0];
    let names: Vec<&str> = web
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| p.name.as_deref().unwrap())
        .collect();
    assert_eq!(names, ["admin", "app-http"]);
    // Probes and hooks that named the port follow it; others are left alone.
    let renamed = IntOrString::String("app-http".into());
    assert_eq!(
        web.readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .port,
        renamed
    );
    assert_eq!(
        web.liveness_probe
            .as_ref()
            .unwrap()
            .tcp_socket
            .as_ref()
            .unwrap()
            .port,
        renamed
    );
    assert_eq!(
        web.lifecycle
            .as_ref()
            .unwrap()
            .pre_stop
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .port,
        renamed
    );
    assert_eq!(
        web.startup_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .port,
        IntOrString::String("admin".into())
    );
    let c = sidecar(&pod);
    check_hardened_native_sidecar(c, &cfg);
    assert!(args(c).contains(&"--upstream=http://127.0.0.1:8080".to_string()));
    // A Service with `targetPort: http` now reaches the sidecar, which forwards to 8080.
    assert_eq!(service_target(&pod, "http"), Some(8081));
    assert_eq!(service_target(&pod, "app-http"), Some(8080));
    assert_eq!(service_target(&pod, "cache"), Some(11211));
}

#[test]
fn redis_password_from_a_secret_and_extra_args() {
    let mut cfg = InjectConfig::example();
    cfg.redis = Some(RedisConfig {
        url: "rediss://redis.tollgate-system.svc:6380".into(),
        username: Some("tollgate".into()),
        password: Some(SecretKeyRef {
            name: "tollgate-redis".into(),
            key: "password".into(),
        }),
        ca: Some(CaRef::ConfigMap {
            name: "redis-ca".into(),
            key: "ca.crt".into(),
        }),
        ..RedisConfig::default()
    });
    cfg.extra_args = vec!["--log-format=text".into()];
    let (skip, pod) = case("redis-auth", false, &cfg);
    assert_eq!(skip, None);
    let c = sidecar(&pod);
    check_hardened_native_sidecar(c, &cfg);
    let names: Vec<&str> = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "TOLLGATE_POD_NAME",
            "TOLLGATE_POD_NAMESPACE",
            "TOLLGATE_REDIS_URL",
            "TOLLGATE_REDIS_USERNAME",
            "TOLLGATE_REDIS_PASSWORD_FILE",
            "TOLLGATE_REDIS_CA_FILE",
        ]
    );
    // No secret in the pod spec: the password is a file from the Secret, and the URL has none.
    assert!(
        c.env
            .as_ref()
            .unwrap()
            .iter()
            .all(|e| e.value_from.is_none()
                || e.value_from.as_ref().unwrap().secret_key_ref.is_none())
    );
    assert_eq!(
        env(c, "TOLLGATE_REDIS_URL").value.as_deref(),
        Some("rediss://redis.tollgate-system.svc:6380")
    );
    assert_eq!(
        env(c, "TOLLGATE_REDIS_PASSWORD_FILE").value.as_deref(),
        Some("/var/run/secrets/tollgate-redis/auth/password")
    );
    check_redis_secrets_mounted_in_the_sidecar_only(&pod);
    assert_eq!(
        args(c).last().map(String::as_str),
        Some("--log-format=text")
    );
    assert!(args(c).contains(&"--upstream=http://127.0.0.1:3000".to_string()));
    // The input has no serviceAccountName (the ServiceAccount admission plugin is off); the
    // projected token needs one.
    assert_eq!(
        pod.spec.as_ref().unwrap().service_account_name.as_deref(),
        Some("default")
    );
}

/// The Redis password and CA come from optional Secret and ConfigMap volumes, mounted
/// read-only into the sidecar and into no app container.
fn check_redis_secrets_mounted_in_the_sidecar_only(pod: &Pod) {
    let c = sidecar(pod);
    let spec = pod.spec.as_ref().unwrap();
    let volume = |name: &str| {
        spec.volumes
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("volume {name}"))
    };
    let auth = volume("tollgate-redis-auth").secret.as_ref().unwrap();
    assert_eq!(auth.secret_name.as_deref(), Some("tollgate-redis"));
    assert_eq!(
        auth.optional,
        Some(true),
        "a missing Secret must not block the pod"
    );
    let items = auth.items.as_ref().unwrap();
    assert_eq!(
        (items[0].key.as_str(), items[0].path.as_str()),
        ("password", "password")
    );
    let ca = volume("tollgate-redis-ca").config_map.as_ref().unwrap();
    assert_eq!(ca.name, "redis-ca");
    assert_eq!(ca.optional, Some(true));
    // Mounted read-only into the sidecar only; the app container does not see them.
    let mounts = c.volume_mounts.as_ref().unwrap();
    for (name, path) in [
        (
            "tollgate-redis-auth",
            "/var/run/secrets/tollgate-redis/auth",
        ),
        ("tollgate-redis-ca", "/var/run/secrets/tollgate-redis/ca"),
    ] {
        let m = mounts.iter().find(|m| m.name == name).unwrap();
        assert_eq!(m.mount_path, path);
        assert_eq!(m.read_only, Some(true));
    }
    for app in &spec.containers {
        assert!(
            app.volume_mounts
                .iter()
                .flatten()
                .all(|m| !m.name.starts_with("tollgate-redis")),
            "{}",
            app.name
        );
    }
}
