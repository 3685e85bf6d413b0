//! The answer of a sidecar's `GET /debug/why` (which rules one request would meet, the state of
//! the key each counts it under, and what would happen to it), as the sidecar writes it
//! (crates/engine/src/explain.rs) and `kubectl tollgate why` reads it.
//!
//! The plugin and the sidecars it asks are upgraded apart, so the types read answers of other
//! versions: fields a newer sidecar adds are ignored (no `deny_unknown_fields`), descriptive ones
//! an older sidecar lacks default to empty, and only what every answer carries is required.
//! Values the plugin only shows (mode, scope, algorithm, the key source) stay strings, so a
//! value a newer policy API adds does not make an older plugin refuse the whole answer.

use serde::{Deserialize, Serialize};

/// The whole answer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WhyAnswer {
    /// The request's fate over all rules.
    pub decision: Decision,
    /// The version of the rule set that answered.
    pub version: u64,
    pub request: AskedRequest,
    /// Every rule in force in the sidecar, in the order it decides them.
    pub rules: Vec<ExplainedRule>,
}

/// The request as the sidecar understood the query: header names only, never their values.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AskedRequest {
    pub method: String,
    /// The path with its query string.
    pub path: String,
    pub headers: Vec<String>,
    /// The peer address key parts and bypass networks see.
    pub client_ip: String,
}

/// What settles the request: the first enforcing rule that rejects it (or cannot decide),
/// else the one that delays it or whose balance was not read; no rule when it is admitted.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

/// What a balance would do with the request now.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Admitted,
    /// Shaped: held before it is forwarded.
    Delayed,
    /// 429.
    Rejected,
    /// Redis did not answer and the rule fails closed (503).
    Unavailable,
    /// A Global rule's balance is in Redis and was not read (or Redis did not answer and the
    /// rule fails open). Also how an outcome a newer sidecar names reads here.
    #[serde(other)]
    Unknown,
}

impl Outcome {
    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Delayed => "delayed",
            Outcome::Rejected => "rejected",
            Outcome::Unavailable => "unavailable",
            Outcome::Unknown => "unknown",
        }
    }
}

/// One rule: what it is, whether it counts the request, and if so its key's state in the pod
/// and what it would do.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ExplainedRule {
    /// The policy's id, `namespace/name`.
    pub policy: String,
    pub rule: String,
    /// `Enforce` or `Shadow`, as the policy spells it.
    #[serde(default)]
    pub mode: String,
    /// `Global` or `Local`.
    #[serde(default)]
    pub scope: String,
    /// `TokenBucket`, `SlidingWindow`, ...
    #[serde(default)]
    pub algorithm: String,
    /// The rule in words (what it matches, counts and does).
    #[serde(default)]
    pub describe: String,
    /// Whether method, path, headers and the client address select the request.
    pub matches: bool,
    /// `counted`, or why not, as `bypassed: ...`, `not matched: ...` or `skipped: ...`.
    pub outcome: String,
    /// The key part the request lacks when the rule's `onMissingKey` is not Skip, as the
    /// compiled rule spells the source (`{"header": "x-api-key"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_key_part: Option<serde_json::Value>,
    /// The key's identity, never the raw key. Only when counted, like the fields below.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<KeyState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub would: Option<Would>,
}

/// The word [`ExplainedRule::outcome`] holds for a rule that counts the request.
pub const COUNTED: &str = "counted";

/// The key's state in the pod: a `blockFor` block, a local limiter's counter, or a Global
/// rule's lease (`store: redis`). Each shape fills its own fields.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct KeyState {
    /// Whether the pod holds state for the key (a counter, a block or a lease).
    #[serde(default)]
    pub tracked: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_for_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    /// Until the local limit is full again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_ms: Option<u64>,
    /// Concurrency rules: requests in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u64>,
    /// `redis` for a Global rule's lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// `Leased` or `Exact`, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_mode_why: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_sidecars: Option<u32>,
    /// Tokens of the lease held in this pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leased_here: Option<u64>,
    /// The bucket's balance at Redis's last answer for the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_remaining: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// What one rule would do with the request now, from the balance it is decided by; nothing
/// is charged.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Would {
    pub outcome: Outcome,
    #[serde(default)]
    pub why: String,
    /// Where the balance was read: `local`, `lease` or `redis`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Before this request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leased_here: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Shadow mode: the balance rejects, the rule admits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shadow_rejected: bool,
    /// Redis's error when it did not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Would {
    /// An outcome with its reason and no numbers yet.
    pub fn new(outcome: Outcome, why: &str) -> Self {
        Would {
            outcome,
            why: why.to_string(),
            source: None,
            remaining: None,
            limit: None,
            leased_here: None,
            delay_ms: None,
            retry_after_ms: None,
            shadow_rejected: false,
            error: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WhyAnswer {
        let mut counted = ExplainedRule {
            policy: "shop/p".into(),
            rule: "per-key".into(),
            mode: "Enforce".into(),
            scope: "Local".into(),
            algorithm: "TokenBucket".into(),
            describe: "5 per minute per x-api-key".into(),
            matches: true,
            outcome: COUNTED.into(),
            key_hash: Some("00ff00ff00ff00ff".into()),
            missing_key_part: Some(serde_json::json!({"header": "x-user"})),
            cost: Some(1),
            state: Some(KeyState {
                tracked: true,
                limit: Some(5),
                remaining: Some(0),
                reset_ms: Some(3000),
                ..KeyState::default()
            }),
            ..ExplainedRule::default()
        };
        counted.would = Some(Would {
            source: Some("local".into()),
            remaining: Some(0),
            limit: Some(5),
            retry_after_ms: Some(3000),
            ..Would::new(
                Outcome::Rejected,
                "this sidecar's bucket is empty for this cost",
            )
        });
        let skipped = ExplainedRule {
            policy: "shop/p".into(),
            rule: "admin-only".into(),
            outcome: "not matched: method, path or headers differ".into(),
            ..ExplainedRule::default()
        };
        WhyAnswer {
            decision: Decision {
                outcome: Outcome::Rejected,
                rule: Some("per-key".into()),
                policy: Some("shop/p".into()),
            },
            version: 3,
            request: AskedRequest {
                method: "GET".into(),
                path: "/x?y=1".into(),
                headers: vec!["x-api-key".into()],
                client_ip: "127.0.0.1".into(),
            },
            rules: vec![counted, skipped],
        }
    }

    #[test]
    fn an_answer_reads_back_as_written() {
        let answer = sample();
        let text = serde_json::to_string(&answer).unwrap();
        assert!(text.contains(r#""clientIp":"127.0.0.1""#), "{text}");
        assert!(text.contains(r#""retryAfterMs":3000"#), "{text}");
        assert!(
            text.contains(r#""missingKeyPart":{"header":"x-user"}"#),
            "{text}"
        );
        assert!(!text.contains("shadowRejected"), "{text}");
        assert!(!text.contains("leasedHere"), "{text}");
        let back: WhyAnswer = serde_json::from_str(&text).unwrap();
        assert_eq!(back, answer);
    }

    #[test]
    fn a_newer_sidecars_fields_and_outcomes_are_tolerated() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v["plan"] = "gold".into();
        v["rules"][0]["calendar"] = serde_json::json!({"month": 12});
        v["rules"][0]["would"]["outcome"] = "queued".into();
        let back: WhyAnswer = serde_json::from_value(v).unwrap();
        let would = back.rules[0].would.as_ref().unwrap();
        assert_eq!(would.outcome, Outcome::Unknown);
        assert_eq!(would.retry_after_ms, Some(3000));
        assert_eq!(back.decision, sample().decision);
    }

    #[test]
    fn a_missing_required_field_is_named() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v.as_object_mut().unwrap().remove("rules");
        let e = serde_json::from_value::<WhyAnswer>(v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `rules`"), "{e}");
        let mut v = serde_json::to_value(sample()).unwrap();
        v["rules"][0].as_object_mut().unwrap().remove("matches");
        let e = serde_json::from_value::<WhyAnswer>(v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `matches`"), "{e}");
    }

    #[test]
    fn outcomes_are_lowercase_words() {
        for o in [
            Outcome::Admitted,
            Outcome::Delayed,
            Outcome::Rejected,
            Outcome::Unknown,
            Outcome::Unavailable,
        ] {
            let v = serde_json::to_value(o).unwrap();
            assert_eq!(v, o.as_str());
            assert_eq!(serde_json::from_value::<Outcome>(v).unwrap(), o);
        }
    }
}
