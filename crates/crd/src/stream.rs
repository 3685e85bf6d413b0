//! Messages of the controller → sidecar rule stream (`GET /v1/watch`, JSON lines).
//!
//! The stream carries whole rule sets, not deltas: the rules for one pod are few, a snapshot is
//! idempotent, and a sidecar that fell behind simply applies the latest one. Versions increase
//! monotonically for the lifetime of a controller; a sidecar reconnecting with `since=<version>`
//! gets no snapshot when it already holds that version. See `docs/rule-stream.md`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compiled::CompiledPolicy;

/// One line of the stream.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum StreamMessage {
    /// Every policy that selects the pod, compiled. Replaces whatever the sidecar held.
    #[serde(rename_all = "camelCase")]
    Snapshot {
        /// Wire format of the compiled policies ([`crate::WIRE_VERSION`]).
        wire_version: u32,
        version: u64,
        policies: Vec<CompiledPolicy>,
        /// Live sidecars per policy id (`namespace/name`).
        #[serde(default)]
        members: BTreeMap<String, u32>,
        /// Identifies the controller process: versions are only comparable within one epoch.
        epoch: String,
        /// The installation's key-hash secret (hex), under which sidecars compute the stable
        /// identities of counter keys in audit lines and top keys; absent when the controller
        /// has none. Not kept in the sidecar's rules cache.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key_hash_secret: Option<String>,
    },
    /// Membership changed; rules did not.
    #[serde(rename_all = "camelCase")]
    Members {
        version: u64,
        members: BTreeMap<String, u32>,
    },
    /// Keeps idle streams (and the proxies between) alive; carries the current version.
    #[serde(rename_all = "camelCase")]
    Heartbeat { version: u64 },
}

/// Body of `POST /v1/ack`: the sidecar enforces `version`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Ack {
    pub namespace: String,
    pub pod: String,
    pub version: u64,
    pub epoch: String,
}

/// Body of `POST /v1/top-keys`: the keys one sidecar rejected most since its last report, for
/// the controller's fleet-wide `status.topLimitedKeys`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TopKeysReport {
    pub namespace: String,
    pub pod: String,
    /// At most [`MAX_REPORTED_KEYS`].
    pub keys: Vec<ReportedKey>,
}

/// One key of a [`TopKeysReport`], counted by the sidecar's Space-Saving sketch.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ReportedKey {
    /// `namespace/policy/rule`.
    pub rule: String,
    /// The key's stable identity, 16 hex digits.
    pub key_hash: String,
    /// Rejections since the last report.
    pub rejected: u64,
    /// How many of `rejected` may belong to keys this one displaced in the sketch.
    #[serde(default)]
    pub max_overcount: u64,
}

/// Most keys one report may carry (the sidecar's sketch holds 64).
pub const MAX_REPORTED_KEYS: usize = 64;

/// Longest line a sidecar accepts from the stream; a bigger message is a protocol error.
pub const MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

/// Parses one stream line, refusing oversized input.
pub fn parse_line(line: &[u8]) -> Result<StreamMessage, String> {
    if line.len() > MAX_LINE_BYTES {
        return Err(format!(
            "stream line of {} bytes exceeds {MAX_LINE_BYTES}",
            line.len()
        ));
    }
    serde_json::from_slice(line).map_err(|e| format!("bad stream line: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_as_tagged_json() {
        let m = StreamMessage::Members {
            version: 7,
            members: BTreeMap::from([("ns/p".to_string(), 3)]),
        };
        let line = serde_json::to_string(&m).unwrap();
        assert_eq!(
            line,
            r#"{"type":"members","version":7,"members":{"ns/p":3}}"#
        );
        assert_eq!(parse_line(line.as_bytes()).unwrap(), m);
        let hb = parse_line(br#"{"type":"heartbeat","version":9}"#).unwrap();
        assert_eq!(hb, StreamMessage::Heartbeat { version: 9 });
        assert!(parse_line(b"{\"type\":\"nope\"}").is_err());
        assert!(parse_line(b"not json").is_err());
        assert!(parse_line(&vec![b' '; MAX_LINE_BYTES + 1]).is_err());
    }
}
