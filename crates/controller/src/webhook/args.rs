//! Flags of the admission webhooks and of the sidecar they inject (flattened into the
//! controller's `Args`). Each also reads a `TOLLGATE_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use k8s_openapi::api::core::v1::ResourceRequirements;
use tollgate_crd::duration::parse_flag;

use super::inject::{CaRef, InjectConfig, RedisConfig, SecretKeyRef};

/// The default image of the injected sidecar (the chart always sets `--sidecar-image`).
pub const DEFAULT_SIDECAR_IMAGE: &str = concat!(
    "ghcr.io/tollgate-dev/tollgate-sidecar:",
    env!("CARGO_PKG_VERSION")
);

/// Webhook serving, webhook TLS and injection flags.
#[derive(Args, Debug, Clone)]
pub struct WebhookArgs {
    /// Serve the admission webhooks (HTTPS) with `tls.crt`/`tls.key` from this directory;
    /// the files are reloaded when they change. The webhooks are off when unset.
    #[arg(long, env = "TOLLGATE_WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,

    /// Address of the admission webhook server.
    #[arg(long, env = "TOLLGATE_WEBHOOK_LISTEN", default_value = "0.0.0.0:9443")]
    pub webhook_listen: SocketAddr,

    /// How often the certificate files are checked for changes.
    #[arg(long, env = "TOLLGATE_WEBHOOK_CERT_RELOAD_INTERVAL", default_value = "10s", value_parser = parse_flag)]
    pub webhook_cert_reload_interval: Duration,

    /// Generate the webhook CA and serving certificate (kept in `--webhook-secret`, shared by
    /// all replicas), write them to `--webhook-cert-dir`, patch the CA into the webhook
    /// configurations' `caBundle`, and renew the certificate before it expires.
    #[arg(
        long,
        env = "TOLLGATE_WEBHOOK_SELF_SIGNED",
        requires = "webhook_cert_dir"
    )]
    pub webhook_self_signed: bool,

    /// DNS names of the serving certificate in self-signed mode (the webhook Service's
    /// `<svc>.<ns>.svc` names); `localhost` and `127.0.0.1` are always added.
    #[arg(
        long = "webhook-dns-name",
        env = "TOLLGATE_WEBHOOK_DNS_NAMES",
        value_delimiter = ','
    )]
    pub webhook_dns_names: Vec<String>,

    /// Secret that holds the self-signed CA and serving certificate.
    #[arg(
        long,
        env = "TOLLGATE_WEBHOOK_SECRET",
        default_value = "tollgate-webhook-tls"
    )]
    pub webhook_secret: String,

    /// Namespace of `--webhook-secret`; defaults to the service account's (or kubeconfig's).
    #[arg(long, env = "TOLLGATE_WEBHOOK_SECRET_NAMESPACE")]
    pub webhook_secret_namespace: Option<String>,

    /// MutatingWebhookConfiguration whose `caBundle`s self-signed mode keeps up to date.
    #[arg(
        long,
        env = "TOLLGATE_MUTATING_WEBHOOK",
        default_value = "tollgate-sidecar-injector"
    )]
    pub mutating_webhook: String,

    /// ValidatingWebhookConfiguration whose `caBundle`s self-signed mode keeps up to date.
    #[arg(
        long,
        env = "TOLLGATE_VALIDATING_WEBHOOK",
        default_value = "tollgate-policy-validator"
    )]
    pub validating_webhook: String,

    /// Image of the injected sidecar.
    #[arg(long, env = "TOLLGATE_SIDECAR_IMAGE", default_value = DEFAULT_SIDECAR_IMAGE)]
    pub sidecar_image: String,

    /// `imagePullPolicy` of the injected sidecar.
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent",
        value_parser = ["Always", "IfNotPresent", "Never"]
    )]
    pub sidecar_image_pull_policy: String,

    /// Value of the pod annotation `tollgate.dev/sidecar-version`; defaults to the image tag.
    #[arg(long, env = "TOLLGATE_SIDECAR_VERSION")]
    pub sidecar_version: Option<String>,

    /// Port the injected sidecar serves client traffic on (`--listen 0.0.0.0:<port>`).
    #[arg(long, env = "TOLLGATE_SIDECAR_PORT", default_value_t = 8081)]
    pub sidecar_port: u16,

    /// Port of the sidecar's admin endpoints (probes, metrics), bound on 0.0.0.0 so the
    /// kubelet can probe it.
    #[arg(long, env = "TOLLGATE_SIDECAR_ADMIN_PORT", default_value_t = 9091)]
    pub sidecar_admin_port: u16,

    /// The rule stream URL the injected sidecars connect to.
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_CONTROLLER_URL",
        default_value = "http://tollgate-controller.tollgate-system.svc:8090"
    )]
    pub sidecar_controller_url: String,

    /// Audience of the projected ServiceAccount token mounted into the sidecar (match it
    /// with `--token-audience`).
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_TOKEN_AUDIENCE",
        default_value = "tollgate"
    )]
    pub sidecar_token_audience: String,

    /// Lifetime of the projected token (the kubelet refreshes it at 80 %).
    #[arg(long, env = "TOLLGATE_SIDECAR_TOKEN_EXPIRATION", default_value = "1h", value_parser = parse_flag)]
    pub sidecar_token_expiration: Duration,

    /// How long app containers without a `preStop` keep serving after their pod is deleted,
    /// while Services and load balancers stop routing to it (a `preStop` sleep; at most half
    /// the pod's grace period; `0s` turns it off). The pod annotation `tollgate.dev/drain-delay`
    /// overrides it.
    #[arg(long, env = "TOLLGATE_SIDECAR_DRAIN_DELAY", default_value = "5s", value_parser = parse_flag)]
    pub sidecar_drain_delay: Duration,

    /// Resources of the sidecar as JSON, e.g. `{"requests":{"cpu":"50m","memory":"32Mi"}}`.
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_RESOURCES",
        default_value = r#"{"requests":{"cpu":"50m","memory":"32Mi"},"limits":{"memory":"128Mi"}}"#,
        value_parser = parse_resources
    )]
    pub sidecar_resources: ResourceRequirements,

    /// Redis URL for global limits (`redis://host:6379`, `rediss://` for TLS) passed to the
    /// sidecar; global rules are enforced per sidecar when unset.
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_URL")]
    pub sidecar_redis_url: Option<String>,

    /// `--sidecar-redis-url` is a comma-separated list of Redis Cluster seed nodes.
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_CLUSTER")]
    pub sidecar_redis_cluster: bool,

    /// `--sidecar-redis-url` is a comma-separated list of Redis Sentinels and this is the
    /// master's name (the sidecar's `--redis-sentinel`).
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_REDIS_SENTINEL",
        value_name = "MASTER_NAME",
        conflicts_with = "sidecar_redis_cluster"
    )]
    pub sidecar_redis_sentinel: Option<String>,

    /// Secret (in each application namespace) holding the Redis Sentinels' own password
    /// (their `requirepass`), mounted like the Redis password (`--redis-sentinel-password-file`).
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_SENTINEL_PASSWORD_SECRET")]
    pub sidecar_redis_sentinel_password_secret: Option<String>,

    /// Key of the password in `--sidecar-redis-sentinel-password-secret`.
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_REDIS_SENTINEL_PASSWORD_KEY",
        default_value = "password"
    )]
    pub sidecar_redis_sentinel_password_key: String,

    /// Redis ACL user of the sidecars.
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_USERNAME")]
    pub sidecar_redis_username: Option<String>,

    /// Secret (in each application namespace) holding the Redis password; it is mounted
    /// read-only into the sidecar only and read from the file (`--redis-password-file`).
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_PASSWORD_SECRET")]
    pub sidecar_redis_password_secret: Option<String>,

    /// Key of the password in `--sidecar-redis-password-secret`.
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_REDIS_PASSWORD_KEY",
        default_value = "password"
    )]
    pub sidecar_redis_password_key: String,

    /// Secret (in each application namespace) with the CA bundle Redis' certificate must chain
    /// to (`--redis-ca-file`); needs rediss:// URLs.
    #[arg(
        long,
        env = "TOLLGATE_SIDECAR_REDIS_CA_SECRET",
        conflicts_with = "sidecar_redis_ca_configmap"
    )]
    pub sidecar_redis_ca_secret: Option<String>,

    /// ConfigMap (in each application namespace) with that CA bundle, instead of a Secret.
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_CA_CONFIGMAP")]
    pub sidecar_redis_ca_configmap: Option<String>,

    /// Key of the CA bundle in that Secret or ConfigMap.
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_CA_KEY", default_value = "ca.crt")]
    pub sidecar_redis_ca_key: String,

    /// `kubernetes.io/tls` Secret (in each application namespace) with the sidecars' client
    /// certificate, for Redis servers that require mutual TLS.
    #[arg(long, env = "TOLLGATE_SIDECAR_REDIS_CLIENT_CERT_SECRET")]
    pub sidecar_redis_client_cert_secret: Option<String>,

    /// Extra argument for the injected sidecar (repeatable), e.g. `--sidecar-arg=--log=debug`.
    #[arg(
        long = "sidecar-arg",
        env = "TOLLGATE_SIDECAR_ARGS",
        value_delimiter = ' ',
        allow_hyphen_values = true
    )]
    pub sidecar_args: Vec<String>,
}

fn parse_resources(s: &str) -> Result<ResourceRequirements, String> {
    serde_json::from_str(s)
        .map_err(|e| format!("{s:?} is not a Kubernetes ResourceRequirements object in JSON: {e}"))
}

impl WebhookArgs {
    /// The injection settings these flags describe.
    pub fn inject_config(&self) -> anyhow::Result<InjectConfig> {
        let version = self
            .sidecar_version
            .clone()
            .unwrap_or_else(|| image_tag(&self.sidecar_image));
        let redis = match &self.sidecar_redis_url {
            Some(url) if !url.trim().is_empty() => Some(RedisConfig {
                url: url.trim().to_string(),
                cluster: self.sidecar_redis_cluster,
                sentinel_master: self
                    .sidecar_redis_sentinel
                    .clone()
                    .filter(|m| !m.trim().is_empty()),
                sentinel_password: self
                    .sidecar_redis_sentinel_password_secret
                    .as_ref()
                    .filter(|n| !n.is_empty())
                    .map(|name| SecretKeyRef {
                        name: name.clone(),
                        key: self.sidecar_redis_sentinel_password_key.clone(),
                    }),
                username: self
                    .sidecar_redis_username
                    .clone()
                    .filter(|u| !u.is_empty()),
                password: self
                    .sidecar_redis_password_secret
                    .as_ref()
                    .filter(|n| !n.is_empty())
                    .map(|name| SecretKeyRef {
                        name: name.clone(),
                        key: self.sidecar_redis_password_key.clone(),
                    }),
                ca: match (
                    &self.sidecar_redis_ca_secret,
                    &self.sidecar_redis_ca_configmap,
                ) {
                    (Some(name), _) if !name.is_empty() => Some(CaRef::Secret(SecretKeyRef {
                        name: name.clone(),
                        key: self.sidecar_redis_ca_key.clone(),
                    })),
                    (_, Some(name)) if !name.is_empty() => Some(CaRef::ConfigMap {
                        name: name.clone(),
                        key: self.sidecar_redis_ca_key.clone(),
                    }),
                    _ => None,
                },
                client_cert_secret: self
                    .sidecar_redis_client_cert_secret
                    .clone()
                    .filter(|n| !n.is_empty()),
            }),
            _ => None,
        };
        let cfg = InjectConfig {
            image: self.sidecar_image.clone(),
            image_pull_policy: self.sidecar_image_pull_policy.clone(),
            version,
            listen_port: self.sidecar_port,
            admin_port: self.sidecar_admin_port,
            controller_url: self.sidecar_controller_url.clone(),
            token_audience: self.sidecar_token_audience.clone(),
            token_expiration_seconds: self.sidecar_token_expiration.as_secs().max(600) as i64,
            resources: self.sidecar_resources.clone(),
            redis,
            extra_args: self.sidecar_args.clone(),
            drain_delay_seconds: self.sidecar_drain_delay.as_secs() as i64,
            controller_ca: None,
            injected_by: None,
        };
        cfg.check()?;
        Ok(cfg)
    }
}

/// The tag of an image reference (`repo:tag` or `repo:tag@sha256:…`), or the controller's
/// version when there is none.
pub fn image_tag(image: &str) -> String {
    let without_digest = image.split('@').next().unwrap_or(image);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    match last.split_once(':') {
        Some((_, tag)) if !tag.is_empty() => tag.to_string(),
        _ => env!("CARGO_PKG_VERSION").to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        w: WebhookArgs,
    }

    #[test]
    fn defaults_parse_and_build_a_config() {
        let t = T::try_parse_from(["x"]).unwrap();
        assert!(t.w.webhook_cert_dir.is_none());
        assert_eq!(t.w.webhook_listen.port(), 9443);
        let cfg = t.w.inject_config().unwrap();
        assert_eq!(cfg.listen_port, 8081);
        assert_eq!(cfg.admin_port, 9091);
        assert_eq!(cfg.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(
            cfg.resources.requests.as_ref().unwrap()["cpu"].0,
            "50m".to_string()
        );
        assert!(cfg.redis.is_none());
    }

    #[test]
    fn self_signed_needs_a_cert_dir_and_bad_values_are_refused() {
        assert!(T::try_parse_from(["x", "--webhook-self-signed"]).is_err());
        assert!(
            T::try_parse_from([
                "x",
                "--webhook-self-signed",
                "--webhook-cert-dir=/tmp/x",
                "--webhook-dns-name=a.b.svc,a.b.svc.cluster.local"
            ])
            .unwrap()
            .w
            .webhook_dns_names
            .len()
                == 2
        );
        assert!(T::try_parse_from(["x", "--sidecar-resources={"]).is_err());
        assert!(T::try_parse_from(["x", "--sidecar-image-pull-policy=Sometimes"]).is_err());
        let t = T::try_parse_from(["x", "--sidecar-port=9091"]).unwrap();
        assert!(t.w.inject_config().is_err(), "port clash with admin");
        let t = T::try_parse_from([
            "x",
            "--sidecar-redis-url=redis://:pw@r:6379",
            "--sidecar-redis-password-secret=redis",
        ])
        .unwrap();
        assert!(t.w.inject_config().is_err(), "a password in the URL");
        let t = T::try_parse_from([
            "x",
            "--sidecar-redis-url=redis://r:6379",
            "--sidecar-redis-ca-configmap=ca",
        ])
        .unwrap();
        assert!(t.w.inject_config().is_err(), "a CA without rediss://");
        assert!(
            T::try_parse_from([
                "x",
                "--sidecar-redis-ca-configmap=ca",
                "--sidecar-redis-ca-secret=ca",
            ])
            .is_err(),
            "one CA source"
        );
        let t = T::try_parse_from([
            "x",
            "--sidecar-redis-url=rediss://r:6380",
            "--sidecar-redis-username=tollgate",
            "--sidecar-redis-password-secret=redis",
            "--sidecar-redis-ca-configmap=redis-ca",
            "--sidecar-redis-client-cert-secret=redis-client",
        ])
        .unwrap();
        let redis = t.w.inject_config().unwrap().redis.unwrap();
        assert_eq!(
            redis.ca,
            Some(CaRef::ConfigMap {
                name: "redis-ca".into(),
                key: "ca.crt".into()
            })
        );
        assert_eq!(redis.username.as_deref(), Some("tollgate"));
        assert_eq!(redis.client_cert_secret.as_deref(), Some("redis-client"));
    }

    #[test]
    fn extra_args_and_tags() {
        let t = T::try_parse_from([
            "x",
            "--sidecar-arg=--log=debug",
            "--sidecar-arg",
            "--redis-timeout=10ms",
        ])
        .unwrap();
        assert_eq!(t.w.sidecar_args, ["--log=debug", "--redis-timeout=10ms"]);
        assert_eq!(image_tag("reg:5000/a/b:1.2.3"), "1.2.3");
        assert_eq!(image_tag("reg:5000/a/b:1.2.3@sha256:ab"), "1.2.3");
        assert_eq!(image_tag("reg:5000/a/b"), env!("CARGO_PKG_VERSION"));
    }
}
