//! Who is calling: bearer tokens checked with a Kubernetes `TokenReview`, and scoping of a
//! request to the caller's namespace (and pod, when the token is bound to one).
//!
//! Sidecars present their pod's service account token (ideally a projected, audience-bound
//! token). A successful review yields `system:serviceaccount:<ns>:<sa>`; the request may only
//! name pods in `<ns>`, and when the token carries the `authentication.kubernetes.io/pod-name`
//! extra (every projected token does), only that pod. Successful reviews are cached for a short
//! while, keyed by a SHA-256 of the token; tokens are never logged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use kube::api::{Api, PostParams};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;

use crate::metrics::Metrics;

/// The extra a bound service account token carries with the pod name.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// TokenReview `user.extra` key with the UID of the pod a bound token belongs to.
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";
const SA_PREFIX: &str = "system:serviceaccount:";

/// Default lifetime of a cached successful review.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(60);
/// Failed reviews are remembered briefly so a misconfigured sidecar cannot flood the API server.
const NEGATIVE_CACHE_TTL: Duration = Duration::from_secs(5);
/// Most cached reviews; beyond it expired entries are purged, then the cache is cleared.
const MAX_CACHE_ENTRIES: usize = 16_384;
/// Most TokenReviews in flight at once (reconnect storms after a controller restart).
const MAX_CONCURRENT_REVIEWS: usize = 32;

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The full user name, e.g. `system:serviceaccount:shop:shop-api`.
    pub username: String,
    /// The service account's namespace, when the user is a service account.
    pub namespace: Option<String>,
    pub service_account: Option<String>,
    /// The pod the token is bound to, when it is a bound token.
    pub pod_name: Option<String>,
    /// That pod's UID: a token of an earlier pod of the same name (a StatefulSet's) is not
    /// this pod's, even while a cached review still says it is valid.
    pub pod_uid: Option<String>,
}

/// Why a request is not authenticated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// Missing, malformed, expired or rejected token: 401.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The token could not be reviewed (API server unreachable): 503.
    #[error("token review unavailable: {0}")]
    Unavailable(String),
}

/// Turns a bearer token into an [`Identity`]. A trait so that tests can use a fake.
pub trait Authenticator: Send + Sync + 'static {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Identity, AuthError>>;
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim();
    (!token.is_empty()).then_some(token)
}

/// Whether `identity` may act for `pod` in `namespace`; the error says why not (403).
pub fn authorize(identity: &Identity, namespace: &str, pod: &str) -> Result<(), String> {
    let Some(sa_ns) = identity.namespace.as_deref() else {
        return Err(format!(
            "{} is not a service account; only sidecars may stream rules",
            identity.username
        ));
    };
    if sa_ns != namespace {
        return Err(format!(
            "service account of namespace {sa_ns:?} may not act for namespace {namespace:?}"
        ));
    }
    if let Some(bound) = identity.pod_name.as_deref()
        && bound != pod
    {
        return Err(format!("token is bound to pod {bound:?}, not {pod:?}"));
    }
    Ok(())
}

/// Whether a token bound to pod UID `bound` may act for the pod now known as `current`; both
/// are known only for bound tokens and watched pods. The error says why not (403).
pub fn same_incarnation(identity: &Identity, current: Option<&str>) -> Result<(), String> {
    match (identity.pod_uid.as_deref(), current) {
        (Some(bound), Some(current)) if bound != current => Err(format!(
            "token is bound to an earlier pod of this name (uid {bound}); the pod is now uid {current}"
        )),
        _ => Ok(()),
    }
}

/// Reads an [`Identity`] from a TokenReview's user.
pub fn identity_from_user(user: &UserInfo) -> Result<Identity, AuthError> {
    let username = user
        .username
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| AuthError::Unauthenticated("token review returned no user".into()))?;
    let (namespace, service_account) = match username.strip_prefix(SA_PREFIX) {
        Some(rest) => match rest.split_once(':') {
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() => {
                (Some(ns.to_string()), Some(sa.to_string()))
            }
            _ => (None, None),
        },
        None => (None, None),
    };
    let extra = |key: &str| {
        user.extra
            .as_ref()
            .and_then(|e| e.get(key))
            .and_then(|v| v.first())
            .filter(|p| !p.is_empty())
            .cloned()
    };
    Ok(Identity {
        username,
        namespace,
        service_account,
        pod_name: extra(POD_NAME_EXTRA),
        pod_uid: extra(POD_UID_EXTRA),
    })
}

type TokenHash = [u8; 32];
/// A review outcome and when it expires.
type CacheEntry = (Result<Identity, AuthError>, Instant);

fn hash_token(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// Reviews tokens with the API server (`authentication.k8s.io/v1` TokenReview), with a cache.
pub struct TokenReviewAuthenticator {
    client: kube::Client,
    audiences: Vec<String>,
    ttl: Duration,
    cache: Mutex<HashMap<TokenHash, CacheEntry>>,
    limit: Semaphore,
    metrics: Option<Metrics>,
}

impl TokenReviewAuthenticator {
    /// `audiences`: when non-empty, tokens must be issued for one of them.
    pub fn new(client: kube::Client, audiences: Vec<String>, ttl: Duration) -> Self {
        TokenReviewAuthenticator {
            client,
            audiences,
            ttl,
            cache: Mutex::new(HashMap::new()),
            limit: Semaphore::new(MAX_CONCURRENT_REVIEWS),
            metrics: None,
        }
    }

    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn cached(&self, key: &TokenHash) -> Option<Result<Identity, AuthError>> {
        let cache = self.cache.lock();
        let (result, until) = cache.get(key)?;
        (Instant::now() < *until).then(|| result.clone())
    }

    fn remember(&self, key: TokenHash, result: &Result<Identity, AuthError>) {
        let ttl = match result {
            Ok(_) => self.ttl,
            Err(AuthError::Unauthenticated(_)) => NEGATIVE_CACHE_TTL.min(self.ttl),
            Err(AuthError::Unavailable(_)) => return,
        };
        if ttl.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut cache = self.cache.lock();
        if cache.len() >= MAX_CACHE_ENTRIES {
            cache.retain(|_, (_, until)| *until > now);
            if cache.len() >= MAX_CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(key, (result.clone(), now + ttl));
    }

    async fn review(&self, token: &str) -> Result<Identity, AuthError> {
        let _permit = self
            .limit
            .acquire()
            .await
            .map_err(|_| AuthError::Unavailable("authenticator closed".into()))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: (!self.audiences.is_empty()).then(|| self.audiences.clone()),
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let reviewed = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Unavailable(e.to_string()))?;
        let status = reviewed.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = status
                .error
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "token not authenticated".to_string());
            return Err(AuthError::Unauthenticated(why));
        }
        if !self.audiences.is_empty() {
            let got = status.audiences.unwrap_or_default();
            if !got.iter().any(|a| self.audiences.contains(a)) {
                return Err(AuthError::Unauthenticated(format!(
                    "token is not issued for audience {:?}",
                    self.audiences
                )));
            }
        }
        let user = status
            .user
            .ok_or_else(|| AuthError::Unauthenticated("token review returned no user".into()))?;
        identity_from_user(&user)
    }
}

impl Authenticator for TokenReviewAuthenticator {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Identity, AuthError>> {
        Box::pin(async move {
            let key = hash_token(token);
            if let Some(hit) = self.cached(&key) {
                if let Some(m) = &self.metrics {
                    m.token_review("cached");
                }
                return hit;
            }
            let span = crate::telemetry::token_review_span();
            let result = self.review(token).instrument(span.clone()).await;
            if !span.is_disabled() {
                let outcome = match &result {
                    Ok(id) => {
                        if let Some(ns) = &id.namespace {
                            span.record("k8s.namespace.name", ns.as_str());
                        }
                        if let Some(pod) = &id.pod_name {
                            span.record("k8s.pod.name", pod.as_str());
                        }
                        "authenticated"
                    }
                    Err(AuthError::Unauthenticated(_)) => "rejected",
                    Err(AuthError::Unavailable(_)) => {
                        span.record("otel.status_code", "ERROR");
                        "error"
                    }
                };
                span.record("tollgate.outcome", outcome);
            }
            if let Some(m) = &self.metrics {
                m.token_review(match &result {
                    Ok(_) => "authenticated",
                    Err(AuthError::Unauthenticated(_)) => "rejected",
                    Err(AuthError::Unavailable(_)) => "error",
                });
            }
            if let Err(e) = &result {
                tracing::debug!(error = %e, "token review failed");
            }
            self.remember(key, &result);
            result
        })
    }
}

impl<A: Authenticator + ?Sized> Authenticator for Arc<A> {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Identity, AuthError>> {
        (**self).authenticate(token)
    }
}

#[cfg(test)]
mod tests;
