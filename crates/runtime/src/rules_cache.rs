//! The last good rule set from the controller, kept on disk (`--rules-cache`).
//!
//! Why: rules otherwise live only in memory, so a sidecar that restarts (or a pod that is
//! rescheduled with its volume) while the controller is unreachable could never become ready,
//! and a controller outage plus a rollout would be an app outage. The injection webhook mounts
//! an `emptyDir` here: it survives container restarts, not a new pod.
//!
//! The file is written atomically (a temporary file in the same directory, synced, then
//! renamed), carries its format and wire version, and a checksum over the exact policy bytes,
//! so a torn or foreign file is refused on read instead of enforcing something half-written.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tollgate_crd::CompiledPolicy;

/// Layout version of the file itself (the policies inside follow [`tollgate_crd::WIRE_VERSION`]).
const FORMAT: u32 = 1;
/// Refuse absurd files before parsing them (rule sets are far smaller).
const MAX_BYTES: u64 = 16 << 20;

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CacheFile {
    format: u32,
    wire_version: u32,
    /// The controller URL the rules came from: a cache from another installation is refused.
    controller: String,
    version: u64,
    saved_unix_seconds: u64,
    /// SipHash-1-3 (128 bit) of `policies` and `members`, hex.
    checksum: String,
    /// The policies as JSON, kept as a string so the checksum covers the exact bytes.
    policies: String,
    /// Live sidecars per policy at the time (JSON): the divisor of fail-open shares until the
    /// controller is back.
    members: String,
}

/// A rule set read back from the cache.
#[derive(Debug)]
pub struct Cached {
    pub version: u64,
    pub policies: Vec<CompiledPolicy>,
    pub members: BTreeMap<String, u32>,
    /// Seconds since it was saved (0 if the clock went backwards).
    pub age_seconds: u64,
}

/// The cache file of one sidecar.
#[derive(Clone, Debug)]
pub struct RulesCache {
    path: PathBuf,
    controller: String,
}

impl RulesCache {
    pub fn new(path: PathBuf, controller: &str) -> RulesCache {
        RulesCache {
            path,
            controller: controller.to_string(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Saves `policies` as the last good rule set, replacing the previous file atomically.
    pub fn save(
        &self,
        version: u64,
        policies: &[CompiledPolicy],
        members: &BTreeMap<String, u32>,
    ) -> Result<(), String> {
        let body = serde_json::to_string(policies).map_err(|e| format!("encode: {e}"))?;
        let members = serde_json::to_string(members).map_err(|e| format!("encode: {e}"))?;
        let file = CacheFile {
            format: FORMAT,
            wire_version: tollgate_crd::WIRE_VERSION,
            controller: self.controller.clone(),
            version,
            saved_unix_seconds: unix_now(),
            checksum: checksum(&body, &members),
            policies: body,
            members,
        };
        let bytes = serde_json::to_vec(&file).map_err(|e| format!("encode: {e}"))?;
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            self.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "rules".into()),
            std::process::id()
        ));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("{}: {e}", self.path.display())
        })
    }

    /// Reads the cache back. `Ok(None)`: there is none (a new pod). `Err`: there is one, but
    /// it cannot be trusted (torn, from another wire version or installation); it is not used.
    pub fn load(&self) -> Result<Option<Cached>, String> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", self.path.display())),
        };
        if meta.len() > MAX_BYTES {
            return Err(format!(
                "{}: {} bytes, more than a rule cache can hold",
                self.path.display(),
                meta.len()
            ));
        }
        let bytes =
            std::fs::read(&self.path).map_err(|e| format!("{}: {e}", self.path.display()))?;
        let file: CacheFile = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{}: not a rule cache: {e}", self.path.display()))?;
        let refuse = |why: String| Err(format!("{}: {why}", self.path.display()));
        if file.format != FORMAT {
            return refuse(format!(
                "cache format {}, this sidecar reads {FORMAT}",
                file.format
            ));
        }
        if file.wire_version != tollgate_crd::WIRE_VERSION {
            return refuse(format!(
                "rules in wire version {}, this sidecar speaks {}",
                file.wire_version,
                tollgate_crd::WIRE_VERSION
            ));
        }
        if file.controller != self.controller {
            return refuse(format!(
                "saved from controller {}, this sidecar streams from {}",
                file.controller, self.controller
            ));
        }
        if checksum(&file.policies, &file.members) != file.checksum {
            return refuse("checksum mismatch (torn or edited file)".to_string());
        }
        let policies: Vec<CompiledPolicy> = serde_json::from_str(&file.policies)
            .map_err(|e| format!("{}: policies: {e}", self.path.display()))?;
        let members: BTreeMap<String, u32> = serde_json::from_str(&file.members)
            .map_err(|e| format!("{}: members: {e}", self.path.display()))?;
        Ok(Some(Cached {
            version: file.version,
            policies,
            members,
            age_seconds: unix_now().saturating_sub(file.saved_unix_seconds),
        }))
    }
}

fn checksum(policies: &str, members: &str) -> String {
    use std::hash::Hasher as _;
    let mut h = siphasher::sip128::SipHasher13::new();
    // Length-prefixed, so bytes cannot move from one part to the other unnoticed.
    h.write_u64(policies.len() as u64);
    h.write(policies.as_bytes());
    h.write(members.as_bytes());
    let v = siphasher::sip128::Hasher128::finish128(&h).as_u128();
    format!("{v:032x}")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> CompiledPolicy {
        let yaml = r#"
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: ns}
spec:
  targetRef: {selector: {}}
  rules:
    - name: r
      limit: {requests: 5, period: 1m}
"#;
        let docs = tollgate_crd::parse_yaml_documents(yaml).unwrap();
        docs[0].compile().unwrap()
    }

    #[test]
    fn saved_rules_read_back_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cache = RulesCache::new(dir.path().join("rules.json"), "https://c:8443");
        assert!(cache.load().unwrap().is_none(), "no file yet: a new pod");
        let members = BTreeMap::from([("ns/p".to_string(), 3)]);
        cache.save(7, &[policy()], &members).unwrap();
        let back = cache.load().unwrap().unwrap();
        assert_eq!((back.version, back.policies.len()), (7, 1));
        assert_eq!(back.members, members);
        assert_eq!(back.policies[0], policy());
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        // Another installation's controller: refused.
        let other = RulesCache::new(cache.path().to_path_buf(), "https://other:8443");
        assert!(other.load().unwrap_err().contains("saved from controller"));

        // A flipped byte inside the policies: the checksum catches it.
        let text = std::fs::read_to_string(cache.path()).unwrap();
        std::fs::write(cache.path(), text.replacen("\\\"r\\\"", "\\\"x\\\"", 1)).unwrap();
        assert!(cache.load().unwrap_err().contains("checksum mismatch"));

        // A torn write (truncated file): not a rule cache.
        std::fs::write(cache.path(), &text.as_bytes()[..text.len() / 2]).unwrap();
        assert!(cache.load().unwrap_err().contains("not a rule cache"));
    }
}
