//! The Helm chart and the admission webhooks, with the real helm binary, a real control plane
//! (etcd + kube-apiserver) and the real `tollgate-controller` binary as local processes:
//!
//! - the chart's CRD is a byte-for-byte copy of `manifests/crds/`, `manifests/install.yaml` is
//!   exactly `helm template` output, `helm lint` passes and bad values fail with the path and the
//!   reason (`values.schema.json`);
//! - `helm install --no-hooks` creates every object and the CRD becomes Established;
//! - the controller running with the chart's ServiceAccount permissions (impersonated) in
//!   self-signed mode fills the webhook Secret, patches both `caBundle`s, takes its Lease and
//!   serves a certificate the API server trusts;
//! - with the control plane's test PKI, the controller behind the chart's own webhook selectors
//!   (turned into `clientConfig.url`s) injects the native sidecar into pods of labelled
//!   namespaces and pods that opt in, leaves other and opted-out pods alone, and denies a
//!   RateLimitPolicy whose regex does not compile, naming the field.
//!
//! The controller binary: `$TOLLGATE_CONTROLLER_BIN`, else `target/<profile>/tollgate-controller`
//! next to this test binary. `cargo test --workspace` builds it (the controller package has
//! integration tests); when running only this package, `cargo build -p tollgate-controller`
//! first. A binary older than the controller's sources is refused rather than tested.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tollgate_e2e::{ControlPlane, free_port, helm_offline, repo_root, text};

const RELEASE: &str = "tollgate";
const NS: &str = "tollgate-system";
const CHART: &str = "charts/tollgate";

// === helpers ===

/// `helm template` of the chart as release `tollgate` in [`NS`] with `--set set` and `extra`
/// arguments; panics with helm's error.
fn helm_template(set: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "template",
        "tollgate",
        CHART,
        "--namespace",
        NS,
        "--set",
        set,
    ];
    args.extend_from_slice(extra);
    let out = helm_offline(&args);
    assert!(
        out.status.success(),
        "helm template --set {set}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// kubectl … -o json, parsed.
fn get_json(cp: &ControlPlane, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    serde_json::from_str(&cp.ok(&a)).unwrap()
}

/// `kubectl create -f - -o json` (or a server-side dry run); Ok(object) or Err(stderr).
fn create(cp: &ControlPlane, obj: &Value, dry_run: bool) -> Result<Value, String> {
    let mut args = vec!["create", "-f", "-", "-o", "json"];
    if dry_run {
        args.push("--dry-run=server");
    }
    let out = cp.kubectl_stdin(&args, Some(&obj.to_string()));
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(text(&out.stderr))
    }
}

/// The controller binary (see the module docs).
fn controller_bin() -> PathBuf {
    let bin = match std::env::var_os("TOLLGATE_CONTROLLER_BIN") {
        Some(p) => PathBuf::from(p),
        None => {
            // target/<profile>/deps/<this test> → target/<profile>/tollgate-controller
            let exe = std::env::current_exe().unwrap();
            exe.parent().and_then(Path::parent).unwrap().join(format!(
                "tollgate-controller{}",
                std::env::consts::EXE_SUFFIX
            ))
        }
    };
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build -p tollgate-controller` (cargo test --workspace builds it) \
         or set TOLLGATE_CONTROLLER_BIN",
        bin.display()
    );
    // Refuse a binary older than the sources it was built from (cargo's dep-info lists them).
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).unwrap();
    let dep_info = std::fs::read_to_string(bin.with_extension("d")).unwrap_or_default();
    let stale: Vec<&str> = dep_info
        .split_once(": ")
        .map(|(_, deps)| deps)
        .unwrap_or("")
        .split_whitespace()
        .filter(|dep| {
            std::fs::metadata(dep)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > built)
        })
        .collect();
    assert!(
        stale.is_empty(),
        "{} is older than {stale:?}: run `cargo build -p tollgate-controller`",
        bin.display()
    );
    bin
}

/// A controller process, killed (by its PID) when dropped; its log is printed on failure.
struct Controller {
    child: Child,
    log: PathBuf,
    name: &'static str,
}

impl Controller {
    fn start(name: &'static str, kubeconfig: &Path, args: &[String], dir: &Path) -> Controller {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(controller_bin())
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,tollgate_controller=debug")
            .env("TOLLGATE_LOG_FORMAT", "plain")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start tollgate-controller");
        Controller { child, log, name }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{} exited ({status}):\n{}", self.name, self.log());
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- {} log (last 60 lines) ---\n{}",
                self.name,
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
    }
}

fn base64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn unbase64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            _ => 63,
        }
    };
    let clean: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let mut out = Vec::new();
    for chunk in clean.chunks(4) {
        let pad = chunk.iter().filter(|&&c| c == b'=').count();
        let n = chunk.iter().fold(0u32, |acc, &c| {
            (acc << 6) | if c == b'=' { 0 } else { val(c) }
        });
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    out
}

// === tests without a cluster ===

#[test]
fn chart_crd_is_a_copy_of_the_generated_crd() {
    let root = repo_root();
    let generated =
        std::fs::read(root.join("manifests/crds/tollgate.dev_ratelimitpolicies.yaml")).unwrap();
    let in_chart =
        std::fs::read(root.join("charts/tollgate/crds/tollgate.dev_ratelimitpolicies.yaml"))
            .unwrap_or_default();
    assert!(
        generated == in_chart,
        "charts/tollgate/crds/ differs from manifests/crds/; copy it:\n  \
         cp manifests/crds/tollgate.dev_ratelimitpolicies.yaml charts/tollgate/crds/"
    );
}

#[test]
fn chart_examples_are_copies_of_manifests_examples() {
    let root = repo_root();
    let dir = root.join("charts/tollgate/examples");
    let shipped: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        shipped.iter().any(|f| f == "per-api-key.yaml"),
        "{shipped:?}"
    );
    for f in &shipped {
        let ours = std::fs::read(dir.join(f)).unwrap();
        let source = std::fs::read(root.join("manifests/examples").join(f)).unwrap_or_default();
        assert!(
            ours == source,
            "charts/tollgate/examples/{f} differs from manifests/examples/{f}; copy it:\n  \
             cp manifests/examples/{f} charts/tollgate/examples/"
        );
    }
    // tests/node checks that the NOTES helm prints on install name these files.
}

#[test]
fn install_yaml_is_exactly_helm_template_output() {
    let out = helm_offline(&[
        "template",
        RELEASE,
        CHART,
        "--namespace",
        NS,
        "--include-crds",
        "--no-hooks",
        "--set",
        "namespace.create=true",
    ]);
    assert!(out.status.success(), "helm template: {}", text(&out.stderr));
    let rendered = text(&out.stdout);
    // `kubectl apply` would run a hook at once: the uninstall hook must not be in the bundle.
    assert!(
        !rendered.contains("--retire"),
        "install.yaml carries the uninstall hook"
    );
    let file = std::fs::read_to_string(repo_root().join("manifests/install.yaml")).unwrap();
    let marker = "# ---- rendered by helm template below this line ----\n";
    let body = file
        .split_once(marker)
        .map(|(_, b)| b)
        .unwrap_or_else(|| panic!("manifests/install.yaml lacks the line {marker:?}"));
    assert!(
        body == rendered,
        "manifests/install.yaml is out of date with charts/tollgate; regenerate it with the \
         command in its header"
    );
    // The bundle is complete on its own.
    for kind in [
        "kind: CustomResourceDefinition",
        "kind: Namespace",
        "kind: Deployment",
        "kind: MutatingWebhookConfiguration",
        "kind: ValidatingWebhookConfiguration",
    ] {
        assert!(rendered.contains(kind), "install.yaml lacks {kind}");
    }
}

#[test]
fn helm_lint_passes_with_default_and_full_values() {
    for set in [
        "",
        "replicas=3,networkPolicy.enabled=true,serviceMonitor.enabled=true,redis.dev.enabled=true,tracing.otlpEndpoint=http://otel:4318,streamTLS.plainStream=true",
        "certManager.enabled=true,controller.watchNamespaces={a,b},redis.url=rediss://r:6380,redis.auth.secretName=redis,streamTLS.enabled=false",
    ] {
        let mut args = vec!["lint", CHART, "--strict"];
        if !set.is_empty() {
            args.extend(["--set", set]);
        }
        let out = helm_offline(&args);
        assert!(
            out.status.success(),
            "helm lint --set {set:?}:\n{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
}

/// `streamTLS.enabled` (the default) adds the TLS listener, its container, Service and
/// NetworkPolicy ports, points injected sidecars at it with https and closes the plain stream
/// unless `streamTLS.plainStream`; off, none of it is rendered.
#[test]
fn stream_tls_value_switches_the_sidecars_to_https() {
    let render = |set: &str| helm_template(set, &[]);
    let on = render("networkPolicy.enabled=true");
    for needle in [
        "- --tls-listen=0.0.0.0:8443",
        "- --plain-stream=false",
        "- --sidecar-controller-url=https://tollgate-controller.tollgate-system.svc:8443",
        "- name: stream-tls\n              containerPort: 8443",
        "- name: stream-tls\n      port: 8443\n      targetPort: stream-tls",
        "- port: stream-tls",
    ] {
        assert!(on.contains(needle), "missing {needle:?} by default:\n{on}");
    }
    assert!(!on.contains("--sidecar-controller-url=http://"), "{on}");
    let switching = render("streamTLS.plainStream=true");
    assert!(
        switching.contains("- --plain-stream=true")
            && switching.contains("- --sidecar-controller-url=https://"),
        "{switching}"
    );
    let off = render("streamTLS.enabled=false,networkPolicy.enabled=true");
    assert!(
        !off.contains("stream-tls")
            && !off.contains("--tls-listen")
            && !off.contains("--plain-stream"),
        "{off}"
    );
    assert!(
        off.contains(
            "- --sidecar-controller-url=http://tollgate-controller.tollgate-system.svc:8090"
        ),
        "{off}"
    );
}

/// cert-manager without an issuer of the user's: a self-signed Issuer makes a long-lived CA and
/// a CA Issuer signs the rotating serving certificate with it, so the `ca.crt` sidecars were
/// given at injection stays valid. With the user's issuer none of that is rendered.
#[test]
fn cert_manager_mode_signs_the_serving_certificate_with_a_ca_of_its_own() {
    let render = |set: &str| -> Vec<serde_json::Value> {
        helm_template(set, &["--show-only", "templates/webhook-tls.yaml"])
            .split("\n---")
            .map(|doc| serde_norway::from_str::<serde_json::Value>(doc).expect("YAML document"))
            .filter(|v| !v.is_null())
            .collect()
    };
    let docs = render("certManager.enabled=true");
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in {docs:#?}"))
            .clone()
    };
    let ca = find("Certificate", "tollgate-ca");
    assert_eq!(ca["spec"]["isCA"], true);
    assert_eq!(ca["spec"]["duration"], "87600h");
    assert_eq!(ca["spec"]["issuerRef"]["name"], "tollgate-selfsigned");
    assert_eq!(
        find("Issuer", "tollgate-ca")["spec"]["ca"]["secretName"],
        "tollgate-ca"
    );
    let serving = find("Certificate", "tollgate-webhook");
    assert_eq!(serving["spec"]["issuerRef"]["name"], "tollgate-ca");
    assert_eq!(serving["spec"]["privateKey"]["rotationPolicy"], "Always");

    let own = render("certManager.enabled=true,certManager.issuerRef.name=corp-ca");
    assert_eq!(own.len(), 1, "only the serving certificate: {own:#?}");
    assert_eq!(own[0]["spec"]["issuerRef"]["name"], "corp-ca");
}

#[test]
fn bad_values_fail_with_the_path_and_the_reason() {
    let cases: &[(&str, &[&str])] = &[
        ("replicas=0", &["/replicas", "minimum"]),
        (
            "tracing.otlpEndpoint=otel:4318",
            &["/tracing/otlpEndpoint", "does not match pattern"],
        ),
        (
            "webhook.failurePolicy=Sometimes",
            &["/webhook/failurePolicy", "'Ignore', 'Fail'"],
        ),
        (
            "redis.url=http://redis:6379",
            &["/redis/url", "does not match pattern"],
        ),
        (
            "image.tagg=v1",
            &["/image", "additional properties 'tagg' not allowed"],
        ),
        (
            "redis.dev.enabled=true,redis.url=redis://redis:6379",
            &[
                "/redis/url",
                "set either redis.url or redis.dev.enabled, not both",
            ],
        ),
        ("sidecar.port=http", &["/sidecar/port", "want integer"]),
        (
            "certManager.issuerRef.kind=Vault",
            &["/certManager/issuerRef/kind", "'Issuer', 'ClusterIssuer'"],
        ),
    ];
    for (set, needles) in cases {
        let out = helm_offline(&["template", RELEASE, CHART, "--set", set]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "--set {set} was accepted");
        assert!(
            err.contains("values don't meet the specifications of the schema"),
            "--set {set}: not a schema error: {err}"
        );
        for n in *needles {
            assert!(err.contains(n), "--set {set}: {n:?} missing in: {err}");
        }
    }
    // What a schema cannot compare is checked by the templates, also with a clear message.
    let out = helm_offline(&["template", RELEASE, CHART, "--set", "sidecar.port=9091"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("sidecar.port and sidecar.adminPort must differ"));
    let set = "redis.url=redis://s:26379,redis.cluster=true,redis.sentinel.masterName=tg";
    let out = helm_offline(&["template", RELEASE, CHART, "--set", set]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr)
            .contains("redis.cluster and redis.sentinel.masterName exclude each other")
    );
}

#[test]
fn redis_sentinel_reaches_the_injected_sidecars() {
    let out = helm_template(
        "redis.url=redis://s1:26379\\,redis://s2:26379,redis.sentinel.masterName=tg",
        &[],
    );
    assert!(out.contains("--sidecar-redis-sentinel=tg"), "{out}");
    assert!(
        out.contains("--sidecar-redis-url=redis://s1:26379,redis://s2:26379"),
        "{out}"
    );
    assert!(!out.contains("--sidecar-redis-cluster"));
}

#[test]
fn the_sentinels_password_and_tls_come_from_the_chart() {
    let set = "redis.url=rediss://s1:26379\\,rediss://s2:26379,redis.sentinel.masterName=tg,\
               redis.sentinel.auth.secretName=sentinel-auth,redis.sentinel.auth.secretKey=pw,\
               redis.auth.secretName=redis-auth,redis.tls.enabled=true,\
               redis.tls.ca.configMapName=redis-ca,rateLimitService.enabled=true";
    let out = helm_template(set, &[]);
    for want in [
        "--sidecar-redis-sentinel=tg",
        "--sidecar-redis-sentinel-password-secret=sentinel-auth",
        "--sidecar-redis-sentinel-password-key=pw",
        "--sidecar-redis-password-secret=redis-auth",
        "--sidecar-redis-ca-configmap=redis-ca",
        "--sidecar-redis-url=rediss://s1:26379,rediss://s2:26379",
        // The rate limit service gets the same, as files.
        "name: TOLLGATE_REDIS_SENTINEL_PASSWORD_FILE\n              value: /var/run/secrets/tollgate-redis/sentinel-auth/password",
        "secretName: sentinel-auth\n            items:\n              - key: pw\n                path: password\n            optional: true",
    ] {
        assert!(out.contains(want), "{want:?} missing:\n{out}");
    }
    assert!(!out.contains("pw@"), "no password in a URL");
    // Without sentinels the setting is refused, with the reason.
    let out = helm_offline(&[
        "template",
        RELEASE,
        CHART,
        "--set",
        "redis.url=redis://r:6379,redis.sentinel.auth.secretName=sentinel-auth",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr)
            .contains("redis.sentinel.auth.secretName needs redis.sentinel.masterName"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn pod_eviction_is_granted_only_when_restarts_are_opted_in() {
    let rbac = |set: &str| {
        helm_template(set, &["--show-only", "templates/rbac.yaml"])
            .split("\n---")
            .find(|doc| {
                doc.contains("name: tollgate-controller\n") && doc.contains("kind: ClusterRole\n")
            })
            .unwrap_or_else(|| panic!("no ClusterRole tollgate-controller"))
            .to_string()
    };
    let off = rbac("controller.restartPodsWithoutSidecar=false");
    assert!(!off.contains("pods/eviction"), "{off}");
    let on = rbac("controller.restartPodsWithoutSidecar=true");
    assert!(
        on.contains("resources: [pods/eviction]\n    verbs: [create]"),
        "{on}"
    );
    let deploy = helm_template(
        "controller.restartPodsWithoutSidecar=true",
        &["--show-only", "templates/deployment.yaml"],
    );
    assert!(
        deploy.contains("--restart-pods-without-sidecar=true"),
        "{deploy}"
    );
    let deploy = helm_template("replicas=2", &["--show-only", "templates/deployment.yaml"]);
    assert!(
        !deploy.contains("--restart-pods-without-sidecar"),
        "{deploy}"
    );
}

#[test]
fn helm_uninstall_first_retires_the_controllers() {
    let hook = helm_template("replicas=2", &["--show-only", "templates/retire-hook.yaml"]);
    for want in [
        "helm.sh/hook: pre-delete",
        "- --retire\n",
        "- --retire-wait=15s",
        "- --lease-name=tollgate-controller\n",
        "- --lease-namespace=tollgate-system\n",
        "serviceAccountName: tollgate-controller\n",
        "tollgate.dev/inject: disabled",
    ] {
        assert!(hook.contains(want), "{want:?} missing:\n{hook}");
    }
    let out = helm_offline(&[
        "template",
        RELEASE,
        CHART,
        "--set",
        "uninstall.retireSidecars=false",
        "--show-only",
        "templates/retire-hook.yaml",
    ]);
    assert!(!out.status.success() || !text(&out.stdout).contains("kind: Job"));
}

// === the cluster test ===

/// The chart's webhook configurations rendered as JSON, pointed at `https://127.0.0.1:<port>`
/// with `ca` as caBundle, under new names.
fn chart_webhooks_as_urls(cp: &ControlPlane, port: u16, ca: &[u8], suffix: &str) -> Vec<Value> {
    let out = helm_offline(&[
        "template",
        RELEASE,
        CHART,
        "--namespace",
        NS,
        "--show-only",
        "templates/webhooks.yaml",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let converted = cp.kubectl_stdin(
        &["create", "--dry-run=client", "-o", "json", "-f", "-"],
        Some(&text(&out.stdout)),
    );
    assert!(converted.status.success(), "{}", text(&converted.stderr));
    // One JSON object per document, one after the other.
    let mut items: Vec<Value> = serde_json::Deserializer::from_slice(&converted.stdout)
        .into_iter::<Value>()
        .map(Result::unwrap)
        .collect();
    assert_eq!(items.len(), 2, "{}", text(&converted.stdout));
    for item in &mut items {
        let name = item["metadata"]["name"].as_str().unwrap().to_string();
        item["metadata"] = json!({"name": format!("{name}-{suffix}")});
        for hook in item["webhooks"].as_array_mut().unwrap() {
            let path = hook["clientConfig"]["service"]["path"]
                .as_str()
                .unwrap()
                .to_string();
            hook["clientConfig"] = json!({
                "url": format!("https://127.0.0.1:{port}{path}"),
                "caBundle": base64(ca),
            });
        }
    }
    items
}

fn pod(name: &str, ns: &str, labels: Value, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels, "annotations": annotations},
        "spec": {"containers": [{
            "name": "app", "image": "registry.k8s.io/e2e-test-images/agnhost:2.53",
            "args": ["netexec", "--http-port=8080"],
            "ports": [{"name": "http", "containerPort": 8080}]
        }]}
    })
}

fn sidecar_of(pod: &Value) -> Option<&Value> {
    pod["spec"]["initContainers"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "tollgate-sidecar")
}

fn policy(name: &str, ns: &str, path: Value) -> Value {
    json!({
        "apiVersion": "tollgate.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"targetRef": {"selector": {}}, "rules": [
            {"name": "r", "match": {"path": path}, "limit": {"requests": 10, "period": "1s"}}
        ]}
    })
}

#[test]
fn chart_installs_and_the_controller_injects_sidecars_and_validates_policies() {
    let cp = ControlPlane::start();
    let work = tempfile::tempdir().unwrap();

    // --- helm install: every object is created, the CRD is established.
    let values = "replicas=2,networkPolicy.enabled=true,redis.dev.enabled=true";
    let out = cp.helm(&[
        "install",
        RELEASE,
        CHART,
        "-n",
        NS,
        "--create-namespace",
        "--no-hooks",
        "--set",
        values,
    ]);
    assert!(
        out.status.success(),
        "helm install: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let manifest = cp.helm(&["get", "manifest", RELEASE, "-n", NS]);
    assert!(manifest.status.success(), "{}", text(&manifest.stderr));
    let manifest = text(&manifest.stdout);
    let expected =
        manifest.matches("\nkind: ").count() + usize::from(manifest.starts_with("kind: "));
    let listed = cp.kubectl_stdin(&["get", "-f", "-", "-o", "name"], Some(&manifest));
    assert!(
        listed.status.success(),
        "an object of the release is missing: {}",
        text(&listed.stderr)
    );
    let names = text(&listed.stdout);
    assert_eq!(names.lines().count(), expected, "{names}");
    for want in [
        "serviceaccount/tollgate-controller",
        "secret/tollgate-webhook-tls",
        "clusterrole.rbac.authorization.k8s.io/tollgate-controller",
        "clusterrole.rbac.authorization.k8s.io/tollgate-controller-cluster",
        "clusterrolebinding.rbac.authorization.k8s.io/tollgate-controller",
        "role.rbac.authorization.k8s.io/tollgate-controller",
        "rolebinding.rbac.authorization.k8s.io/tollgate-controller",
        "service/tollgate-controller",
        "service/tollgate-redis",
        "deployment.apps/tollgate-controller",
        "deployment.apps/tollgate-redis",
        "poddisruptionbudget.policy/tollgate-controller",
        "networkpolicy.networking.k8s.io/tollgate-controller",
        "networkpolicy.networking.k8s.io/tollgate-redis",
        "mutatingwebhookconfiguration.admissionregistration.k8s.io/tollgate-sidecar-injector",
        "validatingwebhookconfiguration.admissionregistration.k8s.io/tollgate-policy-validator",
    ] {
        assert!(
            names.lines().any(|l| l == want),
            "{want} not created:\n{names}"
        );
    }
    cp.ok(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/ratelimitpolicies.tollgate.dev",
    ]);
    let deploy = get_json(&cp, &["-n", NS, "get", "deployment", "tollgate-controller"]);
    let spec = &deploy["spec"]["template"]["spec"];
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"],
        true
    );
    assert!(
        spec["affinity"]["podAntiAffinity"].is_object(),
        "anti-affinity with 2 replicas"
    );

    // --- self-signed mode with exactly the chart's permissions (impersonating its
    // ServiceAccount) and the chart's flags.
    let sa_kubeconfig = work.path().join("sa-kubeconfig");
    let admin = std::fs::read_to_string(cp.kubeconfig()).unwrap();
    assert!(
        admin.contains("\n  user:\n"),
        "unexpected kubeconfig layout"
    );
    std::fs::write(
        &sa_kubeconfig,
        admin.replace(
            "\n  user:\n",
            &format!("\n  user:\n    as: system:serviceaccount:{NS}:tollgate-controller\n"),
        ),
    )
    .unwrap();
    let ss_port = free_port();
    let ss_stream = free_port();
    let ss_tls = free_port();
    let chart_args: Vec<String> = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .filter(|a| {
            !a.starts_with("--listen=")
                && !a.starts_with("--tls-listen=")
                && !a.starts_with("--webhook-listen=")
                && !a.starts_with("--webhook-cert-dir=")
        })
        .chain([
            format!("--listen=127.0.0.1:{ss_stream}"),
            format!("--tls-listen=127.0.0.1:{ss_tls}"),
            format!("--webhook-listen=127.0.0.1:{ss_port}"),
            format!(
                "--webhook-cert-dir={}",
                work.path().join("ss-certs").display()
            ),
            "--identity=e2e-self-signed".to_string(),
        ])
        .collect();
    assert!(
        chart_args.iter().any(|a| a == "--webhook-self-signed"),
        "{chart_args:?}"
    );
    let mut ss = Controller::start(
        "controller-self-signed",
        &sa_kubeconfig,
        &chart_args,
        work.path(),
    );

    let ca = wait_for(
        "the controller to fill the webhook Secret",
        Duration::from_secs(60),
        || {
            ss.assert_running();
            let s = get_json(&cp, &["-n", NS, "get", "secret", "tollgate-webhook-tls"]);
            let ca = s["data"]["ca.crt"].as_str()?;
            s["data"]["tls.crt"].as_str()?;
            Some(unbase64(ca))
        },
    );
    assert!(text(&ca).contains("BEGIN CERTIFICATE"));
    for kind in [
        "mutatingwebhookconfiguration/tollgate-sidecar-injector",
        "validatingwebhookconfiguration/tollgate-policy-validator",
    ] {
        wait_for(
            &format!("caBundle on {kind}"),
            Duration::from_secs(30),
            || {
                ss.assert_running();
                let cfg = get_json(&cp, &["get", kind]);
                cfg["webhooks"]
                    .as_array()?
                    .iter()
                    .all(|w| {
                        w["clientConfig"]["caBundle"]
                            .as_str()
                            .map(unbase64)
                            .as_deref()
                            == Some(&ca[..])
                    })
                    .then_some(())
            },
        );
    }
    // The written files are the Secret's.
    let on_disk = std::fs::read(work.path().join("ss-certs/ca.crt")).unwrap();
    assert_eq!(on_disk, ca);
    // The chart's default rule stream: TLS with that CA under the Service's name, and the plain
    // port refusing the stream (health still answers there).
    let svc = format!("tollgate-controller.{NS}.svc");
    let tls = tollgate_e2e::http_client()
        .tls_certs_only([reqwest::Certificate::from_pem(&ca).unwrap()])
        .resolve(&svc, ([127, 0, 0, 1], ss_tls).into())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let healthz = tls
        .get(format!("https://{svc}:{ss_tls}/healthz"))
        .send()
        .unwrap_or_else(|e| panic!("TLS to the stream port with the Secret's CA: {e:?}"));
    assert_eq!(healthz.status(), 200);
    let plain = tollgate_e2e::http_client().build().unwrap();
    let refused = plain
        .get(format!(
            "http://127.0.0.1:{ss_stream}/v1/watch?namespace=injected&pod=api-1"
        ))
        .send()
        .unwrap();
    assert_eq!(refused.status(), 403, "the chart closes the plain stream");
    let healthz = plain
        .get(format!("http://127.0.0.1:{ss_stream}/healthz"))
        .send()
        .unwrap();
    assert_eq!(healthz.status(), 200);
    // Leader election and the initial list work with the chart's RBAC.
    wait_for("the Lease", Duration::from_secs(30), || {
        ss.assert_running();
        let out = cp.kubectl(&[
            "-n",
            NS,
            "get",
            "lease",
            "tollgate-controller",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ]);
        (text(&out.stdout) == "e2e-self-signed").then_some(())
    });
    // So does the membership exchange: its own Lease, found through the label it watches.
    wait_for("the membership Lease", Duration::from_secs(30), || {
        ss.assert_running();
        let out = cp.kubectl(&[
            "-n",
            NS,
            "get",
            "lease",
            "-l",
            "tollgate.dev/membership-of=tollgate-controller",
            "-o",
            "jsonpath={.items[*].spec.holderIdentity}",
        ]);
        (text(&out.stdout) == "e2e-self-signed").then_some(())
    });
    let log = ss.log();
    assert!(
        !log.contains("cannot publish the membership report")
            && !log.contains("membership lease watch failed"),
        "the chart's RBAC must allow the membership exchange:\n{log}"
    );
    wait_for(
        "/readyz of the self-signed controller",
        Duration::from_secs(30),
        || {
            ss.assert_running();
            let out = Command::new("curl")
                .args([
                    "-fsS",
                    "-m",
                    "2",
                    &format!("http://127.0.0.1:{ss_stream}/readyz"),
                ])
                .output()
                .ok()?;
            out.status.success().then_some(())
        },
    );
    assert!(
        !ss.log().contains("Forbidden") && !ss.log().contains("forbidden"),
        "the chart's RBAC is missing a permission:\n{}",
        ss.log()
    );

    // The chart's own webhooks point at a Service that cannot be reached here; replace them
    // with the same selectors and paths on 127.0.0.1.
    cp.ok(&[
        "delete",
        "mutatingwebhookconfiguration/tollgate-sidecar-injector",
        "validatingwebhookconfiguration/tollgate-policy-validator",
    ]);

    // The API server trusts the self-signed certificate: a validating webhook served by this
    // controller (failurePolicy Fail) answers.
    for cfg in chart_webhooks_as_urls(&cp, ss_port, &ca, "self-signed") {
        if cfg["kind"] == "ValidatingWebhookConfiguration" {
            create(&cp, &cfg, false).unwrap();
        }
    }
    cp.ok(&["create", "namespace", "shop"]);
    let bad = policy("bad", "shop", json!({"regex": "(unclosed"}));
    let err = wait_for(
        "the self-signed validating webhook",
        Duration::from_secs(30),
        || {
            ss.assert_running();
            create(&cp, &bad, true)
                .err()
                .filter(|e| e.contains("denied the request"))
        },
    );
    assert!(err.contains("spec.rules[0].match.path.regex"), "{err}");

    // --- the controller with the control plane's test PKI (RUN_DIR/pki/webhook.{crt,key}).
    let pki = PathBuf::from(&cp.env["K8S_CA_FILE"])
        .parent()
        .unwrap()
        .to_path_buf();
    let certs = work.path().join("pki-certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::copy(pki.join("webhook.crt"), certs.join("tls.crt")).unwrap();
    std::fs::copy(pki.join("webhook.key"), certs.join("tls.key")).unwrap();
    std::fs::copy(pki.join("ca.crt"), certs.join("ca.crt")).unwrap();
    let ca_pki = std::fs::read(pki.join("ca.crt")).unwrap();
    let port = free_port();
    let stream = free_port();
    let args: Vec<String> = vec![
        format!("--listen=127.0.0.1:{stream}"),
        format!("--webhook-listen=127.0.0.1:{port}"),
        format!("--webhook-cert-dir={}", certs.display()),
        "--leader-election=false".into(),
        "--sidecar-image=registry.example/tollgate-sidecar:e2e".into(),
        // The chart's default: the rule stream over TLS.
        format!("--sidecar-controller-url=https://tollgate-controller.{NS}.svc:8443"),
        "--sidecar-arg=--log-format=text".into(),
    ];
    let mut ctl = Controller::start("controller-pki", &cp.kubeconfig(), &args, work.path());
    for cfg in chart_webhooks_as_urls(&cp, port, &ca_pki, "e2e") {
        create(&cp, &cfg, false).unwrap_or_else(|e| panic!("{e}"));
    }

    cp.ok(&["create", "namespace", "injected"]);
    cp.ok(&[
        "label",
        "namespace",
        "injected",
        "tollgate.dev/inject=enabled",
    ]);
    cp.ok(&["create", "namespace", "plain"]);

    // Wait until the mutating webhook is live (dry runs reach webhooks with sideEffects None).
    let probe = pod("probe", "injected", json!({}), json!({}));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        ctl.assert_running();
        let last = match create(&cp, &probe, true) {
            Ok(p) if sidecar_of(&p).is_some() => break,
            Ok(p) => format!("not injected yet: {p}"),
            Err(e) => e,
        };
        assert!(
            Instant::now() < deadline,
            "the injection webhook never answered; last: {last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A pod in a labelled namespace gets the native sidecar.
    let p = create(
        &cp,
        &pod("api-1", "injected", json!({"app": "api"}), json!({})),
        false,
    )
    .unwrap();
    let sc = sidecar_of(&p).unwrap_or_else(|| panic!("not injected: {p:#}"));
    assert_eq!(sc["restartPolicy"], "Always", "native sidecar");
    assert_eq!(sc["image"], "registry.example/tollgate-sidecar:e2e");
    let args: Vec<&str> = sc["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&"--upstream=http://127.0.0.1:8080"),
        "{args:?}"
    );
    assert!(args.contains(&"--listen=0.0.0.0:8081"), "{args:?}");
    assert!(args.contains(&"--admin=0.0.0.0:9091"), "{args:?}");
    assert!(args.contains(&"--log-format=text"), "{args:?}");
    let env = |name: &str| {
        sc["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].as_str().unwrap_or_default().to_string())
    };
    assert!(
        args.contains(&"--controller=https://tollgate-controller.tollgate-system.svc:8443"),
        "{args:?}"
    );
    assert_eq!(
        env("TOLLGATE_CONTROLLER_CA").as_deref().map(str::as_bytes),
        Some(&ca_pki[..]),
        "the sidecar trusts the serving certificate's CA"
    );
    assert_eq!(sc["securityContext"]["runAsNonRoot"], true);
    assert_eq!(sc["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        sc["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert_eq!(sc["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(sc["startupProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(
        p["metadata"]["annotations"]["tollgate.dev/sidecar-version"],
        "e2e"
    );
    let token = p["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tollgate-token")
        .unwrap_or_else(|| panic!("no token volume: {p:#}"));
    assert_eq!(
        token["projected"]["sources"][0]["serviceAccountToken"]["audience"],
        "tollgate"
    );
    // The app container is as it was.
    assert_eq!(p["spec"]["containers"].as_array().unwrap().len(), 1);

    // A pod in an unlabelled namespace comes back unchanged ...
    let p = create(&cp, &pod("api-2", "plain", json!({}), json!({})), false).unwrap();
    assert!(p["spec"]["initContainers"].is_null(), "{p:#}");
    assert!(p["metadata"]["annotations"]["tollgate.dev/sidecar-version"].is_null());
    // ... unless it opts in itself, by annotation or label.
    let p = create(
        &cp,
        &pod(
            "api-3",
            "plain",
            json!({}),
            json!({"tollgate.dev/inject": "enabled"}),
        ),
        false,
    )
    .unwrap();
    assert!(sidecar_of(&p).is_some(), "annotation opt-in: {p:#}");
    let p = create(
        &cp,
        &pod(
            "api-4",
            "plain",
            json!({"tollgate.dev/inject": "enabled"}),
            json!({}),
        ),
        false,
    )
    .unwrap();
    assert!(sidecar_of(&p).is_some(), "label opt-in: {p:#}");

    // Opted-out pods in a labelled namespace come back unchanged (annotation: the handler
    // decides; label: the objectSelector keeps the webhook from being called).
    let p = create(
        &cp,
        &pod(
            "batch-1",
            "injected",
            json!({}),
            json!({"tollgate.dev/inject": "disabled"}),
        ),
        false,
    )
    .unwrap();
    assert!(p["spec"]["initContainers"].is_null(), "{p:#}");
    let p = create(
        &cp,
        &pod(
            "batch-2",
            "injected",
            json!({"tollgate.dev/inject": "disabled"}),
            json!({}),
        ),
        false,
    )
    .unwrap();
    assert!(p["spec"]["initContainers"].is_null(), "{p:#}");

    // A pod that asks for injection but cannot get it is still created, with a warning.
    let mut portless = pod(
        "no-port",
        "plain",
        json!({"tollgate.dev/inject": "enabled"}),
        json!({}),
    );
    portless["spec"]["containers"][0]["ports"] = json!([]);
    let out = cp.kubectl_stdin(&["create", "-f", "-"], Some(&portless.to_string()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("tollgate: sidecar not injected"),
        "{}",
        text(&out.stderr)
    );

    // The demo app: its pod template gets the sidecar, which takes over the named port.
    let demo = std::fs::read_to_string(repo_root().join("manifests/demo-app.yaml")).unwrap();
    cp.apply(&demo)
        .unwrap_or_else(|e| panic!("demo-app.yaml: {e}"));
    let template =
        get_json(&cp, &["-n", "demo", "get", "deployment", "echo"])["spec"]["template"].clone();
    let mut demo_pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]});
    demo_pod["metadata"]["name"] = json!("echo-1");
    demo_pod["metadata"]["namespace"] = json!("demo");
    let p = create(&cp, &demo_pod, false).unwrap();
    let sc = sidecar_of(&p).unwrap_or_else(|| panic!("demo pod not injected: {p:#}"));
    assert_eq!(sc["ports"][0]["name"], "http");
    assert_eq!(p["spec"]["containers"][0]["ports"][0]["name"], "app-http");
    assert_eq!(
        p["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"],
        "app-http"
    );
    assert_eq!(
        get_json(&cp, &["-n", "demo", "get", "rlp", "echo-per-client"])["metadata"]["name"],
        "echo-per-client"
    );

    // An invalid policy the CRD's CEL rules cannot catch is denied, naming the field ...
    let err = create(&cp, &bad, false).unwrap_err();
    assert!(err.contains("denied the request"), "{err}");
    assert!(err.contains("spec.rules[0].match.path.regex"), "{err}");
    assert!(err.contains("RateLimitPolicy \"bad\" is invalid"), "{err}");
    // ... a valid one is admitted by both validating webhooks.
    create(
        &cp,
        &policy("good", "shop", json!({"prefix": "/api"})),
        false,
    )
    .unwrap();

    // Both controllers answered through their metrics.
    let metrics = Command::new("curl")
        .args([
            "-fsS",
            "-m",
            "2",
            &format!("http://127.0.0.1:{stream}/metrics"),
        ])
        .output()
        .unwrap();
    let metrics = text(&metrics.stdout);
    assert!(
        metrics.contains(
            "tollgate_controller_webhook_reviews_total{webhook=\"inject\",result=\"injected\"}"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("webhook=\"validate\",result=\"denied\""),
        "{metrics}"
    );
    ctl.assert_running();
    ss.assert_running();
}

// === pods created while the webhook does not answer ===

/// Events of `reason` about object `name` in `ns` (events.k8s.io, as the controller writes).
fn events(cp: &ControlPlane, ns: &str, reason: &str) -> Vec<Value> {
    let list = get_json(cp, &["-n", ns, "get", "events.events.k8s.io"]);
    list["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect()
}

fn event_about<'a>(events: &'a [Value], name: &str) -> Option<&'a Value> {
    events.iter().find(|e| e["regarding"]["name"] == name)
}

fn metric(port: u16, name: &str) -> Option<f64> {
    let out = Command::new("curl")
        .args([
            "-fsS",
            "-m",
            "2",
            &format!("http://127.0.0.1:{port}/metrics"),
        ])
        .output()
        .ok()?;
    text(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn pods_created_while_the_webhook_is_down_are_refused_where_required_reported_and_restarted() {
    let cp = ControlPlane::start();
    let work = tempfile::tempdir().unwrap();
    tollgate_e2e::install_crd(&cp);

    // The chart's injection webhooks, pointed at a port nobody listens on yet.
    let pki = PathBuf::from(&cp.env["K8S_CA_FILE"])
        .parent()
        .unwrap()
        .to_path_buf();
    let ca = std::fs::read(pki.join("ca.crt")).unwrap();
    let port = free_port();
    for cfg in chart_webhooks_as_urls(&cp, port, &ca, "outage") {
        if cfg["kind"] == "MutatingWebhookConfiguration" {
            create(&cp, &cfg, false).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    cp.ok(&["create", "namespace", "shop"]);
    cp.ok(&["label", "namespace", "shop", "tollgate.dev/inject=enabled"]);
    cp.ok(&["create", "namespace", "strict"]);
    cp.ok(&[
        "label",
        "namespace",
        "strict",
        "tollgate.dev/inject=required",
    ]);

    // A ReplicaSet object (no controller-manager runs: its pods are made by hand) owning api-1.
    let rs = create(
        &cp,
        &json!({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "api", "namespace": "shop"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "api"}},
                "template": pod("x", "shop", json!({"app": "api"}), json!({}))
                    .as_object().unwrap().iter()
                    .filter(|(k, _)| *k == "metadata" || *k == "spec")
                    .map(|(k, v)| (k.clone(), v.clone())).collect::<serde_json::Map<_, _>>()}
        }),
        false,
    )
    .unwrap();
    let mut owned = pod("api-1", "shop", json!({"app": "api"}), json!({}));
    owned["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "api",
        "uid": rs["metadata"]["uid"], "controller": true
    }]);
    // The webhook does not answer: failurePolicy Ignore admits the pods bare ...
    for p in [
        owned,
        pod("api-2", "shop", json!({"app": "api"}), json!({})),
        pod(
            "batch-1",
            "shop",
            json!({"app": "api"}),
            json!({"tollgate.dev/inject": "disabled"}),
        ),
        pod("web-1", "shop", json!({"app": "web"}), json!({})),
    ] {
        let created = create(&cp, &p, false).unwrap_or_else(|e| panic!("{e}"));
        assert!(sidecar_of(&created).is_none(), "{created:#}");
    }
    // ... while a namespace that requires the sidecar refuses them.
    let err = create(&cp, &pod("api-1", "strict", json!({}), json!({})), false).unwrap_err();
    assert!(err.contains("required.inject.tollgate.dev"), "{err}");
    create(&cp, &policy("api", "shop", json!({"prefix": "/"})), false)
        .map(|_| ())
        .unwrap_or_else(|e| panic!("{e}"));
    cp.ok(&[
        "-n",
        "shop",
        "patch",
        "rlp",
        "api",
        "--type=merge",
        "-p",
        r#"{"spec":{"targetRef":{"selector":{"matchLabels":{"app":"api"}}}}}"#,
    ]);

    // The controller comes back (serving the webhook on that port).
    let certs = work.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::copy(pki.join("webhook.crt"), certs.join("tls.crt")).unwrap();
    std::fs::copy(pki.join("webhook.key"), certs.join("tls.key")).unwrap();
    let stream = free_port();
    let mut args: Vec<String> = vec![
        format!("--listen=127.0.0.1:{stream}"),
        format!("--webhook-listen=127.0.0.1:{port}"),
        format!("--webhook-cert-dir={}", certs.display()),
        "--leader-election=false".into(),
        "--peer-membership=false".into(),
        "--coverage-interval=1s".into(),
        "--sidecar-image=registry.example/tollgate-sidecar:e2e".into(),
    ];
    let mut ctl = Controller::start("controller-report", &cp.kubeconfig(), &args, work.path());

    // Each bare pod the policy selects gets an Event; the opted-out and unselected ones not.
    let missing = wait_for("SidecarMissing events", Duration::from_secs(60), || {
        ctl.assert_running();
        let ev = events(&cp, "shop", "SidecarMissing");
        (event_about(&ev, "api-1").is_some() && event_about(&ev, "api-2").is_some()).then_some(ev)
    });
    assert_eq!(missing[0]["type"], "Warning");
    assert!(
        missing[0]["note"]
            .as_str()
            .unwrap()
            .contains("RateLimitPolicy api selects this pod"),
        "{:#}",
        missing[0]
    );
    assert!(event_about(&missing, "batch-1").is_none());
    assert!(event_about(&missing, "web-1").is_none());
    // The policy tells it in its status and an Event; the metric counts the pods.
    let status = wait_for("status.podsWithoutSidecar", Duration::from_secs(30), || {
        let p = get_json(&cp, &["-n", "shop", "get", "rlp", "api"]);
        (p["status"]["podsWithoutSidecar"] == 2).then(|| p["status"].clone())
    });
    let cond = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "SidecarsInjected")
        .unwrap_or_else(|| panic!("{status:#}"))
        .clone();
    assert_eq!(cond["status"], "False");
    assert_eq!(cond["reason"], "PodsWithoutSidecar");
    assert!(
        cond["message"].as_str().unwrap().contains("api-1, api-2"),
        "{cond:#}"
    );
    assert!(event_about(&events(&cp, "shop", "PodsWithoutSidecar"), "api").is_some());
    assert_eq!(
        metric(stream, "tollgate_controller_pods_without_sidecar"),
        Some(2.0)
    );

    // The webhook answers again: the required namespace admits pods, with the sidecar; a pod
    // with a second port is admitted with a warning naming it, and an Event on the pod.
    let p = wait_for(
        "the required namespace to admit pods",
        Duration::from_secs(30),
        || create(&cp, &pod("api-1", "strict", json!({}), json!({})), false).ok(),
    );
    assert!(sidecar_of(&p).is_some(), "{p:#}");
    let mut two_ports = pod("metrics-1", "shop", json!({"app": "web"}), json!({}));
    two_ports["spec"]["containers"][0]["ports"] = json!([{"name": "http", "containerPort": 8080}, {"name": "metrics", "containerPort": 9090}]);
    let out = cp.kubectl_stdin(&["create", "-f", "-"], Some(&two_ports.to_string()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let warning = text(&out.stderr);
    assert!(
        warning.contains("only port 8080 is behind the rate-limiting sidecar")
            && warning.contains("metrics:9090"),
        "{warning}"
    );
    wait_for("an UnprotectedPorts event", Duration::from_secs(30), || {
        event_about(&events(&cp, "shop", "UnprotectedPorts"), "metrics-1").map(|_| ())
    });

    // A rollout: a replica with other sidecar settings starts while the old one still answers
    // the webhook. A pod the old one injects from then on is reported by the new one.
    assert!(
        p["metadata"]["annotations"]["tollgate.dev/injected-by"]
            .as_str()
            .is_some_and(|v| v.contains('.')),
        "{p:#}"
    );
    let new_stream = free_port();
    let new_args: Vec<String> = args
        .iter()
        .map(|a| {
            if a.starts_with("--listen=") {
                format!("--listen=127.0.0.1:{new_stream}")
            } else if a.starts_with("--webhook-listen=") {
                format!("--webhook-listen=127.0.0.1:{}", free_port())
            } else {
                a.clone()
            }
        })
        .chain(["--sidecar-arg=--log=debug".to_string()])
        .collect();
    let mut new = Controller::start("controller-new", &cp.kubeconfig(), &new_args, work.path());
    wait_for("the new replica", Duration::from_secs(30), || {
        new.assert_running();
        metric(new_stream, "tollgate_controller_pods_with_outdated_sidecar").map(|_| ())
    });
    std::thread::sleep(Duration::from_millis(1100)); // creation times have whole seconds
    let late = create(
        &cp,
        &pod("late-1", "shop", json!({"app": "web"}), json!({})),
        false,
    )
    .unwrap();
    assert!(
        sidecar_of(&late).is_some(),
        "injected by the old replica: {late:#}"
    );
    wait_for(
        "a SidecarSettingsOutdated event",
        Duration::from_secs(30),
        || {
            new.assert_running();
            event_about(&events(&cp, "shop", "SidecarSettingsOutdated"), "late-1").map(|_| ())
        },
    );
    assert_eq!(
        metric(new_stream, "tollgate_controller_pods_with_outdated_sidecar"),
        Some(1.0)
    );
    // Pods created before the new replica started (metrics-1) are not its business.
    assert!(event_about(&events(&cp, "shop", "SidecarSettingsOutdated"), "metrics-1").is_none());
    drop(new);

    // Opted in to restarts: the owned pod is evicted (its owner would re-create it through
    // the webhook); the pod nothing owns is only reported.
    drop(ctl);
    args.push("--restart-pods-without-sidecar=true".into());
    let mut ctl = Controller::start("controller-restart", &cp.kubeconfig(), &args, work.path());
    wait_for("api-1 to be evicted", Duration::from_secs(60), || {
        ctl.assert_running();
        let out = cp.kubectl(&["-n", "shop", "get", "pod", "api-1", "-o", "name"]);
        (!out.status.success() && text(&out.stderr).contains("NotFound")).then_some(())
    });
    wait_for("podsWithoutSidecar 1", Duration::from_secs(30), || {
        let p = get_json(&cp, &["-n", "shop", "get", "rlp", "api"]);
        (p["status"]["podsWithoutSidecar"] == 1).then_some(())
    });
    cp.ok(&["-n", "shop", "get", "pod", "api-2"]);
    assert!(event_about(&events(&cp, "shop", "SidecarMissingEvicted"), "api-1").is_some());
    ctl.assert_running();
}
