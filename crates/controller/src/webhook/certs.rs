//! Self-signed webhook TLS (`--webhook-self-signed`): a CA and a serving certificate made with
//! rcgen, kept in one Secret so every replica (and the next rollout) serves a certificate from
//! the same CA, written to `--webhook-cert-dir`, and the CA patched into the `caBundle` of every
//! webhook of the two webhook configurations.
//!
//! ```text
//!  every minute:  Secret ──missing/expiring/names changed──▶ issue ──update (resourceVersion)──▶ Secret
//!                   │                                                     409: another replica won, re-read
//!                   ▼
//!        cert dir (tls.crt, tls.key, ca.crt) ──▶ CertStore (new handshakes)
//!        caBundle of Mutating/ValidatingWebhookConfiguration (JSON patch, only when different)
//! ```
//!
//! The serving certificate lives [`CERT_VALIDITY`] and is renewed [`CERT_RENEW_BEFORE`] before it
//! expires, signed by the same CA, so the `caBundle` does not change. The CA lives
//! [`CA_VALIDITY`]; when it is renewed the old CA stays in the bundle beside the new one.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use serde_json::Value;
use tokio::sync::watch;

use super::tls::{CA_FILE, CERT_FILE, CertStore, KEY_FILE, write_if_changed};

/// Lifetime of the CA.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// A CA with less than this left is replaced.
pub const CA_RENEW_BEFORE: Duration = Duration::from_secs(365 * 24 * 3600);
/// Lifetime of the serving certificate.
pub const CERT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// A serving certificate with less than this left is replaced.
pub const CERT_RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// Backdating of `notBefore`, for clocks that lag.
const CLOCK_SKEW: Duration = Duration::from_secs(300);

const CA_KEY_FILE: &str = "ca.key";
const ANN_CA_NOT_AFTER: &str = "tollgate.dev/ca-not-after";
const ANN_CERT_NOT_AFTER: &str = "tollgate.dev/cert-not-after";
const ANN_CERT_SANS: &str = "tollgate.dev/cert-sans";
const CA_COMMON_NAME: &str = "tollgate-webhook-ca";

/// Settings of self-signed mode.
#[derive(Clone, Debug)]
pub struct SelfSignedConfig {
    pub secret_name: String,
    pub secret_namespace: String,
    /// DNS names from the flags; [`SelfSignedConfig::sans`] adds localhost and 127.0.0.1.
    pub dns_names: Vec<String>,
    pub cert_dir: PathBuf,
    pub mutating_webhook: String,
    pub validating_webhook: String,
    pub check_interval: Duration,
}

impl SelfSignedConfig {
    /// Subject alternative names of the serving certificate, sorted and deduplicated.
    pub fn sans(&self) -> Vec<String> {
        let mut sans: Vec<String> = self
            .dns_names
            .iter()
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .chain(["localhost".to_string(), "127.0.0.1".to_string()])
            .collect();
        sans.sort();
        sans.dedup();
        sans
    }
}

// === Bundle ===

/// The CA and serving certificate as stored in the Secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle {
    /// Trusted CA certificates, newest first (what goes into `caBundle`).
    pub ca_pem: String,
    /// Key of the newest CA.
    pub ca_key_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_not_after: SystemTime,
    pub cert_not_after: SystemTime,
    pub sans: Vec<String>,
}

/// What to do with the stored bundle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    Keep,
    /// A new serving certificate from the same CA.
    NewCert(&'static str),
    /// A new CA and serving certificate.
    NewCa(&'static str),
}

impl Bundle {
    /// Reads a bundle written by [`Bundle::to_secret_parts`]; `None` when anything is missing.
    pub fn from_secret(secret: &Secret) -> Option<Bundle> {
        let data = secret.data.as_ref()?;
        let text = |k: &str| {
            data.get(k)
                .and_then(|b| String::from_utf8(b.0.clone()).ok())
                .filter(|s| !s.trim().is_empty())
        };
        let ann = secret.metadata.annotations.as_ref()?;
        let time = |k: &str| ann.get(k).and_then(|v| humantime::parse_rfc3339(v).ok());
        Some(Bundle {
            ca_pem: text(CA_FILE)?,
            ca_key_pem: text(CA_KEY_FILE)?,
            cert_pem: text(CERT_FILE)?,
            key_pem: text(KEY_FILE)?,
            ca_not_after: time(ANN_CA_NOT_AFTER)?,
            cert_not_after: time(ANN_CERT_NOT_AFTER)?,
            sans: ann
                .get(ANN_CERT_SANS)?
                .split(',')
                .map(str::to_string)
                .collect(),
        })
    }

    /// Writes the bundle into a Secret's data and annotations (other keys are kept).
    pub fn to_secret(&self, secret: &mut Secret) {
        let data = secret.data.get_or_insert_with(Default::default);
        for (k, v) in [
            (CA_FILE, &self.ca_pem),
            (CA_KEY_FILE, &self.ca_key_pem),
            (CERT_FILE, &self.cert_pem),
            (KEY_FILE, &self.key_pem),
        ] {
            data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
        }
        let ann = secret
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        ann.insert(
            ANN_CA_NOT_AFTER.to_string(),
            humantime::format_rfc3339_seconds(self.ca_not_after).to_string(),
        );
        ann.insert(
            ANN_CERT_NOT_AFTER.to_string(),
            humantime::format_rfc3339_seconds(self.cert_not_after).to_string(),
        );
        ann.insert(ANN_CERT_SANS.to_string(), self.sans.join(","));
    }

    /// Decides whether the bundle must be renewed at `now` for `sans`.
    pub fn renewal(bundle: Option<&Bundle>, sans: &[String], now: SystemTime) -> Renewal {
        let Some(b) = bundle else {
            return Renewal::NewCa("no certificate yet");
        };
        if super::tls::certified_key(b.cert_pem.as_bytes(), b.key_pem.as_bytes()).is_err()
            || KeyPair::from_pem(&b.ca_key_pem).is_err()
        {
            return Renewal::NewCa("the stored certificate or key does not parse");
        }
        if b.ca_not_after <= now + CA_RENEW_BEFORE {
            return Renewal::NewCa("the CA expires soon");
        }
        if b.cert_not_after <= now + CERT_RENEW_BEFORE {
            return Renewal::NewCert("the certificate expires soon");
        }
        let mut have = b.sans.clone();
        have.sort();
        if have != sans {
            return Renewal::NewCert("the DNS names changed");
        }
        Renewal::Keep
    }

    /// Issues what `renewal` asks for. `previous` supplies the CA for [`Renewal::NewCert`] and
    /// the old CA kept in the bundle for [`Renewal::NewCa`].
    pub fn issue(
        renewal: Renewal,
        previous: Option<&Bundle>,
        sans: &[String],
        now: SystemTime,
    ) -> anyhow::Result<Bundle> {
        let (ca_pem, ca_key_pem, ca_not_after) = match (renewal, previous) {
            (Renewal::Keep, Some(p)) => return Ok(p.clone()),
            (Renewal::NewCert(_), Some(p)) => {
                (p.ca_pem.clone(), p.ca_key_pem.clone(), p.ca_not_after)
            }
            _ => {
                let key = KeyPair::generate().context("generate the CA key")?;
                let not_after = now + CA_VALIDITY;
                let cert = ca_params(now, not_after)
                    .self_signed(&key)
                    .context("sign the CA certificate")?;
                let mut bundle = cert.pem();
                // Keep trusting the previous CA (its certificates are still being served).
                if let Some(p) = previous.filter(|p| p.ca_not_after > now)
                    && let Some(first) = first_pem_cert(&p.ca_pem)
                {
                    if !bundle.ends_with('\n') {
                        bundle.push('\n');
                    }
                    bundle.push_str(&first);
                }
                (bundle, key.serialize_pem(), not_after)
            }
        };
        let ca_key = KeyPair::from_pem(&ca_key_pem).context("parse the CA key")?;
        let issuer = Issuer::new(ca_params(now, ca_not_after), ca_key);

        let cert_not_after = (now + CERT_VALIDITY).min(ca_not_after);
        let mut params = CertificateParams::new(sans.to_vec()).context("certificate names")?;
        let mut dn = DistinguishedName::new();
        let cn = sans
            .iter()
            .find(|s| s.parse::<std::net::IpAddr>().is_err() && s.as_str() != "localhost")
            .or(sans.first())
            .cloned()
            .unwrap_or_else(|| "tollgate-webhook".to_string());
        dn.push(DnType::CommonName, cn);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = (now - CLOCK_SKEW).into();
        params.not_after = cert_not_after.into();
        let key = KeyPair::generate().context("generate the serving key")?;
        let cert = params
            .signed_by(&key, &issuer)
            .context("sign the serving certificate")?;
        Ok(Bundle {
            ca_pem,
            ca_key_pem,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_not_after,
            cert_not_after,
            sans: sans.to_vec(),
        })
    }
}

fn ca_params(now: SystemTime, not_after: SystemTime) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    dn.push(DnType::OrganizationName, "tollgate");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = (now - CLOCK_SKEW).into();
    params.not_after = not_after.into();
    params
}

/// The first `CERTIFICATE` block of a PEM bundle, with its trailing newline.
fn first_pem_cert(bundle: &str) -> Option<String> {
    const END: &str = "-----END CERTIFICATE-----";
    let start = bundle.find("-----BEGIN CERTIFICATE-----")?;
    let end = bundle[start..].find(END)? + start + END.len();
    Some(format!("{}\n", &bundle[start..end]))
}

// === the loop ===

/// Keeps the Secret, the certificate files, the serving certificate and the `caBundle`s up to
/// date until shutdown.
pub async fn run(
    client: kube::Client,
    cfg: SelfSignedConfig,
    store: Arc<CertStore>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last_error: Option<String> = None;
    loop {
        let delay = match reconcile(&client, &cfg, &store, SystemTime::now()).await {
            Ok(true) => {
                last_error = None;
                cfg.check_interval
            }
            // Lost a race with another replica: read its result right away.
            Ok(false) => Duration::from_millis(200),
            Err(error) => {
                let msg = format!("{error:#}");
                if last_error.as_deref() != Some(msg.as_str()) {
                    tracing::warn!(error = %msg, "self-signed webhook certificate: retrying in 5s");
                    last_error = Some(msg);
                }
                Duration::from_secs(5)
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
        }
    }
}

/// One round. `Ok(false)` when another writer changed the Secret first.
pub async fn reconcile(
    client: &kube::Client,
    cfg: &SelfSignedConfig,
    store: &CertStore,
    now: SystemTime,
) -> anyhow::Result<bool> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &cfg.secret_namespace);
    let existing = api
        .get_opt(&cfg.secret_name)
        .await
        .with_context(|| format!("get Secret {}/{}", cfg.secret_namespace, cfg.secret_name))?;
    let stored = existing.as_ref().and_then(Bundle::from_secret);
    let sans = cfg.sans();
    let renewal = Bundle::renewal(stored.as_ref(), &sans, now);
    let bundle = if let (Renewal::Keep, Some(b)) = (renewal, &stored) {
        b.clone()
    } else {
        let reason = match renewal {
            Renewal::NewCa(r) | Renewal::NewCert(r) => r,
            Renewal::Keep => "no certificate yet",
        };
        let bundle = Bundle::issue(renewal, stored.as_ref(), &sans, now)?;
        let result = match existing {
            Some(mut secret) => {
                bundle.to_secret(&mut secret);
                api.replace(&cfg.secret_name, &PostParams::default(), &secret)
                    .await
            }
            None => {
                let mut secret = Secret {
                    metadata: kube::api::ObjectMeta {
                        name: Some(cfg.secret_name.clone()),
                        namespace: Some(cfg.secret_namespace.clone()),
                        ..Default::default()
                    },
                    type_: Some("Opaque".to_string()),
                    ..Default::default()
                };
                bundle.to_secret(&mut secret);
                api.create(&PostParams::default(), &secret).await
            }
        };
        match result {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(false),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "store the webhook certificate in Secret {}/{}",
                        cfg.secret_namespace, cfg.secret_name
                    )
                });
            }
        }
        tracing::info!(
            reason,
            new_ca = matches!(renewal, Renewal::NewCa(_)),
            sans = %sans.join(","),
            not_after = %humantime::format_rfc3339_seconds(bundle.cert_not_after),
            "issued a webhook serving certificate"
        );
        bundle
    };

    write_if_changed(&cfg.cert_dir, CA_FILE, bundle.ca_pem.as_bytes(), 0o644)?;
    write_if_changed(&cfg.cert_dir, KEY_FILE, bundle.key_pem.as_bytes(), 0o600)?;
    write_if_changed(&cfg.cert_dir, CERT_FILE, bundle.cert_pem.as_bytes(), 0o644)?;
    if store.set_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())? {
        tracing::info!("webhook serving certificate installed");
    }

    let ca = bundle.ca_pem.as_bytes();
    patch_ca_bundle::<MutatingWebhookConfiguration>(client, &cfg.mutating_webhook, ca).await?;
    patch_ca_bundle::<ValidatingWebhookConfiguration>(client, &cfg.validating_webhook, ca).await?;
    Ok(true)
}

/// JSON-patches `caBundle` into every webhook of the named configuration whose bundle differs.
/// A missing configuration is not an error (it may not be installed yet).
async fn patch_ca_bundle<K>(client: &kube::Client, name: &str, ca: &[u8]) -> anyhow::Result<()>
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
        + serde::de::DeserializeOwned
        + serde::Serialize
        + Clone
        + std::fmt::Debug,
    <K as kube::Resource>::DynamicType: Default,
{
    let kind = K::kind(&Default::default()).to_string();
    let api: Api<K> = Api::all(client.clone());
    let Some(obj) = api
        .get_opt(name)
        .await
        .with_context(|| format!("get {kind} {name}"))?
    else {
        tracing::debug!(%kind, %name, "webhook configuration not found; caBundle not patched");
        return Ok(());
    };
    let ops = ca_bundle_ops(&serde_json::to_value(&obj)?, ca);
    if ops.is_empty() {
        return Ok(());
    }
    let n = ops.len() / 2;
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Json::<()>(json_patch::Patch(ops)),
    )
    .await
    .with_context(|| format!("patch the caBundle of {kind} {name}"))?;
    tracing::info!(%kind, %name, webhooks = n, "patched caBundle");
    Ok(())
}

/// `test` + `add` operations that set `caBundle` on each webhook that does not have `ca`.
pub fn ca_bundle_ops(config: &Value, ca: &[u8]) -> Vec<json_patch::PatchOperation> {
    use json_patch::jsonptr::PointerBuf;
    use json_patch::{AddOperation, PatchOperation, TestOperation};
    let encoded = {
        use base64::Engine as _;
        Value::String(base64::engine::general_purpose::STANDARD.encode(ca))
    };
    let mut ops = Vec::new();
    let Some(hooks) = config.get("webhooks").and_then(Value::as_array) else {
        return ops;
    };
    for (i, hook) in hooks.iter().enumerate() {
        if hook.pointer("/clientConfig/caBundle") == Some(&encoded) {
            continue;
        }
        let i = i.to_string();
        // The test guards against the list changing between our get and patch.
        ops.push(PatchOperation::Test(TestOperation {
            path: PointerBuf::from_tokens(["webhooks", i.as_str(), "name"]),
            value: hook.get("name").cloned().unwrap_or(Value::Null),
        }));
        ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["webhooks", i.as_str(), "clientConfig", "caBundle"]),
            value: encoded.clone(),
        }));
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn cfg() -> SelfSignedConfig {
        SelfSignedConfig {
            secret_name: "s".into(),
            secret_namespace: "tollgate-system".into(),
            dns_names: vec![
                "tollgate-controller.tollgate-system.svc".into(),
                "Tollgate-Controller.tollgate-system.svc.cluster.local".into(),
            ],
            cert_dir: PathBuf::from("/nonexistent"),
            mutating_webhook: "m".into(),
            validating_webhook: "v".into(),
            check_interval: Duration::from_secs(60),
        }
    }

    /// Verifies the serving certificate for `name` against the CA bundle, as a TLS client would.
    fn verify(b: &Bundle, name: &str, at: SystemTime) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(b.ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
        let leaf = CertificateDer::from_pem_slice(b.cert_pem.as_bytes()).unwrap();
        let secs = at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(name.to_string()).unwrap(),
                &[],
                UnixTime::since_unix_epoch(Duration::from_secs(secs)),
            )
            .map(|_| ())
    }

    #[test]
    fn issues_a_ca_and_a_serving_cert_that_verify_for_every_name() {
        let now = SystemTime::now();
        let sans = cfg().sans();
        assert_eq!(
            sans,
            [
                "127.0.0.1",
                "localhost",
                "tollgate-controller.tollgate-system.svc",
                "tollgate-controller.tollgate-system.svc.cluster.local"
            ]
        );
        assert_eq!(
            Bundle::renewal(None, &sans, now),
            Renewal::NewCa("no certificate yet")
        );
        let b = Bundle::issue(Renewal::NewCa("x"), None, &sans, now).unwrap();
        for name in &sans {
            verify(&b, name, now).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(verify(&b, "evil.example", now).is_err());
        assert!(verify(&b, "localhost", now + CERT_VALIDITY + DAY).is_err());
        assert_eq!(Bundle::renewal(Some(&b), &sans, now), Renewal::Keep);
        super::super::tls::certified_key(b.cert_pem.as_bytes(), b.key_pem.as_bytes()).unwrap();

        // Round trip through a Secret.
        let mut secret = Secret::default();
        b.to_secret(&mut secret);
        let back = Bundle::from_secret(&secret).unwrap();
        assert_eq!(back.ca_pem, b.ca_pem);
        assert_eq!(back.sans, b.sans);
        let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(secs(back.cert_not_after), secs(b.cert_not_after));
        assert!(Bundle::from_secret(&Secret::default()).is_none());
    }

    #[test]
    fn renews_the_cert_from_the_same_ca_before_it_expires() {
        let now = SystemTime::now();
        let sans = cfg().sans();
        let b = Bundle::issue(Renewal::NewCa("x"), None, &sans, now).unwrap();
        let later = now + CERT_VALIDITY - CERT_RENEW_BEFORE + DAY;
        let r = Bundle::renewal(Some(&b), &sans, later);
        assert!(matches!(r, Renewal::NewCert(_)), "{r:?}");
        let renewed = Bundle::issue(r, Some(&b), &sans, later).unwrap();
        assert_eq!(renewed.ca_pem, b.ca_pem, "same CA, same caBundle");
        assert_ne!(renewed.cert_pem, b.cert_pem);
        verify(&renewed, "localhost", later + CERT_RENEW_BEFORE).unwrap();

        // New names: a new certificate.
        let more = [sans.clone(), vec!["extra.ns.svc".to_string()]].concat();
        let mut more_sorted = more.clone();
        more_sorted.sort();
        assert!(matches!(
            Bundle::renewal(Some(&b), &more_sorted, now),
            Renewal::NewCert(_)
        ));
    }

    #[test]
    fn renews_the_ca_keeping_the_old_one_trusted() {
        let now = SystemTime::now();
        let sans = cfg().sans();
        let b = Bundle::issue(Renewal::NewCa("x"), None, &sans, now).unwrap();
        let late = now + CA_VALIDITY - CA_RENEW_BEFORE + DAY;
        let r = Bundle::renewal(Some(&b), &sans, late);
        assert!(matches!(r, Renewal::NewCa(_)), "{r:?}");
        let renewed = Bundle::issue(r, Some(&b), &sans, late).unwrap();
        assert_eq!(renewed.ca_pem.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(renewed.ca_pem.ends_with(&b.ca_pem));
        verify(&renewed, "localhost", late).unwrap();
        // The bundle still trusts the old serving certificate.
        let old_served = Bundle {
            ca_pem: renewed.ca_pem.clone(),
            ..b.clone()
        };
        verify(&old_served, "localhost", now).unwrap();
    }

    #[test]
    fn ca_bundle_ops_only_touch_webhooks_that_differ() {
        let ca = b"-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n";
        let encoded = serde_json::to_value(ByteString(ca.to_vec())).unwrap();
        let config = serde_json::json!({"webhooks": [
            {"name": "a", "clientConfig": {"caBundle": encoded}},
            {"name": "b", "clientConfig": {"service": {"name": "x", "namespace": "y"}}},
        ]});
        let ops = ca_bundle_ops(&config, ca);
        let text = serde_json::to_string(&ops).unwrap();
        assert_eq!(ops.len(), 2, "{text}");
        assert!(text.contains("/webhooks/1/name"), "{text}");
        assert!(text.contains("/webhooks/1/clientConfig/caBundle"), "{text}");
        let mut patched = config.clone();
        json_patch::patch(&mut patched, &ops).unwrap();
        assert!(ca_bundle_ops(&patched, ca).is_empty());
        assert!(ca_bundle_ops(&serde_json::json!({}), ca).is_empty());
    }
}
