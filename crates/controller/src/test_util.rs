//! Builders and fakes shared by the unit tests.

use std::collections::{BTreeMap, HashMap};

use futures_util::future::BoxFuture;
use tollgate_crd::RateLimitPolicy;

use crate::auth::{AuthError, Authenticator, Identity};
use crate::index::{PodInput, PolicyInput};

/// A policy selecting `app=<app>` with `rules` token-bucket rules of `requests`/1m.
pub fn mk_policy_rules(
    ns: &str,
    name: &str,
    app: &str,
    requests: u64,
    rules: usize,
) -> RateLimitPolicy {
    let mut yaml = format!(
        "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: {ns}, uid: uid-{name}, generation: {requests}}}\nspec:\n  targetRef: {{selector: {{matchLabels: {{app: {app}}}}}}}\n  rules:\n"
    );
    for i in 0..rules {
        yaml.push_str(&format!(
            "  - name: rule-{i}\n    match: {{methods: [POST], path: {{prefix: /payments/{i}}}, headers: [{{name: x-plan, value: free}}]}}\n    key: [{{header: x-api-key}}, {{clientIP: {{trustedHops: 1}}}}]\n    limit: {{requests: {requests}, period: 1m}}\n"
        ));
    }
    tollgate_crd::parse_yaml(&yaml).unwrap().remove(0)
}

pub fn mk_policy(ns: &str, name: &str, app: &str, requests: u64) -> RateLimitPolicy {
    mk_policy_rules(ns, name, app, requests, 1)
}

/// A policy that fails compilation (`requests: 0`, and a bad regex).
pub fn mk_bad_policy(ns: &str, name: &str, app: &str, generation: i64) -> RateLimitPolicy {
    let yaml = format!(
        "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: {ns}, uid: uid-{name}, generation: {generation}}}\nspec:\n  targetRef: {{selector: {{matchLabels: {{app: {app}}}}}}}\n  rules:\n  - name: broken\n    match: {{path: {{regex: '(['}}}}\n    limit: {{requests: 0, period: 1m}}\n"
    );
    tollgate_crd::parse_yaml(&yaml).unwrap().remove(0)
}

pub fn input(p: &RateLimitPolicy) -> PolicyInput {
    PolicyInput::from_policy(p).unwrap()
}

pub fn mk_pod(ns: &str, name: &str, labels: &[(&str, &str)]) -> PodInput {
    PodInput {
        namespace: ns.to_string(),
        name: name.to_string(),
        uid: None,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// [`mk_pod`] with a UID, as the watch delivers it; another UID under the same name is a
/// re-created pod.
pub fn mk_pod_uid(ns: &str, name: &str, uid: &str, labels: &[(&str, &str)]) -> PodInput {
    PodInput {
        uid: Some(uid.to_string()),
        ..mk_pod(ns, name, labels)
    }
}

/// Accepts tokens `sa:<ns>:<sa>`, `pod:<ns>:<sa>:<pod>` and `pod:<ns>:<sa>:<pod>:<uid>` (bound);
/// anything else is rejected;
/// `down` means the review API is unavailable.
#[derive(Default)]
pub struct FakeAuth {
    pub extra: HashMap<String, Identity>,
}

impl Authenticator for FakeAuth {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Identity, AuthError>> {
        Box::pin(async move {
            if let Some(id) = self.extra.get(token) {
                return Ok(id.clone());
            }
            let parts: Vec<&str> = token.split(':').collect();
            match parts.as_slice() {
                ["sa", ns, sa] => Ok(Identity {
                    username: format!("system:serviceaccount:{ns}:{sa}"),
                    namespace: Some(ns.to_string()),
                    service_account: Some(sa.to_string()),
                    pod_name: None,
                    pod_uid: None,
                }),
                ["pod", ns, sa, pod] => Ok(Identity {
                    username: format!("system:serviceaccount:{ns}:{sa}"),
                    namespace: Some(ns.to_string()),
                    service_account: Some(sa.to_string()),
                    pod_name: Some(pod.to_string()),
                    pod_uid: None,
                }),
                ["pod", ns, sa, pod, uid] => Ok(Identity {
                    username: format!("system:serviceaccount:{ns}:{sa}"),
                    namespace: Some(ns.to_string()),
                    service_account: Some(sa.to_string()),
                    pod_name: Some(pod.to_string()),
                    pod_uid: Some(uid.to_string()),
                }),
                ["down"] => Err(AuthError::Unavailable("api server down".into())),
                _ => Err(AuthError::Unauthenticated("bad token".into())),
            }
        })
    }
}
