//! Admission webhooks, served over HTTPS on `--webhook-listen` (default `0.0.0.0:9443`) when
//! `--webhook-cert-dir` is set:
//!
//! ```text
//!  kube-apiserver ──POST AdmissionReview──▶ /inject/namespace   pod CREATE, namespace labelled
//!                                          /inject/required    pod CREATE, namespace labelled
//!                                                              `required` (failurePolicy Fail)
//!                                          /inject/pod         pod CREATE, any other namespace
//!                                          /validate-ratelimitpolicy   CREATE/UPDATE
//!                                          /healthz
//! ```
//!
//! - [`inject`]: whether a pod gets the sidecar and the JSON patch that adds it.
//! - [`validate`]: `tollgate_crd::compile` on RateLimitPolicies, denying with every error.
//! - [`tls`]: the serving certificate, reloaded when its files change.
//! - [`certs`]: `--webhook-self-signed`: CA + certificate in a Secret, `caBundle` patching.
//!
//! **How the namespace opt-in reaches the handler.** A webhook configuration can filter by
//! namespace *labels* but the request does not carry them. Instead of watching namespaces, the
//! chart registers two webhooks that differ in their `namespaceSelector` and path: the one for
//! namespaces labelled `tollgate.dev/inject: enabled` calls `/inject/namespace`, the other
//! (every other namespace) calls `/inject/pod`. The API server evaluates the label at admission
//! time, so there is no cache to go stale and no RBAC on namespaces. The handler re-checks the
//! pod's own label/annotation and the opt-out in both cases.
//!
//! A third entry serves namespaces labelled `tollgate.dev/inject: required` on
//! `/inject/required`, with `failurePolicy: Fail`: there a pod is never created without the
//! sidecar. While no controller answers, the API server refuses the pod (its ReplicaSet retries);
//! a pod that cannot be injected (no port, a bad annotation) is denied with the reason. The
//! release namespace and `kube-system` & co. are never selected, so the controller can always
//! start again. Pods that opt out (`tollgate.dev/inject: disabled`) are still admitted.
//!
//! Elsewhere pod admission never fails: an error or a pod that cannot be injected is admitted
//! unchanged (with a warning kubectl prints when the pod asked for injection), and pods created
//! while no controller answers get no sidecar; the controller finds those when it is back
//! ([`crate::coverage`]). An injected pod whose app declares more TCP ports than the one the
//! sidecar forwards to is admitted with a warning naming the ports that bypass it.

pub mod args;
pub mod certs;
pub mod inject;
pub mod tls;
pub mod validate;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::Instrument;

use self::args::WebhookArgs;
use self::inject::{InjectConfig, Outcome};
use self::tls::CertStore;
use self::validate::Verdict;

/// Path of the injection webhook for namespaces labelled `tollgate.dev/inject: enabled`.
pub const PATH_INJECT_NAMESPACE: &str = "/inject/namespace";
/// Path of the fail-closed injection webhook for namespaces labelled
/// `tollgate.dev/inject: required`.
pub const PATH_INJECT_REQUIRED: &str = "/inject/required";
/// Path of the injection webhook for all other namespaces (pod-level opt-in only).
pub const PATH_INJECT_POD: &str = "/inject/pod";
/// Path of the RateLimitPolicy validating webhook.
pub const PATH_VALIDATE_POLICY: &str = "/validate-ratelimitpolicy";
/// Largest AdmissionReview accepted (objects are at most ~1.5 MiB in etcd).
const MAX_BODY_BYTES: usize = 4 << 20;

// === metrics ===

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReviewLabels {
    webhook: &'static str,
    result: &'static str,
}

/// `tollgate_controller_webhook_reviews_total{webhook, result}`: `webhook` is `inject` or
/// `validate`; `result` is `injected`, a skip reason (`opted_out`, `not_opted_in`,
/// `already_injected`, `no_upstream_port`, ...), `allowed`, `denied` or `invalid`.
#[derive(Clone, Debug, Default)]
pub struct WebhookMetrics {
    reviews: Family<ReviewLabels, Counter>,
}

impl WebhookMetrics {
    /// Creates the metrics and registers them (the registry carries the controller's prefix).
    pub fn register(registry: &mut Registry) -> WebhookMetrics {
        let m = WebhookMetrics::default();
        registry.register(
            "webhook_reviews",
            "Admission reviews answered, by webhook and result",
            m.reviews.clone(),
        );
        m
    }

    fn review(&self, webhook: &'static str, result: &'static str) {
        self.reviews
            .get_or_create(&ReviewLabels { webhook, result })
            .inc();
    }

    /// The count for one label pair (tests).
    pub fn count(&self, webhook: &'static str, result: &'static str) -> u64 {
        self.reviews
            .get_or_create(&ReviewLabels { webhook, result })
            .get()
    }
}

// === Handler ===

/// Answers AdmissionReviews; pure apart from logging and metrics.
#[derive(Clone, Debug)]
pub struct Handler {
    inject: Arc<InjectConfig>,
    metrics: WebhookMetrics,
    /// `ca.crt` of the serving certificate, read at every review when the sidecars' controller
    /// URL is `https://` (the stream's TLS listener serves the same certificate).
    controller_ca_file: Option<std::path::PathBuf>,
}

impl Handler {
    pub fn new(inject: InjectConfig, metrics: WebhookMetrics) -> Handler {
        Handler {
            inject: Arc::new(inject),
            metrics,
            controller_ca_file: None,
        }
    }

    /// Injects the CA in `file` into sidecars that talk `https://` to the controller.
    pub fn with_controller_ca_file(mut self, file: std::path::PathBuf) -> Handler {
        self.controller_ca_file = Some(file);
        self
    }

    /// The injection settings for this review: with the current CA for an https controller.
    /// A CA that cannot be read is logged and left out; the pod is injected all the same (its
    /// sidecar then cannot verify the controller and keeps retrying, which its readiness shows).
    fn inject_config(&self) -> std::borrow::Cow<'_, InjectConfig> {
        let Some(file) = &self.controller_ca_file else {
            return std::borrow::Cow::Borrowed(&self.inject);
        };
        match std::fs::read_to_string(file) {
            Ok(pem) if pem.contains("-----BEGIN CERTIFICATE-----") => {
                let mut cfg = (*self.inject).clone();
                cfg.controller_ca = Some(pem);
                std::borrow::Cow::Owned(cfg)
            }
            Ok(_) | Err(_) => {
                tracing::warn!(file = %file.display(), "no controller CA to give the sidecar; injecting without it");
                std::borrow::Cow::Borrowed(&self.inject)
            }
        }
    }

    /// The response review for a request body posted to `path`; `None` for an unknown path.
    pub fn review(&self, path: &str, body: &[u8]) -> Option<AdmissionReview<DynamicObject>> {
        let kind = match path {
            PATH_INJECT_NAMESPACE => Kind::Inject {
                namespace_opted_in: true,
                required: false,
            },
            PATH_INJECT_REQUIRED => Kind::Inject {
                namespace_opted_in: true,
                required: true,
            },
            PATH_INJECT_POD | "/inject" => Kind::Inject {
                namespace_opted_in: false,
                required: false,
            },
            PATH_VALIDATE_POLICY => Kind::Validate,
            _ => return None,
        };
        let webhook = match kind {
            Kind::Inject { .. } => "inject",
            Kind::Validate => "validate",
        };
        let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => {
                self.metrics.review(webhook, "invalid");
                return Some(
                    AdmissionResponse::invalid(format!("not an AdmissionReview: {e}"))
                        .into_review(),
                );
            }
        };
        let req: AdmissionRequest<DynamicObject> = match review.try_into() {
            Ok(r) => r,
            Err(e) => {
                self.metrics.review(webhook, "invalid");
                return Some(AdmissionResponse::invalid(e).into_review());
            }
        };
        let res = match kind {
            Kind::Inject {
                namespace_opted_in,
                required,
            } => self.mutate(&req, namespace_opted_in, required),
            Kind::Validate => self.validate(&req),
        };
        Some(res.into_review())
    }

    /// `required`: the namespace asked that no pod run without the sidecar, so a pod that
    /// asked for it (or did not opt out) and cannot get it is denied rather than admitted bare.
    fn mutate(
        &self,
        req: &AdmissionRequest<DynamicObject>,
        namespace_opted_in: bool,
        required: bool,
    ) -> AdmissionResponse {
        let mut res = AdmissionResponse::from(req);
        let is_pod_create = req.operation == Operation::Create
            && req.kind.group.is_empty()
            && req.kind.kind == "Pod"
            && req.sub_resource.is_none();
        let Some(obj) = req.object.as_ref().filter(|_| is_pod_create) else {
            self.metrics.review("inject", "ignored");
            return res;
        };
        let namespace = req.namespace.as_deref().unwrap_or("");
        let name = obj
            .metadata
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| obj.metadata.generate_name.as_ref().map(|g| format!("{g}*")))
            .unwrap_or_default();
        let outcome = serde_json::to_value(obj)
            .and_then(|raw| inject::inject(&raw, namespace_opted_in, &self.inject_config()));
        match outcome {
            Ok(Outcome::Injected(patch, warnings)) => match res.clone().with_patch(patch) {
                Ok(mut patched) => {
                    self.metrics.review("inject", "injected");
                    tracing::info!(%namespace, pod = %name, dry_run = req.dry_run, unprotected = ?warnings, "sidecar injected");
                    if !warnings.is_empty() {
                        patched.warnings = Some(warnings);
                    }
                    res = patched;
                }
                Err(error) => {
                    self.metrics.review("inject", "error");
                    tracing::warn!(%namespace, pod = %name, %error, required, "cannot serialize the patch");
                    if required {
                        res =
                            res.deny(format!("tollgate: cannot build the sidecar patch: {error}"));
                    }
                }
            },
            Ok(Outcome::Skipped(skip)) if required && skip.warns() => {
                self.metrics.review("inject", "denied");
                tracing::info!(%namespace, pod = %name, reason = %skip, "pod denied: its namespace requires the sidecar");
                res = res.deny(format!(
                    "tollgate: namespace {namespace} requires the rate-limiting sidecar \
                     (tollgate.dev/inject: required) and it cannot be injected: {skip}"
                ));
            }
            Ok(Outcome::Skipped(skip)) => {
                self.metrics.review("inject", skip.reason());
                if skip.warns() {
                    tracing::info!(%namespace, pod = %name, reason = %skip, "sidecar not injected");
                    res.warnings = Some(vec![format!("tollgate: sidecar not injected: {skip}")]);
                } else {
                    tracing::debug!(%namespace, pod = %name, reason = %skip, "sidecar not injected");
                }
            }
            Err(error) if required => {
                self.metrics.review("inject", "denied");
                tracing::warn!(%namespace, pod = %name, %error, "cannot decode the pod; denied (namespace requires the sidecar)");
                res = res.deny(format!(
                    "tollgate: namespace {namespace} requires the rate-limiting sidecar and the \
                     pod cannot be decoded: {error}"
                ));
            }
            Err(error) => {
                self.metrics.review("inject", "error");
                tracing::warn!(%namespace, pod = %name, %error, "cannot decode the pod; admitted unchanged");
                res.warnings = Some(vec![format!(
                    "tollgate: sidecar not injected: cannot decode the pod: {error}"
                )]);
            }
        }
        res
    }

    fn validate(&self, req: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
        let res = AdmissionResponse::from(req);
        let to_value =
            |o: &Option<DynamicObject>| o.as_ref().and_then(|o| serde_json::to_value(o).ok());
        let object = to_value(&req.object);
        let old = to_value(&req.old_object);
        let verdict = validate::validate_policy(
            &req.operation,
            req.namespace.as_deref(),
            &req.name,
            object.as_ref(),
            old.as_ref(),
        );
        match verdict {
            Verdict::Allow => {
                self.metrics.review("validate", "allowed");
                res
            }
            Verdict::Deny(msg) => {
                self.metrics.review("validate", "denied");
                tracing::info!(namespace = ?req.namespace, policy = %req.name, errors = %msg, "RateLimitPolicy denied");
                res.deny(format!("RateLimitPolicy {:?} is invalid: {msg}", req.name))
            }
        }
    }

    /// Serves one HTTP request.
    pub async fn call<B>(&self, req: Request<B>) -> Response<Full<Bytes>>
    where
        B: hyper::body::Body,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let path = req.uri().path().to_string();
        match (req.method(), path.as_str()) {
            (&Method::GET, "/healthz" | "/readyz") => return text(StatusCode::OK, "ok\n"),
            (&Method::POST, _) => {}
            _ => return text(StatusCode::NOT_FOUND, "not found\n"),
        }
        let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return text(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("cannot read the body: {e}\n"),
                );
            }
        };
        match self.review(&path, &body) {
            Some(review) => match serde_json::to_vec(&review) {
                Ok(json) => {
                    let mut rsp = Response::new(Full::new(Bytes::from(json)));
                    rsp.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    rsp
                }
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e}\n")),
            },
            None => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Inject {
        namespace_opted_in: bool,
        required: bool,
    },
    Validate,
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut rsp = Response::new(Full::new(Bytes::from(body.to_string())));
    *rsp.status_mut() = status;
    rsp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    rsp
}

// === serving ===

/// How long admission reviews in flight at shutdown get to finish.
const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Accepts TLS connections on `listener` until shutdown, then lets the reviews in flight finish
/// (up to [`DRAIN_GRACE`]): a pod being admitted is not cut off.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    handler: Handler,
    mut shutdown: watch::Receiver<bool>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(error) => {
                    tracing::warn!(%error, "webhook accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() {
                    break;
                }
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let handler = handler.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let Some(stream) = tls::accept(&acceptor, tcp, peer, "webhook").await else {
                return;
            };
            let service = hyper::service::service_fn(move |req| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler.call(req).await) }
            });
            let conn = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .into_owned();
            let _ = watcher.watch(conn).await;
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("admission reviews still in flight after the shutdown grace period");
    }
}

/// The admission webhooks, built: the injection settings read, the metrics registered and
/// `--webhook-listen` bound, but nothing served yet ([`Webhooks::tasks`]).
pub struct Webhooks {
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    store: Arc<CertStore>,
    handler: Handler,
    cert_dir: std::path::PathBuf,
    reload_interval: Duration,
    self_signed: Option<certs::SelfSignedConfig>,
}

type Task = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// The webhooks' tasks, to spawn; each stops at the shutdown signal it was given.
pub struct WebhookTasks {
    /// The self-signed certificate manager (`--webhook-self-signed`).
    pub certs: Option<Task>,
    /// Reloads the serving certificate when its files change.
    pub reload: Task,
    /// The server; at shutdown, the reviews in flight finish.
    pub server: Task,
}

impl Webhooks {
    /// `None` without `--webhook-cert-dir`. Call before the registry is handed to the
    /// rule-stream server. `started`: the process start (Unix seconds), written with the
    /// settings' hash on every injected pod ([`inject::INJECTED_BY`]).
    pub async fn build(
        client: &kube::Client,
        args: &WebhookArgs,
        registry: &mut Registry,
        started: i64,
    ) -> anyhow::Result<Option<Webhooks>> {
        let Some(dir) = args.webhook_cert_dir.clone() else {
            tracing::info!("admission webhooks off (no --webhook-cert-dir)");
            return Ok(None);
        };
        let mut config = args.inject_config()?;
        config.injected_by = Some(inject::injector_id(&config, started));
        let metrics = WebhookMetrics::register(registry);
        let store = CertStore::new();
        let tls = Arc::new(tls::server_config(store.clone())?);
        let listener = TcpListener::bind(args.webhook_listen)
            .await
            .with_context(|| {
                format!(
                    "cannot listen on {} (--webhook-listen)",
                    args.webhook_listen
                )
            })?;
        tracing::info!(listen = %args.webhook_listen, cert_dir = %dir.display(), self_signed = args.webhook_self_signed, image = %config.image, "serving admission webhooks");
        let self_signed = args.webhook_self_signed.then(|| certs::SelfSignedConfig {
            secret_name: args.webhook_secret.clone(),
            secret_namespace: args
                .webhook_secret_namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string()),
            dns_names: args.webhook_dns_names.clone(),
            cert_dir: dir.clone(),
            mutating_webhook: args.mutating_webhook.clone(),
            validating_webhook: args.validating_webhook.clone(),
            check_interval: Duration::from_secs(60),
        });
        let mut handler = Handler::new(config.clone(), metrics);
        if config.controller_url.starts_with("https://") {
            handler = handler.with_controller_ca_file(dir.join(tls::CA_FILE));
        }
        Ok(Some(Webhooks {
            listener,
            tls,
            store,
            handler,
            cert_dir: dir,
            reload_interval: args.webhook_cert_reload_interval,
            self_signed,
        }))
    }

    /// The serving certificate (kept current), which the rule stream's TLS listener shares.
    pub fn certs(&self) -> &Arc<CertStore> {
        &self.store
    }

    /// The tasks to spawn, each stopping at `shutdown`.
    pub fn tasks(self, client: &kube::Client, shutdown: &watch::Receiver<bool>) -> WebhookTasks {
        let certs = self.self_signed.map(|cfg| -> Task {
            let run = certs::run(client.clone(), cfg, self.store.clone(), shutdown.clone());
            Box::pin(run.instrument(tracing::info_span!("webhook-certs")))
        });
        let reload =
            self.store
                .clone()
                .watch_dir(self.cert_dir, self.reload_interval, shutdown.clone());
        let server = serve(self.listener, self.tls, self.handler, shutdown.clone());
        WebhookTasks {
            certs,
            reload: Box::pin(reload.instrument(tracing::info_span!("webhook-tls"))),
            server: Box::pin(server.instrument(tracing::info_span!("webhook"))),
        }
    }
}

#[cfg(test)]
mod tests;
