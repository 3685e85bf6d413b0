//! The chart's `rateLimitService` option (docs/gateway.md), with the real helm binary and, for
//! the install, a real control plane (etcd + kube-apiserver):
//!
//! - off by default: the default rendering has none of it (`manifests/install.yaml` stays the
//!   default rendering, checked in `webhook_and_chart.rs`);
//! - on: a ServiceAccount without API token, a Deployment of the `tollgate-ratelimit` image
//!   (its own `rateLimitService.image` values), named `grpc`/`admin` ports, the probes on the admin port, the
//!   controller URL, projected token (the controller's audience), downward-API pod identity and
//!   security context an injected sidecar gets, the Redis settings injected sidecars get, a
//!   Service with `appProtocol: kubernetes.io/h2c`, a PodDisruptionBudget, a spread over zones
//!   and nodes, and with their options a NetworkPolicy and a ServiceMonitor;
//! - settings under which the controller would serve it no rules are refused with the reason;
//! - `helm install` with the option on creates every object on a real API server.

use serde_json::Value;
use tollgate_e2e::{ControlPlane, helm_offline, repo_root, text};

const RELEASE: &str = "tollgate";
const NS: &str = "tollgate-system";
const CHART: &str = "charts/tollgate";
const NAME: &str = "tollgate-rate-limit-service";

// === helpers ===

/// `helm template` with `--set set` (empty: defaults); panics with helm's error.
fn render(set: &str) -> String {
    let mut args = vec!["template", RELEASE, CHART, "--namespace", NS];
    if !set.is_empty() {
        args.extend(["--set", set]);
    }
    let out = helm_offline(&args);
    assert!(
        out.status.success(),
        "helm template --set {set}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The rendered documents as JSON.
fn objects(set: &str) -> Vec<Value> {
    render(set)
        .split("\n---")
        .map(|doc| serde_norway::from_str::<Value>(doc).expect("a YAML document"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let have: Vec<String> = objs
                .iter()
                .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
                .collect();
            panic!("no {kind} {name} in {have:?}")
        })
}

/// The rate limit service's container in the rendered objects.
fn container(objs: &[Value]) -> Value {
    let d = find(objs, "Deployment", NAME);
    let containers = d["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    assert_eq!(containers.len(), 1, "{containers:#?}");
    containers[0].clone()
}

fn args(c: &Value) -> Vec<String> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// Plain `name=value` environment entries (those with a `value`).
fn env(c: &Value) -> Vec<(String, String)> {
    c["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
        .collect()
}

fn volume<'a>(objs: &'a [Value], name: &str) -> &'a Value {
    let d = find(objs, "Deployment", NAME);
    d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

fn mount_path(c: &Value, name: &str) -> Option<String> {
    c["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)
        .map(|m| {
            assert!(
                m["readOnly"] == true || name == "rules-cache",
                "{name} is mounted writable: {m}"
            );
            m["mountPath"].as_str().unwrap().to_string()
        })
}

// === rendering ===

#[test]
fn rate_limit_service_is_off_by_default() {
    let out = render("");
    assert!(!out.contains("rate-limit-service"), "{out}");
    assert!(!out.contains("--rate-limit-service"));
}

#[test]
fn rate_limit_service_renders_its_objects_like_an_injected_sidecar() {
    let objs = objects("rateLimitService.enabled=true");

    // The ServiceAccount: its rule-stream identity, no API token.
    let sa = find(&objs, "ServiceAccount", NAME);
    assert_eq!(sa["automountServiceAccountToken"], false);

    let d = find(&objs, "Deployment", NAME);
    assert_eq!(d["spec"]["replicas"], 2);
    let pod = &d["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(labels["app.kubernetes.io/component"], "rate-limit-service");
    assert_eq!(labels["app.kubernetes.io/instance"], RELEASE);
    // Never injected itself (the webhooks' objectSelector excludes the label).
    assert_eq!(labels["tollgate.dev/control-plane"], "rate-limit-service");
    assert_eq!(
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "rate-limit-service"
    );
    let spec = &pod["spec"];
    assert_eq!(spec["serviceAccountName"], NAME);
    assert_eq!(spec["automountServiceAccountToken"], false);
    // Security context as for the controller.
    let psc = &spec["securityContext"];
    assert_eq!(psc["runAsNonRoot"], true);
    assert_eq!(psc["runAsUser"], 65532);
    assert_eq!(psc["seccompProfile"]["type"], "RuntimeDefault");
    let c = container(&objs);
    assert_eq!(
        c["image"],
        format!(
            "ghcr.io/tollgate-dev/tollgate-ratelimit:{}",
            chart_app_version()
        )
    );
    assert_eq!(c["imagePullPolicy"], "IfNotPresent");
    let csc = &c["securityContext"];
    assert_eq!(csc["readOnlyRootFilesystem"], true);
    assert_eq!(csc["allowPrivilegeEscalation"], false);
    assert_eq!(csc["capabilities"]["drop"], serde_json::json!(["ALL"]));

    // Arguments: its ports, the controller (TLS by default), token and cache; the binary is
    // the service, so the sidecar's `--rate-limit-service` alias is not needed.
    let a = args(&c);
    for want in [
        "--listen=0.0.0.0:8081",
        "--admin=0.0.0.0:9091",
        "--controller=https://tollgate-controller.tollgate-system.svc:8443",
        "--controller-ca-file=/var/run/tollgate/controller-ca/ca.crt",
        "--token-file=/var/run/secrets/tollgate/token",
        "--rules-cache=/var/run/tollgate/cache/rules.json",
        "--log=info",
        "--log-format=json",
    ] {
        assert!(a.iter().any(|x| x == want), "{want} missing in {a:?}");
    }
    assert!(!a.iter().any(|x| x.starts_with("--upstream")), "{a:?}");
    assert!(!a.iter().any(|x| x == "--rate-limit-service"), "{a:?}");
    assert!(!a.iter().any(|x| x.starts_with("--redis")), "{a:?}");

    // Downward-API identity, as the injection webhook gives sidecars.
    let envs = c["env"].as_array().unwrap();
    for (name, path) in [
        ("TOLLGATE_POD_NAME", "metadata.name"),
        ("TOLLGATE_POD_NAMESPACE", "metadata.namespace"),
    ] {
        let e = envs
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(e["valueFrom"]["fieldRef"]["fieldPath"], path);
    }
    assert!(
        env(&c).is_empty(),
        "no Redis without redis.*: {:?}",
        env(&c)
    );

    // Named ports and the probes on the admin port.
    let ports = c["ports"].as_array().unwrap();
    assert_eq!(ports[0]["name"], "grpc");
    assert_eq!(ports[0]["containerPort"], 8081);
    assert_eq!(ports[1]["name"], "admin");
    assert_eq!(ports[1]["containerPort"], 9091);
    for (probe, path) in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/livez"),
        ("readinessProbe", "/readyz"),
    ] {
        assert_eq!(c[probe]["httpGet"]["port"], "admin", "{probe}");
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
    }
    assert!(c["lifecycle"]["preStop"]["sleep"]["seconds"].is_u64());
    assert!(c["resources"]["requests"]["cpu"].is_string());

    // The projected token for the audience the controller accepts, and only ca.crt of the
    // webhook certificate's Secret.
    let token = &volume(&objs, "tollgate-token")["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!(token["audience"], "tollgate");
    assert_eq!(token["path"], "token");
    assert_eq!(
        mount_path(&c, "tollgate-token").as_deref(),
        Some("/var/run/secrets/tollgate")
    );
    let ca = &volume(&objs, "controller-ca")["secret"];
    assert_eq!(ca["secretName"], "tollgate-webhook-tls");
    assert_eq!(
        ca["items"],
        serde_json::json!([{"key": "ca.crt", "path": "ca.crt"}])
    );
    assert_eq!(
        mount_path(&c, "controller-ca").as_deref(),
        Some("/var/run/tollgate/controller-ca")
    );
    assert!(volume(&objs, "rules-cache")["emptyDir"].is_object());

    // Spread over zones and nodes.
    let spread = spec["topologySpreadConstraints"].as_array().unwrap();
    let keys: Vec<&str> = spread
        .iter()
        .map(|t| t["topologyKey"].as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    );
    assert!(spread.iter().all(
        |t| t["labelSelector"]["matchLabels"]["app.kubernetes.io/component"]
            == "rate-limit-service"
    ));

    // The Service: gRPC over h2c, and the metrics port.
    let svc = find(&objs, "Service", NAME);
    let sports = svc["spec"]["ports"].as_array().unwrap();
    assert_eq!(sports[0]["name"], "grpc");
    assert_eq!(sports[0]["port"], 8081);
    assert_eq!(sports[0]["targetPort"], "grpc");
    assert_eq!(sports[0]["appProtocol"], "kubernetes.io/h2c");
    assert_eq!(sports[1]["name"], "metrics");
    assert_eq!(sports[1]["targetPort"], "admin");
    assert_eq!(
        svc["spec"]["selector"]["app.kubernetes.io/component"],
        "rate-limit-service"
    );
    assert!(svc["spec"]["clusterIP"].is_null());

    let pdb = find(&objs, "PodDisruptionBudget", NAME);
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "rate-limit-service"
    );
    // Not rendered without their options.
    assert!(!objs.iter().any(|o| o["metadata"]["name"] == NAME
        && (o["kind"] == "NetworkPolicy" || o["kind"] == "ServiceMonitor")));
}

fn chart_app_version() -> String {
    let chart = std::fs::read_to_string(repo_root().join(CHART).join("Chart.yaml")).unwrap();
    let v: Value = serde_norway::from_str(&chart).unwrap();
    v["appVersion"].as_str().unwrap().to_string()
}

#[test]
fn rate_limit_service_options_network_policy_monitor_headless_single_replica() {
    let objs = objects(
        "rateLimitService.enabled=true,networkPolicy.enabled=true,serviceMonitor.enabled=true,\
         rateLimitService.service.headless=true,rateLimitService.replicas=1,\
         rateLimitService.podLabels.team=edge,rateLimitService.extraArgs={--redis-timeout=10ms}",
    );
    let np = find(&objs, "NetworkPolicy", NAME);
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let ports: Vec<&str> = np["spec"]["ingress"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_str().unwrap())
        .collect();
    assert_eq!(ports, ["grpc", "admin"]);
    let sm = find(&objs, "ServiceMonitor", NAME);
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(
        sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "rate-limit-service"
    );
    // The controller's ServiceMonitor does not select the rate limit service's Service.
    let controller_sm = find(&objs, "ServiceMonitor", "tollgate-controller");
    assert_eq!(
        controller_sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "controller"
    );
    assert_eq!(find(&objs, "Service", NAME)["spec"]["clusterIP"], "None");
    // One replica: no PodDisruptionBudget (it would block every drain) and no spread.
    assert!(
        !objs
            .iter()
            .any(|o| o["kind"] == "PodDisruptionBudget" && o["metadata"]["name"] == NAME)
    );
    let d = find(&objs, "Deployment", NAME);
    assert!(d["spec"]["template"]["spec"]["topologySpreadConstraints"].is_null());
    assert_eq!(d["spec"]["template"]["metadata"]["labels"]["team"], "edge");
    assert!(args(&container(&objs)).contains(&"--redis-timeout=10ms".to_string()));
}

/// Its image values work like the sidecar's: `imageRegistry` replaces the registry, a digest
/// wins over the tag, and its pull policy is its own.
#[test]
fn rate_limit_service_image_values() {
    let digest = format!("sha256:{}", "a".repeat(64));
    let c = container(&objects(&format!(
        "rateLimitService.enabled=true,imageRegistry=registry.example/platform,\
         rateLimitService.image.digest={digest},rateLimitService.image.pullPolicy=Never,\
         rateLimitService.logFormat=text"
    )));
    assert_eq!(
        c["image"],
        format!("registry.example/platform/tollgate-ratelimit@{digest}")
    );
    assert_eq!(c["imagePullPolicy"], "Never");
    assert!(args(&c).contains(&"--log-format=text".to_string()));
    let c = container(&objects(
        "rateLimitService.enabled=true,rateLimitService.image.repository=mirror.example/rls,\
         rateLimitService.image.tag=dev,sidecar.image.pullPolicy=Never",
    ));
    assert_eq!(c["image"], "mirror.example/rls:dev");
    assert_eq!(
        c["imagePullPolicy"], "IfNotPresent",
        "the sidecar's policy is not its own"
    );
}

/// The rate limit service gets what the controller's `--sidecar-redis-*` flags give injected
/// sidecars (`RedisConfig::env`, `mounts` and `volumes` in crates/controller/src/webhook).
#[test]
fn rate_limit_service_gets_the_redis_settings_of_injected_sidecars() {
    // Everything: TLS with a CA Secret, ACL user and password, client certificate, sentinels.
    let set = "rateLimitService.enabled=true,redis.url=redis://s1:26379\\,redis://s2:26379,\
               redis.sentinel.masterName=tg,redis.tls.enabled=true,redis.auth.username=tollgate,\
               redis.auth.secretName=redis-auth,redis.auth.secretKey=pw,\
               redis.tls.ca.secretName=redis-ca,redis.tls.clientCertSecretName=redis-client";
    let out = render(set);
    // What the controller passes on for injected sidecars.
    for flag in [
        "--sidecar-redis-url=rediss://s1:26379,rediss://s2:26379",
        "--sidecar-redis-sentinel=tg",
        "--sidecar-redis-username=tollgate",
        "--sidecar-redis-password-secret=redis-auth",
        "--sidecar-redis-password-key=pw",
        "--sidecar-redis-ca-secret=redis-ca",
        "--sidecar-redis-ca-key=ca.crt",
        "--sidecar-redis-client-cert-secret=redis-client",
    ] {
        assert!(out.contains(flag), "{flag} missing");
    }
    let objs = objects(set);
    let c = container(&objs);
    assert_eq!(
        env(&c),
        [
            ("TOLLGATE_REDIS_URL", "rediss://s1:26379,rediss://s2:26379"),
            ("TOLLGATE_REDIS_SENTINEL", "tg"),
            ("TOLLGATE_REDIS_USERNAME", "tollgate"),
            (
                "TOLLGATE_REDIS_PASSWORD_FILE",
                "/var/run/secrets/tollgate-redis/auth/password"
            ),
            (
                "TOLLGATE_REDIS_CA_FILE",
                "/var/run/secrets/tollgate-redis/ca/ca.crt"
            ),
            (
                "TOLLGATE_REDIS_CLIENT_CERT_FILE",
                "/var/run/secrets/tollgate-redis/client/tls.crt"
            ),
            (
                "TOLLGATE_REDIS_CLIENT_KEY_FILE",
                "/var/run/secrets/tollgate-redis/client/tls.key"
            ),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    // The Secrets reach it as read-only files from optional volumes, never as values.
    for (vol, dir) in [
        ("tollgate-redis-auth", "auth"),
        ("tollgate-redis-ca", "ca"),
        ("tollgate-redis-client", "client"),
    ] {
        assert_eq!(
            mount_path(&c, vol),
            Some(format!("/var/run/secrets/tollgate-redis/{dir}"))
        );
        assert_eq!(volume(&objs, vol)["secret"]["optional"], true, "{vol}");
    }
    assert_eq!(
        volume(&objs, "tollgate-redis-auth")["secret"]["items"],
        serde_json::json!([{"key": "pw", "path": "password"}])
    );
    assert_eq!(
        volume(&objs, "tollgate-redis-ca")["secret"]["items"],
        serde_json::json!([{"key": "ca.crt", "path": "ca.crt"}])
    );
    assert!(!out.contains("secretKeyRef"), "no secret as env value");

    // A Redis Cluster, and a CA from a ConfigMap.
    let objs = objects(
        "rateLimitService.enabled=true,redis.url=rediss://a:6379\\,rediss://b:6379,\
         redis.cluster=true,redis.tls.ca.configMapName=trust,redis.tls.ca.key=bundle.pem",
    );
    let c = container(&objs);
    assert_eq!(
        env(&c),
        [
            ("TOLLGATE_REDIS_URL", "rediss://a:6379,rediss://b:6379"),
            ("TOLLGATE_REDIS_CLUSTER", "true"),
            (
                "TOLLGATE_REDIS_CA_FILE",
                "/var/run/secrets/tollgate-redis/ca/ca.crt"
            ),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    let cm = &volume(&objs, "tollgate-redis-ca")["configMap"];
    assert_eq!(cm["name"], "trust");
    assert_eq!(cm["optional"], true);
    assert_eq!(
        cm["items"],
        serde_json::json!([{"key": "bundle.pem", "path": "ca.crt"}])
    );

    // The dev Redis: its URL only.
    let c = container(&objects(
        "rateLimitService.enabled=true,redis.dev.enabled=true",
    ));
    assert_eq!(
        env(&c),
        [(
            "TOLLGATE_REDIS_URL".to_string(),
            "redis://tollgate-redis.tollgate-system.svc:6379".to_string()
        )]
    );
}

#[test]
fn rate_limit_service_follows_stream_tls_off() {
    let objs = objects("rateLimitService.enabled=true,streamTLS.enabled=false");
    let c = container(&objs);
    let a = args(&c);
    assert!(
        a.contains(&"--controller=http://tollgate-controller.tollgate-system.svc:8090".into()),
        "{a:?}"
    );
    assert!(!a.iter().any(|x| x.starts_with("--controller-ca-file")));
    assert!(mount_path(&c, "controller-ca").is_none());
}

#[test]
fn rate_limit_service_settings_that_would_starve_it_of_rules_are_refused() {
    let refused: &[(&str, &str)] = &[
        (
            "rateLimitService.enabled=true,rateLimitService.adminPort=8081",
            "rateLimitService.port and rateLimitService.adminPort must differ",
        ),
        (
            "rateLimitService.enabled=true,controller.watchNamespaces={shop}",
            "which controller.watchNamespaces must then include",
        ),
        (
            "rateLimitService.enabled=true,controller.podSelector=tollgate.dev/inject=enabled",
            "do not match controller.podSelector",
        ),
        (
            "rateLimitService.enabled=true,controller.podSelector=team!=edge,rateLimitService.podLabels.team=edge",
            "do not match controller.podSelector",
        ),
        (
            "rateLimitService.enabled=true,rateLimitService.service.headless=true,rateLimitService.service.type=LoadBalancer",
            "rateLimitService.service.headless needs rateLimitService.service.type ClusterIP",
        ),
        ("rateLimitService.replicas=0", "/rateLimitService/replicas"),
        (
            "rateLimitService.logFormat=pretty",
            "/rateLimitService/logFormat",
        ),
        (
            "rateLimitService.extraArgs={redis-timeout}",
            "/rateLimitService/extraArgs/0",
        ),
    ];
    for (set, needle) in refused {
        let out = helm_offline(&["template", RELEASE, CHART, "-n", NS, "--set", set]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "--set {set} was accepted");
        assert!(
            err.contains(needle),
            "--set {set}: {needle:?} missing in: {err}"
        );
    }
    // Selectors the pods match are fine.
    for set in [
        "rateLimitService.enabled=true,controller.watchNamespaces={shop,tollgate-system}",
        "rateLimitService.enabled=true,controller.podSelector=tollgate.dev/inject=enabled,rateLimitService.podLabels.tollgate\\.dev/inject=enabled",
        "rateLimitService.enabled=true,controller.podSelector=app.kubernetes.io/instance==tollgate\\,!legacy\\,team!=core",
        "rateLimitService.enabled=true,controller.podSelector=tollgate.dev/control-plane",
    ] {
        render(set);
    }
}

#[test]
fn helm_lint_passes_with_the_rate_limit_service() {
    for set in [
        "rateLimitService.enabled=true",
        "rateLimitService.enabled=true,networkPolicy.enabled=true,serviceMonitor.enabled=true,redis.dev.enabled=true,rateLimitService.service.headless=true,tracing.otlpEndpoint=http://otel:4318",
        "rateLimitService.enabled=true,certManager.enabled=true,redis.url=rediss://r:6380,redis.auth.secretName=redis,streamTLS.enabled=false,rateLimitService.replicas=3",
    ] {
        let out = helm_offline(&["lint", CHART, "--strict", "--set", set]);
        assert!(
            out.status.success(),
            "helm lint --set {set:?}:\n{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
}

// === the cluster test ===

/// `helm install` with the option on: the API server accepts and stores every object (its
/// validation of the Deployment, probes, projected token, spread constraints included).
#[test]
fn chart_installs_the_rate_limit_service() {
    let cp = ControlPlane::start();
    let out = cp.helm(&[
        "install",
        RELEASE,
        CHART,
        "-n",
        NS,
        "--create-namespace",
        "--no-hooks",
        "--set",
        "rateLimitService.enabled=true,networkPolicy.enabled=true,redis.dev.enabled=true",
    ]);
    assert!(
        out.status.success(),
        "helm install: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let names = cp.ok(&[
        "-n",
        NS,
        "get",
        "sa,deploy,svc,pdb,networkpolicy",
        "-o",
        "name",
    ]);
    for want in [
        format!("serviceaccount/{NAME}"),
        format!("deployment.apps/{NAME}"),
        format!("service/{NAME}"),
        format!("poddisruptionbudget.policy/{NAME}"),
        format!("networkpolicy.networking.k8s.io/{NAME}"),
        "deployment.apps/tollgate-controller".to_string(),
    ] {
        assert!(
            names.lines().any(|l| l == want),
            "{want} not created:\n{names}"
        );
    }
    let d: Value =
        serde_json::from_str(&cp.ok(&["-n", NS, "get", "deployment", NAME, "-o", "json"])).unwrap();
    let spec = &d["spec"]["template"]["spec"];
    let image = spec["containers"][0]["image"].as_str().unwrap();
    assert!(image.contains("/tollgate-ratelimit:"), "{image}");
    assert!(
        spec["containers"][0]["args"][0]
            .as_str()
            .unwrap()
            .starts_with("--listen=")
    );
    assert_eq!(
        spec["volumes"][0]["projected"]["sources"][0]["serviceAccountToken"]["audience"],
        "tollgate"
    );
    let svc: Value =
        serde_json::from_str(&cp.ok(&["-n", NS, "get", "service", NAME, "-o", "json"])).unwrap();
    assert_eq!(svc["spec"]["ports"][0]["appProtocol"], "kubernetes.io/h2c");
    // The ServiceAccount may do nothing with the API.
    let can = cp.kubectl(&[
        "auth",
        "can-i",
        "--list",
        &format!("--as=system:serviceaccount:{NS}:{NAME}"),
    ]);
    let listed = text(&can.stdout);
    for forbidden in ["ratelimitpolicies", "secrets", "pods ", "leases"] {
        assert!(
            !listed.contains(forbidden),
            "{NAME} may act on {forbidden}:\n{listed}"
        );
    }
}
