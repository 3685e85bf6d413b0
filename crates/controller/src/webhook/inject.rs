//! Sidecar injection: decide whether a Pod gets the tollgate sidecar and build the JSON patch
//! that adds it. Pure functions of the Pod and an [`InjectConfig`]; no client, no I/O.
//!
//! ```text
//!  Pod (as the API server sends it) ──decide──▶ Skip(reason)            → no patch
//!                                        └────▶ Plan{upstream, rewrite} → patch():
//!     /metadata/annotations/tollgate.dev~1sidecar-version
//!     /spec/initContainers/-      tollgate-sidecar, restartPolicy: Always (native sidecar)
//!     /spec/volumes/-             tollgate-token (projected ServiceAccount token),
//!                                 tollgate-rules-cache (emptyDir for the last good rules)
//!     /spec/containers/i/ports/j/name (+ probes)   only with tollgate.dev/rewrite-port
//! ```

use std::collections::BTreeMap;
use std::fmt;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, ReplaceOperation, TestOperation};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, KeyToPath, ObjectFieldSelector, Pod, Probe, ProjectedVolumeSource,
    ResourceRequirements, SeccompProfile, SecretVolumeSource, SecurityContext,
    ServiceAccountTokenProjection, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

/// Pod label or annotation (and namespace label) that opts in (`enabled`) or out (`disabled`).
pub const INJECT: &str = "tollgate.dev/inject";
/// Pod annotation: the app's port (number or container port name) the sidecar forwards to.
pub const UPSTREAM_PORT: &str = "tollgate.dev/upstream-port";
/// Pod annotation: name of an app container port to hand over to the sidecar.
pub const REWRITE_PORT: &str = "tollgate.dev/rewrite-port";
/// Pod annotation: how long the app's containers keep serving after the pod is deleted (a
/// duration such as `5s`; `0s` turns it off), overriding `--sidecar-drain-delay`.
pub const DRAIN_DELAY: &str = "tollgate.dev/drain-delay";
/// Pod annotation written on injection: the sidecar's version.
pub const SIDECAR_VERSION: &str = "tollgate.dev/sidecar-version";
/// Pod annotation written on injection: which controller process injected the pod and with
/// which settings, `<start, Unix seconds>.<settings hash>` (see [`injector_id`]). During a
/// rollout an old replica still answers the webhook; the controller finds pods it injected
/// with outdated settings from this.
pub const INJECTED_BY: &str = "tollgate.dev/injected-by";
/// Pod annotation written on injection when app containers declare TCP ports besides the one
/// the sidecar forwards to: those ports (`name:port` or `port`, comma-separated) reach the app
/// without any limit. The controller turns it into a Warning Event on the pod.
pub const UNPROTECTED_PORTS: &str = "tollgate.dev/unprotected-ports";
/// Value of [`INJECT`] that opts in.
pub const ENABLED: &str = "enabled";
/// Value of [`INJECT`] that opts out; it wins over every opt-in.
pub const DISABLED: &str = "disabled";

/// Name of the injected container.
pub const SIDECAR_NAME: &str = "tollgate-sidecar";
/// Name of the `emptyDir` keeping the sidecar's last good rules across container restarts.
pub const RULES_CACHE_VOLUME: &str = "tollgate-rules-cache";
/// Where the rules cache volume is mounted.
pub const RULES_CACHE_DIR: &str = "/var/run/tollgate/cache";
/// Name of the projected token volume.
pub const TOKEN_VOLUME: &str = "tollgate-token";
/// Where the token volume is mounted; the sidecar's default `--token-file` is `<dir>/token`.
pub const TOKEN_DIR: &str = "/var/run/secrets/tollgate";
/// Container port name of the sidecar's listener when no port is rewritten.
pub const PORT_NAME: &str = "tollgate-http";
/// Container port name of the sidecar's admin endpoints.
pub const ADMIN_PORT_NAME: &str = "tollgate-admin";
/// UID/GID the sidecar runs as (distroless "nonroot").
pub const SIDECAR_UID: i64 = 65532;

// === InjectConfig ===

/// What to inject; built from the controller's `--sidecar-*` flags.
#[derive(Clone, Debug, PartialEq)]
pub struct InjectConfig {
    pub image: String,
    pub image_pull_policy: String,
    /// Written to the [`SIDECAR_VERSION`] annotation.
    pub version: String,
    pub listen_port: u16,
    pub admin_port: u16,
    pub controller_url: String,
    pub token_audience: String,
    pub token_expiration_seconds: i64,
    pub resources: ResourceRequirements,
    pub redis: Option<RedisConfig>,
    pub extra_args: Vec<String>,
    /// Seconds of `preStop` sleep given to app containers that have no `preStop` of their own;
    /// see [`drain_delay`].
    pub drain_delay_seconds: i64,
    /// PEM CA of an `https://` controller URL, given to the sidecar as `TOLLGATE_CONTROLLER_CA`
    /// (public material; set per review from the current certificate directory).
    pub controller_ca: Option<String>,
    /// Value of the [`INJECTED_BY`] annotation; none in tests and examples.
    pub injected_by: Option<String>,
}

/// `<started>.<hash>`: the process start (Unix seconds) and a hash of the settings that shape
/// the injected sidecar (everything but the per-review CA and this id).
pub fn injector_id(cfg: &InjectConfig, started: i64) -> String {
    use std::hash::{Hash, Hasher};
    let settings = InjectConfig {
        controller_ca: None,
        injected_by: None,
        ..cfg.clone()
    };
    // SipHash with fixed keys: the same settings give the same hash in every replica.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{settings:?}").hash(&mut h);
    format!("{started}.{:016x}", h.finish())
}

/// The parts of an [`INJECTED_BY`] value.
pub fn parse_injector_id(value: &str) -> Option<(i64, &str)> {
    let (started, hash) = value.split_once('.')?;
    Some((started.parse().ok()?, hash))
}

/// Redis settings passed to the sidecar. Secrets and certificates reach it as files from
/// volumes in the pod's own namespace, never as environment values or arguments.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RedisConfig {
    /// `redis://host:port` or `rediss://host:port` (or a comma-separated seed list with
    /// `cluster`), without a password.
    pub url: String,
    pub cluster: bool,
    /// Master name when `url` lists Redis Sentinels (`--redis-sentinel`).
    pub sentinel_master: Option<String>,
    /// Secret holding the sentinels' own password (their `requirepass`), mounted as a file
    /// (`--redis-sentinel-password-file`). TLS to the sentinels follows the master's: the same
    /// `rediss://` scheme, CA and client certificate.
    pub sentinel_password: Option<SecretKeyRef>,
    /// Redis ACL user.
    pub username: Option<String>,
    /// Secret holding the password, mounted as a file (`--redis-password-file`).
    pub password: Option<SecretKeyRef>,
    /// CA bundle the server certificate must chain to (`--redis-ca-file`).
    pub ca: Option<CaRef>,
    /// `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`) for mutual TLS.
    pub client_cert_secret: Option<String>,
}

/// A key of a Secret in the pod's own namespace.
#[derive(Clone, Debug, PartialEq)]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

/// Where the Redis CA bundle comes from (in the pod's own namespace).
#[derive(Clone, Debug, PartialEq)]
pub enum CaRef {
    Secret(SecretKeyRef),
    /// A ConfigMap (e.g. one distributed to every namespace by trust-manager).
    ConfigMap {
        name: String,
        key: String,
    },
}

/// Volume with the Redis password; mounted only into the sidecar.
pub const REDIS_AUTH_VOLUME: &str = "tollgate-redis-auth";
/// Volume with the Redis Sentinels' password; mounted only into the sidecar.
pub const REDIS_SENTINEL_AUTH_VOLUME: &str = "tollgate-redis-sentinel-auth";
/// Volume with the Redis CA bundle.
pub const REDIS_CA_VOLUME: &str = "tollgate-redis-ca";
/// Volume with the Redis client certificate and key.
pub const REDIS_CLIENT_VOLUME: &str = "tollgate-redis-client";
/// Where the Redis volumes are mounted (`auth/password`, `ca/ca.crt`, `client/tls.{crt,key}`).
pub const REDIS_DIR: &str = "/var/run/secrets/tollgate-redis";

impl InjectConfig {
    /// Rejects settings that would produce broken pods.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.image.trim().is_empty(), "--sidecar-image is empty");
        anyhow::ensure!(
            self.listen_port != 0 && self.admin_port != 0 && self.listen_port != self.admin_port,
            "--sidecar-port ({}) and --sidecar-admin-port ({}) must be different non-zero ports",
            self.listen_port,
            self.admin_port
        );
        anyhow::ensure!(
            self.controller_url.starts_with("http://")
                || self.controller_url.starts_with("https://"),
            "--sidecar-controller-url {:?} must be an http:// or https:// URL",
            self.controller_url
        );
        if let Some(redis) = &self.redis {
            redis.url_env()?;
            anyhow::ensure!(
                redis.sentinel_password.is_none() || redis.sentinel_master.is_some(),
                "--sidecar-redis-sentinel-password-secret needs --sidecar-redis-sentinel"
            );
        }
        Ok(())
    }

    /// A configuration for tests and examples.
    #[allow(clippy::expect_used, reason = "a literal that always parses")]
    pub fn example() -> InjectConfig {
        InjectConfig {
            image: "ghcr.io/tollgate-dev/tollgate-sidecar:0.1.0".into(),
            image_pull_policy: "IfNotPresent".into(),
            version: "0.1.0".into(),
            listen_port: 8081,
            admin_port: 9091,
            controller_url: "http://tollgate-controller.tollgate-system.svc:8090".into(),
            token_audience: "tollgate".into(),
            token_expiration_seconds: 3600,
            resources: serde_json::from_value(serde_json::json!({
                "requests": {"cpu": "50m", "memory": "32Mi"},
                "limits": {"memory": "128Mi"}
            }))
            .expect("resources"),
            redis: None,
            extra_args: Vec::new(),
            drain_delay_seconds: 5,
            controller_ca: None,
            injected_by: None,
        }
    }
}

impl RedisConfig {
    /// The value of `TOLLGATE_REDIS_URL`: the URL(s), checked. A password belongs in a
    /// Secret (`password`), not in the URL, which ends up in the pod spec for everyone who can
    /// read pods; messages never repeat a URL that has one.
    pub fn url_env(&self) -> anyhow::Result<String> {
        let urls: Vec<&str> = if self.cluster || self.sentinel_master.is_some() {
            self.url.split(',').map(str::trim).collect()
        } else {
            vec![self.url.trim()]
        };
        let mut out = Vec::with_capacity(urls.len());
        for url in urls {
            let Some((scheme, rest)) = url.split_once("://") else {
                anyhow::bail!("a Redis URL has no scheme (redis:// or rediss://)");
            };
            anyhow::ensure!(
                scheme == "redis" || scheme == "rediss",
                "a Redis URL must start with redis:// or rediss://, not {scheme}://"
            );
            let userinfo = rest.rsplit_once('@').map_or("", |(u, _)| u);
            anyhow::ensure!(
                !userinfo.contains(':'),
                "a Redis URL contains a password; put it in a Secret \
                 (--sidecar-redis-password-secret, chart value redis.auth.secretName) instead"
            );
            anyhow::ensure!(
                scheme == "rediss" || (self.ca.is_none() && self.client_cert_secret.is_none()),
                "a Redis CA or client certificate needs rediss:// URLs (redis.tls.enabled)"
            );
            out.push(url.to_string());
        }
        Ok(out.join(","))
    }

    /// The sidecar's environment for Redis (`TOLLGATE_REDIS_*`, each also a sidecar flag).
    fn env(&self) -> Vec<EnvVar> {
        let var = |name: &str, value: String| EnvVar {
            name: name.to_string(),
            value: Some(value),
            ..Default::default()
        };
        let mut env = vec![var(
            "TOLLGATE_REDIS_URL",
            self.url_env().unwrap_or_else(|_| self.url.clone()),
        )];
        if self.cluster {
            env.push(var("TOLLGATE_REDIS_CLUSTER", "true".into()));
        }
        if let Some(master) = &self.sentinel_master {
            env.push(var("TOLLGATE_REDIS_SENTINEL", master.clone()));
        }
        if let Some(user) = &self.username {
            env.push(var("TOLLGATE_REDIS_USERNAME", user.clone()));
        }
        if self.password.is_some() {
            env.push(var(
                "TOLLGATE_REDIS_PASSWORD_FILE",
                format!("{REDIS_DIR}/auth/password"),
            ));
        }
        if self.sentinel_password.is_some() {
            env.push(var(
                "TOLLGATE_REDIS_SENTINEL_PASSWORD_FILE",
                format!("{REDIS_DIR}/sentinel-auth/password"),
            ));
        }
        if self.ca.is_some() {
            env.push(var(
                "TOLLGATE_REDIS_CA_FILE",
                format!("{REDIS_DIR}/ca/ca.crt"),
            ));
        }
        if self.client_cert_secret.is_some() {
            env.push(var(
                "TOLLGATE_REDIS_CLIENT_CERT_FILE",
                format!("{REDIS_DIR}/client/tls.crt"),
            ));
            env.push(var(
                "TOLLGATE_REDIS_CLIENT_KEY_FILE",
                format!("{REDIS_DIR}/client/tls.key"),
            ));
        }
        env
    }

    /// Read-only mounts of the Redis volumes into the sidecar.
    fn mounts(&self) -> Vec<VolumeMount> {
        let mount = |name: &str, dir: &str| VolumeMount {
            name: name.to_string(),
            mount_path: format!("{REDIS_DIR}/{dir}"),
            read_only: Some(true),
            ..Default::default()
        };
        let mut m = Vec::new();
        if self.password.is_some() {
            m.push(mount(REDIS_AUTH_VOLUME, "auth"));
        }
        if self.sentinel_password.is_some() {
            m.push(mount(REDIS_SENTINEL_AUTH_VOLUME, "sentinel-auth"));
        }
        if self.ca.is_some() {
            m.push(mount(REDIS_CA_VOLUME, "ca"));
        }
        if self.client_cert_secret.is_some() {
            m.push(mount(REDIS_CLIENT_VOLUME, "client"));
        }
        m
    }

    /// The Redis volumes. All are `optional`: a Secret or ConfigMap missing from the pod's
    /// namespace must not keep the app from starting. The sidecar then cannot authenticate
    /// (or verify the server) and each rule's failureMode applies; it never falls back to no
    /// password or to the system roots.
    fn volumes(&self) -> Vec<Volume> {
        let items = |key: &str, path: &str| {
            Some(vec![KeyToPath {
                key: key.to_string(),
                path: path.to_string(),
                ..Default::default()
            }])
        };
        let secret = |name: &str, items: Option<Vec<KeyToPath>>| SecretVolumeSource {
            secret_name: Some(name.to_string()),
            items,
            optional: Some(true),
            ..Default::default()
        };
        let mut v = Vec::new();
        if let Some(p) = &self.password {
            v.push(Volume {
                name: REDIS_AUTH_VOLUME.to_string(),
                secret: Some(secret(&p.name, items(&p.key, "password"))),
                ..Default::default()
            });
        }
        if let Some(p) = &self.sentinel_password {
            v.push(Volume {
                name: REDIS_SENTINEL_AUTH_VOLUME.to_string(),
                secret: Some(secret(&p.name, items(&p.key, "password"))),
                ..Default::default()
            });
        }
        match &self.ca {
            Some(CaRef::Secret(s)) => v.push(Volume {
                name: REDIS_CA_VOLUME.to_string(),
                secret: Some(secret(&s.name, items(&s.key, "ca.crt"))),
                ..Default::default()
            }),
            Some(CaRef::ConfigMap { name, key }) => v.push(Volume {
                name: REDIS_CA_VOLUME.to_string(),
                config_map: Some(ConfigMapVolumeSource {
                    name: name.clone(),
                    items: items(key, "ca.crt"),
                    optional: Some(true),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            None => {}
        }
        if let Some(name) = &self.client_cert_secret {
            v.push(Volume {
                name: REDIS_CLIENT_VOLUME.to_string(),
                secret: Some(secret(name, None)),
                ..Default::default()
            });
        }
        v
    }
}

// === decisions ===

/// Why a pod is left alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// `tollgate.dev/inject: disabled` on the pod.
    OptedOut,
    /// Neither the pod nor (for this webhook entry) its namespace opted in.
    NotOptedIn,
    /// A container named `tollgate-sidecar` is already there.
    AlreadyInjected,
    /// `hostNetwork: true`: the sidecar's ports would be opened on the node.
    HostNetwork,
    /// No `tollgate.dev/upstream-port` annotation and no container port to forward to.
    NoUpstreamPort,
    /// An annotation is malformed or names something that is not there.
    BadAnnotation(String),
    /// An app container already declares one of the sidecar's ports.
    PortConflict(u16),
}

impl Skip {
    /// Short label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Skip::OptedOut => "opted_out",
            Skip::NotOptedIn => "not_opted_in",
            Skip::AlreadyInjected => "already_injected",
            Skip::HostNetwork => "host_network",
            Skip::NoUpstreamPort => "no_upstream_port",
            Skip::BadAnnotation(_) => "bad_annotation",
            Skip::PortConflict(_) => "port_conflict",
        }
    }

    /// Whether the pod's owner asked for injection and should be told why it did not happen
    /// (returned as an admission warning, which kubectl prints).
    pub fn warns(&self) -> bool {
        !matches!(
            self,
            Skip::OptedOut | Skip::NotOptedIn | Skip::AlreadyInjected
        )
    }
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skip::OptedOut => write!(f, "the pod has {INJECT}: {DISABLED}"),
            Skip::NotOptedIn => write!(
                f,
                "neither the pod nor its namespace has {INJECT}: {ENABLED}"
            ),
            Skip::AlreadyInjected => write!(f, "the pod already has a {SIDECAR_NAME} container"),
            Skip::HostNetwork => write!(f, "pods with hostNetwork: true are not injected"),
            Skip::NoUpstreamPort => write!(
                f,
                "no container port to forward to: declare one or set the {UPSTREAM_PORT} annotation"
            ),
            Skip::BadAnnotation(m) => f.write_str(m),
            Skip::PortConflict(p) => write!(
                f,
                "an app container already uses port {p}, which the sidecar needs"
            ),
        }
    }
}

/// A named container port handed over to the sidecar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortRewrite {
    /// The name the Service targets; the sidecar's listener takes it.
    pub name: String,
    /// The app's port gets this name instead.
    pub renamed_to: String,
    /// Index of the app container and of the port in it.
    pub container: usize,
    pub port: usize,
}

/// What will be injected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The app port the sidecar forwards to (`--upstream http://127.0.0.1:<port>`).
    pub upstream_port: u16,
    pub rewrite: Option<PortRewrite>,
    /// Seconds of `preStop` sleep for app containers without a `preStop`; 0 for none.
    pub drain_delay_seconds: i64,
    /// Declared TCP ports of app containers other than `upstream_port` (`name:port` or
    /// `port`): traffic to them bypasses the sidecar.
    pub unprotected_ports: Vec<String>,
}

impl Plan {
    /// The admission warning naming the ports that bypass the sidecar, if any.
    pub fn unprotected_ports_warning(&self) -> Option<String> {
        if self.unprotected_ports.is_empty() {
            return None;
        }
        Some(format!(
            "tollgate: only port {} is behind the rate-limiting sidecar; traffic to {} reaches \
             the app without limits (see docs/install.md, \"Pods with several ports\")",
            self.upstream_port,
            self.unprotected_ports.join(", ")
        ))
    }
}

/// Reads an opt-in/out value from the pod's annotations and labels.
fn pod_setting(pod: &Pod) -> Option<&str> {
    let a = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|m| m.get(INJECT))
        .map(String::as_str);
    let l = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|m| m.get(INJECT))
        .map(String::as_str);
    // "disabled" on either wins; otherwise any "enabled".
    if a == Some(DISABLED) || l == Some(DISABLED) {
        Some(DISABLED)
    } else if a == Some(ENABLED) || l == Some(ENABLED) {
        Some(ENABLED)
    } else {
        None
    }
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|m| m.get(key))
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
}

/// Decides whether and how to inject. `namespace_opted_in` is true when the call came
/// through the webhook entry whose `namespaceSelector` requires `tollgate.dev/inject: enabled`.
pub fn decide(pod: &Pod, namespace_opted_in: bool, cfg: &InjectConfig) -> Result<Plan, Skip> {
    match pod_setting(pod) {
        Some(DISABLED) => return Err(Skip::OptedOut),
        Some(_) => {}
        None if namespace_opted_in => {}
        None => return Err(Skip::NotOptedIn),
    }
    let spec = pod.spec.as_ref().ok_or(Skip::NoUpstreamPort)?;
    let already = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .any(|c| c.name == SIDECAR_NAME);
    if already {
        return Err(Skip::AlreadyInjected);
    }
    if spec.host_network == Some(true) {
        return Err(Skip::HostNetwork);
    }

    let rewrite = match annotation(pod, REWRITE_PORT) {
        None => None,
        Some(name) => Some(plan_rewrite(spec, name)?),
    };
    let upstream_port = match annotation(pod, UPSTREAM_PORT) {
        Some(v) => resolve_port(spec, v).ok_or_else(|| {
            Skip::BadAnnotation(format!(
                "{UPSTREAM_PORT}: {v:?} is neither a port number nor the name of a container port"
            ))
        })?,
        None => match &rewrite {
            // plan_rewrite found this port in this container, so the lookup cannot miss.
            Some(r) => spec
                .containers
                .get(r.container)
                .and_then(|c| c.ports.as_ref())
                .and_then(|ports| ports.get(r.port))
                .map_or(0, port_number),
            None => spec
                .containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
                .map(port_number)
                .ok_or(Skip::NoUpstreamPort)?,
        },
    };
    for taken in [cfg.listen_port, cfg.admin_port] {
        let clash = taken == upstream_port
            || spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
                .flat_map(|c| c.ports.iter().flatten())
                .any(|p| p.container_port == i32::from(taken));
        if clash {
            return Err(Skip::PortConflict(taken));
        }
    }
    Ok(Plan {
        upstream_port,
        rewrite,
        drain_delay_seconds: drain_delay(pod, spec, cfg)?,
        unprotected_ports: unprotected_ports(spec, upstream_port),
    })
}

/// The app containers' declared TCP ports other than the one the sidecar forwards to. Only
/// declared ports are known here; an app may listen on more.
fn unprotected_ports(spec: &k8s_openapi::api::core::v1::PodSpec, upstream: u16) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let tcp = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
        .filter(|p| port_number(p) != upstream);
    for p in tcp {
        let label = match &p.name {
            Some(name) if !name.is_empty() => format!("{name}:{}", p.container_port),
            _ => p.container_port.to_string(),
        };
        if !out.contains(&label) {
            out.push(label);
        }
    }
    out
}

/// Why app containers get a `preStop` sleep: a deleted pod is taken out of Service endpoints
/// while the kubelet already stops its containers, and kube-proxy, ingress controllers and
/// load balancers notice only after a moment. A native sidecar stops after the app, so an app
/// that exits at SIGTERM would leave the sidecar answering 502 for requests still routed to
/// the pod. The sleep keeps the app serving until the routes are gone; the sidecar then drains
/// last. At most half the pod's grace period, so the app still has time to stop.
fn drain_delay(
    pod: &Pod,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    cfg: &InjectConfig,
) -> Result<i64, Skip> {
    let wanted = match annotation(pod, DRAIN_DELAY) {
        None => cfg.drain_delay_seconds,
        Some(v) => tollgate_crd::duration::parse_flag(v)
            .map(|d| d.as_secs() as i64)
            .map_err(|e| Skip::BadAnnotation(format!("{DRAIN_DELAY}: {e}")))?,
    };
    let grace = spec.termination_grace_period_seconds.unwrap_or(30);
    Ok(wanted.min(grace / 2).max(0))
}

fn port_number(p: &ContainerPort) -> u16 {
    u16::try_from(p.container_port).unwrap_or(0)
}

/// A port number, or the name of a port of an app container.
fn resolve_port(spec: &k8s_openapi::api::core::v1::PodSpec, v: &str) -> Option<u16> {
    if let Ok(n) = v.parse::<u16>() {
        return (n != 0).then_some(n);
    }
    spec.containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(v))
        .map(port_number)
        .filter(|n| *n != 0)
}

fn plan_rewrite(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    name: &str,
) -> Result<PortRewrite, Skip> {
    let found = spec.containers.iter().enumerate().find_map(|(ci, c)| {
        c.ports
            .iter()
            .flatten()
            .position(|p| p.name.as_deref() == Some(name))
            .map(|pi| (ci, pi))
    });
    let Some((container, port)) = found else {
        return Err(Skip::BadAnnotation(format!(
            "{REWRITE_PORT}: no app container has a port named {name:?}"
        )));
    };
    let renamed_to = renamed_port(name);
    let taken = spec.containers[container]
        .ports
        .iter()
        .flatten()
        .any(|p| p.name.as_deref() == Some(renamed_to.as_str()));
    if taken || renamed_to == PORT_NAME || renamed_to == ADMIN_PORT_NAME || name == ADMIN_PORT_NAME
    {
        return Err(Skip::BadAnnotation(format!(
            "{REWRITE_PORT}: cannot rename port {name:?} to {renamed_to:?}: the name is taken"
        )));
    }
    Ok(PortRewrite {
        name: name.to_string(),
        renamed_to,
        container,
        port,
    })
}

/// The new name of a rewritten app port: `app-<name>`, cut to the 15 characters a port name
/// may have (without a trailing `-`).
pub fn renamed_port(name: &str) -> String {
    let mut s: String = format!("app-{name}").chars().take(15).collect();
    while s.ends_with('-') {
        s.pop();
    }
    s
}

// === the sidecar ===

/// The sidecar container for a plan.
pub fn sidecar_container(cfg: &InjectConfig, plan: &Plan) -> Container {
    let mut args = vec![
        format!("--listen=0.0.0.0:{}", cfg.listen_port),
        format!("--upstream=http://127.0.0.1:{}", plan.upstream_port),
        format!("--admin=0.0.0.0:{}", cfg.admin_port),
        format!("--controller={}", cfg.controller_url),
        format!("--token-file={TOKEN_DIR}/token"),
        format!("--rules-cache={RULES_CACHE_DIR}/rules.json"),
    ];
    args.extend(cfg.extra_args.iter().cloned());

    let (env, mounts) = sidecar_env_and_mounts(cfg);
    let listen_name = plan
        .rewrite
        .as_ref()
        .map(|r| r.name.clone())
        .unwrap_or_else(|| PORT_NAME.to_string());

    Container {
        name: SIDECAR_NAME.to_string(),
        image: Some(cfg.image.clone()),
        image_pull_policy: Some(cfg.image_pull_policy.clone()),
        args: Some(args),
        env: Some(env),
        ports: Some(vec![
            ContainerPort {
                name: Some(listen_name),
                container_port: i32::from(cfg.listen_port),
                protocol: Some("TCP".to_string()),
                ..Default::default()
            },
            ContainerPort {
                name: Some(ADMIN_PORT_NAME.to_string()),
                container_port: i32::from(cfg.admin_port),
                protocol: Some("TCP".to_string()),
                ..Default::default()
            },
        ]),
        // A native sidecar: starts before the app containers, stops after them (k8s >= 1.29).
        restart_policy: Some("Always".to_string()),
        resources: Some(cfg.resources.clone()),
        security_context: Some(restricted_security_context()),
        startup_probe: Some(admin_probe("/healthz", 1, 60)),
        liveness_probe: Some(admin_probe("/healthz", 10, 3)),
        readiness_probe: Some(admin_probe("/readyz", 5, 3)),
        volume_mounts: Some(mounts),
        termination_message_policy: Some("FallbackToLogsOnError".to_string()),
        ..Default::default()
    }
}

/// The sidecar's environment (its pod's name and namespace, the controller's CA, Redis
/// credentials) and the mounts it reads: the stream token, the rules cache, Redis secrets.
fn sidecar_env_and_mounts(cfg: &InjectConfig) -> (Vec<EnvVar>, Vec<VolumeMount>) {
    let field_env = |name: &str, path: &str| EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut env = vec![
        field_env("TOLLGATE_POD_NAME", "metadata.name"),
        field_env("TOLLGATE_POD_NAMESPACE", "metadata.namespace"),
    ];
    if let Some(ca) = &cfg.controller_ca {
        env.push(EnvVar {
            name: "TOLLGATE_CONTROLLER_CA".into(),
            value: Some(ca.clone()),
            ..Default::default()
        });
    }
    let mut mounts = vec![
        VolumeMount {
            name: TOKEN_VOLUME.to_string(),
            mount_path: TOKEN_DIR.to_string(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: RULES_CACHE_VOLUME.to_string(),
            mount_path: RULES_CACHE_DIR.to_string(),
            ..Default::default()
        },
    ];
    if let Some(redis) = &cfg.redis {
        env.extend(redis.env());
        mounts.extend(redis.mounts());
    }
    (env, mounts)
}

/// An HTTP probe of the sidecar's admin port.
fn admin_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String(ADMIN_PORT_NAME.to_string()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(1),
        ..Default::default()
    }
}

/// What the restricted Pod Security Standard asks of a container: non-root, read-only root,
/// no privilege escalation, no capabilities, the runtime's seccomp profile.
fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(SIDECAR_UID),
        run_as_group: Some(SIDECAR_UID),
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            ..Default::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_string(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The projected ServiceAccount token volume the sidecar presents to the controller.
pub fn token_volume(cfg: &InjectConfig) -> Volume {
    Volume {
        name: TOKEN_VOLUME.to_string(),
        projected: Some(ProjectedVolumeSource {
            default_mode: Some(0o444),
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(cfg.token_audience.clone()),
                    expiration_seconds: Some(cfg.token_expiration_seconds),
                    path: "token".to_string(),
                }),
                ..Default::default()
            }]),
        }),
        ..Default::default()
    }
}

/// The sidecar's rules cache: an `emptyDir` outlives container restarts (a sidecar restarted
/// while the controller is away starts from it), not the pod. A rule set is far below the limit.
pub fn rules_cache_volume() -> Volume {
    Volume {
        name: RULES_CACHE_VOLUME.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity("16Mi".to_string())),
            ..Default::default()
        }),
        ..Default::default()
    }
}

// === the patch ===

/// A Kubernetes object as JSON. Their types serialize to JSON whatever their content (string
/// map keys, no non-finite floats), so this cannot fail.
#[allow(
    clippy::expect_used,
    reason = "k8s-openapi types always serialize to JSON"
)]
fn to_json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("a k8s-openapi object serializes to JSON")
}

fn ptr<'a>(tokens: impl IntoIterator<Item = &'a str>) -> PointerBuf {
    PointerBuf::from_tokens(tokens)
}

fn add(path: PointerBuf, value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation { path, value })
}

/// The JSON patch for a plan. `raw` is the pod exactly as the API server sent it: parents
/// (`annotations`, `initContainers`, `volumes`) are created when they are absent there.
pub fn patch(raw: &Value, pod: &Pod, cfg: &InjectConfig, plan: &Plan) -> Patch {
    let mut ops = Vec::new();

    let mut annotations = BTreeMap::new();
    annotations.insert(SIDECAR_VERSION, cfg.version.clone());
    if let Some(id) = &cfg.injected_by {
        annotations.insert(INJECTED_BY, id.clone());
    }
    if !plan.unprotected_ports.is_empty() {
        annotations.insert(UNPROTECTED_PORTS, plan.unprotected_ports.join(","));
    }
    if present(raw, "/metadata/annotations") {
        for (key, value) in annotations {
            ops.push(add(
                ptr(["metadata", "annotations", key]),
                Value::String(value),
            ));
        }
    } else {
        ops.push(add(
            ptr(["metadata", "annotations"]),
            serde_json::json!(annotations),
        ));
    }

    if let Some(r) = &plan.rewrite {
        rename_port_ops(pod, r, &mut ops);
    }
    if plan.drain_delay_seconds > 0 {
        drain_delay_ops(raw, pod, plan.drain_delay_seconds, &mut ops);
    }

    // A projected ServiceAccount token is only valid with a serviceAccountName. The
    // ServiceAccount admission plugin sets it to "default" before webhooks run; where that
    // plugin is off, set the same value here so the patched pod stays valid.
    let sa = raw
        .pointer("/spec/serviceAccountName")
        .and_then(Value::as_str);
    if sa.is_none_or(str::is_empty) {
        ops.push(add(
            ptr(["spec", "serviceAccountName"]),
            Value::String("default".to_string()),
        ));
    }
    let sidecar = to_json(&sidecar_container(cfg, plan));
    if present(raw, "/spec/initContainers") {
        ops.push(add(ptr(["spec", "initContainers", "-"]), sidecar));
    } else {
        ops.push(add(
            ptr(["spec", "initContainers"]),
            Value::Array(vec![sidecar]),
        ));
    }
    let mut volumes = vec![token_volume(cfg), rules_cache_volume()];
    if let Some(redis) = &cfg.redis {
        volumes.extend(redis.volumes());
    }
    let volumes: Vec<Value> = volumes.iter().map(to_json).collect();
    if present(raw, "/spec/volumes") {
        for v in volumes {
            ops.push(add(ptr(["spec", "volumes", "-"]), v));
        }
    } else {
        ops.push(add(ptr(["spec", "volumes"]), Value::Array(volumes)));
    }
    Patch(ops)
}

/// Renames the app port the sidecar takes over, and every probe and lifecycle hook of its
/// container that names it, so they keep reaching the app.
fn rename_port_ops(pod: &Pod, r: &PortRewrite, ops: &mut Vec<PatchOperation>) {
    let ci = r.container.to_string();
    let pi = r.port.to_string();
    // Guard against a concurrent change of the list: the patch fails instead of renaming
    // another port.
    ops.push(PatchOperation::Test(TestOperation {
        path: ptr(["spec", "containers", &ci, "ports", &pi, "name"]),
        value: Value::String(r.name.clone()),
    }));
    ops.push(PatchOperation::Replace(ReplaceOperation {
        path: ptr(["spec", "containers", &ci, "ports", &pi, "name"]),
        value: Value::String(r.renamed_to.clone()),
    }));
    // Probes and lifecycle hooks of that container that refer to the port by name.
    if let Some(c) = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.get(r.container))
    {
        for (field, probe) in [
            ("livenessProbe", &c.liveness_probe),
            ("readinessProbe", &c.readiness_probe),
            ("startupProbe", &c.startup_probe),
        ] {
            let Some(probe) = probe else { continue };
            let http = probe.http_get.as_ref().map(|h| &h.port);
            let tcp = probe.tcp_socket.as_ref().map(|t| &t.port);
            for (handler, port) in [("httpGet", http), ("tcpSocket", tcp)] {
                if port == Some(&IntOrString::String(r.name.clone())) {
                    ops.push(PatchOperation::Replace(ReplaceOperation {
                        path: ptr(["spec", "containers", &ci, field, handler, "port"]),
                        value: Value::String(r.renamed_to.clone()),
                    }));
                }
            }
        }
        if let Some(lc) = &c.lifecycle {
            for (hook, handler) in [("postStart", &lc.post_start), ("preStop", &lc.pre_stop)] {
                let Some(h) = handler else { continue };
                let http = h.http_get.as_ref().map(|h| &h.port);
                let tcp = h.tcp_socket.as_ref().map(|t| &t.port);
                for (kind, port) in [("httpGet", http), ("tcpSocket", tcp)] {
                    if port == Some(&IntOrString::String(r.name.clone())) {
                        ops.push(PatchOperation::Replace(ReplaceOperation {
                            path: ptr(["spec", "containers", &ci, "lifecycle", hook, kind, "port"]),
                            value: Value::String(r.renamed_to.clone()),
                        }));
                    }
                }
            }
        }
    }
}

/// A `preStop` sleep for app containers without one, so endpoints drop the pod before the app
/// stops taking requests.
fn drain_delay_ops(raw: &Value, pod: &Pod, seconds: i64, ops: &mut Vec<PatchOperation>) {
    let sleep = serde_json::json!({"sleep": {"seconds": seconds}});
    for (i, c) in pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .enumerate()
    {
        let lifecycle = c.lifecycle.as_ref();
        if lifecycle.is_some_and(|l| l.pre_stop.is_some()) {
            continue; // the app drains its own way
        }
        let ci = i.to_string();
        if present(raw, &format!("/spec/containers/{i}/lifecycle")) {
            ops.push(add(
                ptr(["spec", "containers", &ci, "lifecycle", "preStop"]),
                sleep.clone(),
            ));
        } else {
            ops.push(add(
                ptr(["spec", "containers", &ci, "lifecycle"]),
                serde_json::json!({ "preStop": sleep }),
            ));
        }
    }
}

/// Whether `raw` (the pod as the API server sent it) has a non-null value at `pointer`.
fn present(raw: &Value, pointer: &str) -> bool {
    raw.pointer(pointer).is_some_and(|v| !v.is_null())
}

/// The outcome of one pod admission.
#[derive(Debug)]
pub enum Outcome {
    /// The patch, and admission warnings for the pod's owner.
    Injected(Patch, Vec<String>),
    Skipped(Skip),
}

/// Decides and builds the patch for a pod given as the API server's JSON.
pub fn inject(
    raw: &Value,
    namespace_opted_in: bool,
    cfg: &InjectConfig,
) -> Result<Outcome, serde_json::Error> {
    let pod: Pod = serde_json::from_value(raw.clone())?;
    Ok(match decide(&pod, namespace_opted_in, cfg) {
        Ok(plan) => Outcome::Injected(
            patch(raw, &pod, cfg, &plan),
            plan.unprotected_ports_warning().into_iter().collect(),
        ),
        Err(skip) => Outcome::Skipped(skip),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: Value) -> (Value, Pod) {
        let p: Pod = serde_json::from_value(v.clone()).unwrap();
        (v, p)
    }

    fn app(ports: Value) -> Value {
        json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"a","namespace":"shop"},
               "spec":{"containers":[{"name":"app","image":"app","ports":ports}]}})
    }

    #[test]
    fn opt_in_rules() {
        let cfg = InjectConfig::example();
        let (_, p) = pod(app(json!([{"containerPort":8080}])));
        assert_eq!(decide(&p, false, &cfg), Err(Skip::NotOptedIn));
        assert!(decide(&p, true, &cfg).is_ok());
        for (where_, val, ns, ok) in [
            ("annotations", ENABLED, false, true),
            ("labels", ENABLED, false, true),
            ("annotations", DISABLED, true, false),
            ("labels", DISABLED, true, false),
            ("annotations", "yes", false, false),
        ] {
            let mut v = app(json!([{"containerPort":8080}]));
            v["metadata"][where_] = json!({INJECT: val});
            let (_, p) = pod(v);
            assert_eq!(decide(&p, ns, &cfg).is_ok(), ok, "{where_} {val} ns={ns}");
        }
        // Disabled annotation beats an enabled label.
        let mut v = app(json!([{"containerPort":8080}]));
        v["metadata"]["labels"] = json!({INJECT: ENABLED});
        v["metadata"]["annotations"] = json!({INJECT: DISABLED});
        assert_eq!(decide(&pod(v).1, true, &cfg), Err(Skip::OptedOut));
    }

    #[test]
    fn upstream_port_resolution() {
        let cfg = InjectConfig::example();
        let ports =
            json!([{"containerPort":9000,"protocol":"UDP"},{"name":"web","containerPort":8080}]);
        let (_, p) = pod(app(ports.clone()));
        assert_eq!(decide(&p, true, &cfg).unwrap().upstream_port, 8080);
        let mut v = app(ports.clone());
        v["metadata"]["annotations"] = json!({UPSTREAM_PORT: "3000"});
        assert_eq!(decide(&pod(v).1, true, &cfg).unwrap().upstream_port, 3000);
        let mut v = app(ports.clone());
        v["metadata"]["annotations"] = json!({UPSTREAM_PORT: "web"});
        assert_eq!(decide(&pod(v).1, true, &cfg).unwrap().upstream_port, 8080);
        let mut v = app(ports);
        v["metadata"]["annotations"] = json!({UPSTREAM_PORT: "nope"});
        assert!(matches!(
            decide(&pod(v).1, true, &cfg),
            Err(Skip::BadAnnotation(_))
        ));
        let (_, p) = pod(app(json!([])));
        assert_eq!(decide(&p, true, &cfg), Err(Skip::NoUpstreamPort));
        let (_, p) = pod(app(json!([{"containerPort":8081}])));
        assert_eq!(decide(&p, true, &cfg), Err(Skip::PortConflict(8081)));
        let mut v = app(json!([{"containerPort":8080}]));
        v["spec"]["hostNetwork"] = json!(true);
        assert_eq!(decide(&pod(v).1, true, &cfg), Err(Skip::HostNetwork));
    }

    #[test]
    fn app_containers_get_a_drain_sleep_unless_they_drain_their_own_way() {
        let cfg = InjectConfig::example();
        let delay = |v: Value| decide(&pod(v).1, true, &cfg).map(|p| p.drain_delay_seconds);
        let ports = json!([{"containerPort":8080}]);
        assert_eq!(delay(app(ports.clone())), Ok(5));
        let mut v = app(ports.clone());
        v["metadata"]["annotations"] = json!({DRAIN_DELAY: "12s"});
        assert_eq!(delay(v.clone()), Ok(12));
        // At most half the grace period, so the app still gets time to stop.
        v["spec"]["terminationGracePeriodSeconds"] = json!(10);
        assert_eq!(delay(v), Ok(5));
        let mut v = app(ports.clone());
        v["metadata"]["annotations"] = json!({DRAIN_DELAY: "0s"});
        assert_eq!(delay(v), Ok(0));
        let mut v = app(ports.clone());
        v["metadata"]["annotations"] = json!({DRAIN_DELAY: "soon"});
        assert!(matches!(delay(v), Err(Skip::BadAnnotation(m)) if m.contains(DRAIN_DELAY)));

        // Two containers: one with its own preStop (kept), one with a lifecycle but no preStop.
        let mut v = app(ports);
        v["spec"]["containers"][0]["lifecycle"] = json!({"preStop":{"exec":{"command":["drain"]}}});
        v["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name":"worker","image":"w","lifecycle":{"postStart":{"exec":{"command":["x"]}}}}));
        let (raw, p) = pod(v);
        let plan = decide(&p, true, &cfg).unwrap();
        let text = serde_json::to_string(&patch(&raw, &p, &cfg, &plan)).unwrap();
        assert!(!text.contains("/spec/containers/0/lifecycle"), "{text}");
        assert!(
            text.contains(
                r#""path":"/spec/containers/1/lifecycle/preStop","value":{"sleep":{"seconds":5}}"#
            ),
            "{text}"
        );
    }

    #[test]
    fn ports_besides_the_upstream_are_named_as_unprotected() {
        let cfg = InjectConfig::example();
        let mut v = app(json!([
            {"name":"http","containerPort":8080},
            {"name":"metrics","containerPort":9090},
            {"containerPort":5353,"protocol":"UDP"},
            {"containerPort":8443}
        ]));
        v["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name":"admin","image":"a","ports":[{"containerPort":7000}]}));
        let (raw, p) = pod(v);
        let plan = decide(&p, true, &cfg).unwrap();
        assert_eq!(plan.upstream_port, 8080);
        assert_eq!(plan.unprotected_ports, ["metrics:9090", "8443", "7000"]);
        let warning = plan.unprotected_ports_warning().unwrap();
        assert!(
            warning.contains("only port 8080") && warning.contains("metrics:9090, 8443, 7000"),
            "{warning}"
        );
        let text = serde_json::to_string(&patch(&raw, &p, &cfg, &plan)).unwrap();
        assert!(
            text.contains(r#""tollgate.dev/unprotected-ports":"metrics:9090,8443,7000""#),
            "{text}"
        );
        // One port: nothing to warn about, no annotation.
        let (raw, p) = pod(app(json!([{"containerPort":8080}])));
        let plan = decide(&p, true, &cfg).unwrap();
        assert_eq!(plan.unprotected_ports_warning(), None);
        let text = serde_json::to_string(&patch(&raw, &p, &cfg, &plan)).unwrap();
        assert!(!text.contains(UNPROTECTED_PORTS), "{text}");
    }

    #[test]
    fn the_injector_id_names_the_process_and_its_settings() {
        let cfg = InjectConfig::example();
        let id = injector_id(&cfg, 1_700_000_000);
        let (started, hash) = parse_injector_id(&id).unwrap();
        assert_eq!(started, 1_700_000_000);
        assert_eq!(injector_id(&cfg, 1_700_000_000), id, "stable");
        let mut with_ca = cfg.clone();
        with_ca.controller_ca = Some("pem".into());
        assert_eq!(
            injector_id(&with_ca, 1_700_000_000),
            id,
            "the CA is per review"
        );
        let mut other = cfg.clone();
        other.image = "ghcr.io/tollgate-dev/tollgate-sidecar:0.2.0".into();
        let other_id = injector_id(&other, 1_700_000_000);
        assert_ne!(parse_injector_id(&other_id).unwrap().1, hash);
        let mut annotated = cfg;
        annotated.injected_by = Some(id.clone());
        let (raw, p) = pod(app(json!([{"containerPort":8080}])));
        let plan = decide(&p, true, &annotated).unwrap();
        let text = serde_json::to_string(&patch(&raw, &p, &annotated, &plan)).unwrap();
        assert!(
            text.contains(&format!(r#""tollgate.dev/injected-by":"{id}""#)),
            "{text}"
        );
    }

    #[test]
    fn rewrite_names() {
        assert_eq!(renamed_port("http"), "app-http");
        assert_eq!(renamed_port("very-long-name1"), "app-very-long-n");
        assert_eq!(renamed_port("abcdefghijk-xyz"), "app-abcdefghijk");
        let cfg = InjectConfig::example();
        let mut v = app(
            json!([{"name":"http","containerPort":8080},{"name":"app-http","containerPort":1}]),
        );
        v["metadata"]["annotations"] = json!({REWRITE_PORT: "http"});
        assert!(matches!(
            decide(&pod(v).1, true, &cfg),
            Err(Skip::BadAnnotation(_))
        ));
        let mut v = app(json!([{"name":"grpc","containerPort":8080}]));
        v["metadata"]["annotations"] = json!({REWRITE_PORT: "http"});
        let skip = decide(&pod(v).1, true, &cfg).unwrap_err();
        assert!(skip.warns());
        assert!(
            skip.to_string()
                .contains("no app container has a port named \"http\"")
        );
    }

    #[test]
    fn redis_urls_are_checked_and_never_carry_a_password() {
        let mut r = RedisConfig {
            url: "redis://redis.db:6379/0".into(),
            password: Some(SecretKeyRef {
                name: "redis".into(),
                key: "password".into(),
            }),
            ..RedisConfig::default()
        };
        assert_eq!(r.url_env().unwrap(), "redis://redis.db:6379/0");
        r.url = "rediss://tenant@redis.db:6380".into();
        assert_eq!(r.url_env().unwrap(), "rediss://tenant@redis.db:6380");
        r.url = "redis://a:1, redis://b:2".into();
        r.cluster = true;
        assert_eq!(r.url_env().unwrap(), "redis://a:1,redis://b:2");
        r.cluster = false;
        r.sentinel_master = Some("tg".into());
        assert_eq!(r.url_env().unwrap(), "redis://a:1,redis://b:2", "sentinels");
        let env = r.env();
        assert!(
            env.iter()
                .any(|e| e.name == "TOLLGATE_REDIS_SENTINEL" && e.value.as_deref() == Some("tg"))
        );
        r.sentinel_master = None;
        r.cluster = true;
        r.url = "http://x".into();
        assert!(r.url_env().is_err());
        for url in ["redis://u:hunter2@x", "redis://:hunter2@x"] {
            r.url = url.into();
            let e = r.url_env().unwrap_err().to_string();
            assert!(e.contains("put it in a Secret"), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        r.url = "redis://x:1".into();
        r.ca = Some(CaRef::ConfigMap {
            name: "ca".into(),
            key: "ca.crt".into(),
        });
        assert!(r.url_env().is_err(), "a CA needs rediss://");
        r.url = "rediss://x:1".into();
        assert!(r.url_env().is_ok());
    }

    #[test]
    fn the_sentinels_password_is_a_file_of_its_own() {
        let r = RedisConfig {
            url: "rediss://s1:26379,rediss://s2:26379".into(),
            sentinel_master: Some("tg".into()),
            sentinel_password: Some(SecretKeyRef {
                name: "sentinel".into(),
                key: "pw".into(),
            }),
            ..RedisConfig::default()
        };
        assert!(
            r.env()
                .iter()
                .any(|e| e.name == "TOLLGATE_REDIS_SENTINEL_PASSWORD_FILE"
                    && e.value.as_deref()
                        == Some("/var/run/secrets/tollgate-redis/sentinel-auth/password"))
        );
        let volume = &r.volumes()[0];
        assert_eq!(volume.name, REDIS_SENTINEL_AUTH_VOLUME);
        let secret = volume.secret.as_ref().unwrap();
        assert_eq!(secret.secret_name.as_deref(), Some("sentinel"));
        assert_eq!(secret.optional, Some(true));
        assert_eq!(secret.items.as_ref().unwrap()[0].key, "pw");
        assert_eq!(
            r.mounts()[0].mount_path,
            "/var/run/secrets/tollgate-redis/sentinel-auth"
        );
        // Without sentinels the setting is a mistake.
        let mut cfg = InjectConfig::example();
        cfg.redis = Some(RedisConfig {
            sentinel_master: None,
            ..r
        });
        assert!(cfg.check().is_err());
    }

    #[test]
    fn redis_secrets_are_files_from_optional_volumes() {
        let r = RedisConfig {
            url: "rediss://r:6380".into(),
            username: Some("tollgate".into()),
            password: Some(SecretKeyRef {
                name: "redis".into(),
                key: "pw".into(),
            }),
            ca: Some(CaRef::Secret(SecretKeyRef {
                name: "redis-ca".into(),
                key: "ca.pem".into(),
            })),
            client_cert_secret: Some("redis-client".into()),
            ..RedisConfig::default()
        };
        let env: Vec<(String, String)> = r
            .env()
            .into_iter()
            .map(|e| (e.name, e.value.unwrap_or_default()))
            .collect();
        assert!(env.iter().all(|(n, _)| n != "TOLLGATE_REDIS_PASSWORD"));
        assert!(env.contains(&(
            "TOLLGATE_REDIS_PASSWORD_FILE".into(),
            "/var/run/secrets/tollgate-redis/auth/password".into()
        )));
        assert!(env.contains(&(
            "TOLLGATE_REDIS_CA_FILE".into(),
            "/var/run/secrets/tollgate-redis/ca/ca.crt".into()
        )));
        let volumes = r.volumes();
        assert_eq!(volumes.len(), 3);
        for v in &volumes {
            let optional = v
                .secret
                .as_ref()
                .and_then(|s| s.optional)
                .or(v.config_map.as_ref().and_then(|c| c.optional));
            assert_eq!(optional, Some(true), "{}", v.name);
        }
        assert!(r.mounts().iter().all(|m| m.read_only == Some(true)));
    }

    #[test]
    fn patch_escapes_annotation_keys() {
        let cfg = InjectConfig::example();
        let mut v = app(json!([{"containerPort":8080}]));
        v["metadata"]["annotations"] = json!({"a": "b"});
        let (raw, p) = pod(v);
        let plan = decide(&p, true, &cfg).unwrap();
        let patch = patch(&raw, &p, &cfg, &plan);
        let text = serde_json::to_string(&patch).unwrap();
        assert!(
            text.contains("\"/metadata/annotations/tollgate.dev~1sidecar-version\""),
            "{text}"
        );
    }
}
