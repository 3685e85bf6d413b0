//! Policy files: the standalone sidecar, `check` and replay read RateLimitPolicies from a file
//! or a directory; the sidecar reloads them when they change.
//!
//! Changes are detected by polling a fingerprint (paths, sizes, modification times) rather than
//! with inotify: Kubernetes ConfigMap volumes update by swapping a symlinked directory, which
//! file-level watches miss, and one `stat` per file per second costs nothing.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::CompiledPolicy;

/// One problem in the policy files, with the file and field it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// The files a `--policies` argument names: the file itself, or the YAML/JSON files directly in
/// the directory (sorted; hidden entries such as ConfigMap's `..data` skipped).
pub fn policy_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let meta =
        std::fs::metadata(path).map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    let entries =
        std::fs::read_dir(path).map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
    for entry in entries {
        let entry = entry.map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        let p = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        let ext_ok = matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        );
        if ext_ok && std::fs::metadata(&p).is_ok_and(|m| m.is_file()) {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// What changes when a policy file changes.
pub fn fingerprint(path: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    policy_files(path)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).ok();
            let len = m.as_ref().map_or(0, |m| m.len());
            let mtime = m.and_then(|m| m.modified().ok());
            (p, len, mtime)
        })
        .collect()
}

/// Reads and compiles every policy under `path`. All errors are returned, each prefixed with
/// its file; nothing is applied unless everything compiles. Fields the API does not define are
/// errors, as in the admission webhook.
pub fn load(path: &Path) -> Result<Vec<CompiledPolicy>, Vec<ConfigError>> {
    let files = policy_files(path).map_err(|e| vec![e])?;
    if files.is_empty() {
        return Err(vec![ConfigError(format!(
            "{}: no .yaml, .yml or .json policy files found",
            path.display()
        ))]);
    }
    let mut out: Vec<CompiledPolicy> = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        let text = match std::fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) => {
                errors.push(ConfigError(format!("{}: {e}", file.display())));
                continue;
            }
        };
        // Unknown fields (`burts:` for `burst:`) are errors, reported with the compile errors.
        match crate::parse_yaml_documents(&text) {
            Err(e) => errors.push(ConfigError(format!("{}: {e}", file.display()))),
            Ok(docs) => {
                for doc in &docs {
                    let policy = &doc.policy;
                    match doc.compile() {
                        Ok(c) => {
                            if out.iter().any(|p| p.id() == c.id()) {
                                errors.push(ConfigError(format!(
                                    "{}: policy {} is defined more than once",
                                    file.display(),
                                    c.id()
                                )));
                            } else {
                                out.push(c);
                            }
                        }
                        Err(errs) => {
                            let name = policy.metadata.name.as_deref().unwrap_or("?");
                            for e in errs.0 {
                                errors.push(ConfigError(format!(
                                    "{}: policy {name}: {e}",
                                    file.display()
                                )));
                            }
                        }
                    }
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}
