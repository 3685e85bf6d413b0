//! Stable key hashes: the hash a counter key appears under in audit lines, top keys and
//! `tollgate-sidecar key-hash`.
//!
//! Support is asked "why does customer X get 429s?" and must find X in the logs of every pod
//! without raw keys ever being logged. So the key hash is an HMAC-SHA256 of the key under a
//! per-installation secret, truncated to 64 bits: the same client has the same key hash in
//! every pod that holds the secret and across restarts, while nobody without the secret can
//! compute or reverse it (counter keys are API keys and user ids, easy to guess from a list).
//! It is computed only for rejected requests. The hot path's SipHash fingerprint ([`Fingerprinter`]: blocks,
//! the `pk` partition key, the `Retry-After` jitter) is keyed from the same secret, so it too is
//! the same in every pod of the installation.

use std::io::Write;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::rules::Fingerprinter;

/// Shortest secret accepted: a secret is a key, not a password.
pub const MIN_SECRET_BYTES: usize = 16;
/// Bytes of a generated secret (written hex-encoded).
const GENERATED_SECRET_BYTES: usize = 32;
/// Domain separation: a secret reused elsewhere yields unrelated values here.
/// (The bytes keep their first name: changing them would change every key hash.)
const CONTEXT: &[u8] = b"tollgate key identity v1\0";
/// Domain separation of the hot path's SipHash keys from key hashes.
const HASHER_CONTEXT: &[u8] = b"tollgate key fingerprinter v1\0";

/// Computes key hashes under one secret.
#[derive(Clone)]
pub struct KeyHashes {
    /// Keyed once; cloned per key so the padded key blocks are not recomputed.
    mac: Hmac<Sha256>,
    /// Where the secret came from, for logs and `/debug`: never the secret itself.
    pub source: String,
    /// The hot path's fingerprints under the same secret.
    pub fingerprinter: Fingerprinter,
}

impl KeyHashes {
    /// Identities under `secret` (at least [`MIN_SECRET_BYTES`]).
    pub fn from_secret(secret: &[u8], source: String) -> Result<KeyHashes, String> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the key-hash secret ({source}) has {} bytes; at least {MIN_SECRET_BYTES} are needed",
                secret.len()
            ));
        }
        let mac = Hmac::<Sha256>::new_from_slice(secret)
            .map_err(|e| format!("the key-hash secret ({source}): {e}"))?;
        let mut keys = mac.clone();
        keys.update(HASHER_CONTEXT);
        let keys = keys.finalize().into_bytes();
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&keys[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        let fingerprinter = Fingerprinter::with_keys(word(0), word(1));
        Ok(KeyHashes {
            mac,
            source,
            fingerprinter,
        })
    }

    /// Key hashes valid for this process only: for a sidecar given no secret.
    pub fn per_process() -> Result<KeyHashes, String> {
        let secret = random_secret()?;
        KeyHashes::from_secret(&secret, "generated for this process".into())
    }

    /// Reads the secret at `path` (surrounding whitespace ignored); a missing file is an error.
    pub fn read(path: &Path) -> Result<KeyHashes, String> {
        let source = path.display().to_string();
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cannot read the key-hash secret {source}: {e}"))?;
        KeyHashes::from_secret(bytes.trim_ascii(), source)
    }

    /// Reads the secret at `path` (surrounding whitespace ignored, so a file written with a
    /// trailing newline works), or, when the file does not exist, generates one and writes it
    /// there (mode 0600, atomically) so that a standalone sidecar keeps its key hashes across
    /// restarts. Any other read error is an error: a secret that cannot be read must not be
    /// replaced silently.
    pub fn load_or_create(path: &Path) -> Result<KeyHashes, String> {
        let source = path.display().to_string();
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let secret = hex::encode(random_secret()?);
                write_new_secret(path, secret.as_bytes())
                    .map_err(|e| format!("cannot create the key-hash secret {source}: {e}"))?;
                tracing::info!(path = %source, "generated a new key-hash secret");
                KeyHashes::from_secret(secret.as_bytes(), source)
            }
            _ => KeyHashes::read(path),
        }
    }

    /// The key hash of a counter key (its parts each followed by 0x1f, as rules build it).
    pub fn of(&self, key: &[u8]) -> u64 {
        let mut mac = self.mac.clone();
        mac.update(CONTEXT);
        mac.update(key);
        let out = mac.finalize().into_bytes();
        let mut first = [0u8; 8];
        first.copy_from_slice(&out[..8]);
        u64::from_be_bytes(first)
    }

    /// The key hash of a key given as its parts, in the rule's key order (for `key-hash`).
    pub fn of_parts<S: AsRef<[u8]>>(&self, parts: &[S]) -> u64 {
        let mut key = Vec::new();
        for p in parts {
            key.extend_from_slice(p.as_ref());
            key.push(crate::keys::PART_SEPARATOR);
        }
        self.of(&key)
    }
}

/// How key hashes are printed everywhere: 16 lowercase hex digits.
pub fn display(key_hash: u64) -> String {
    format!("{key_hash:016x}")
}

fn random_secret() -> Result<[u8; GENERATED_SECRET_BYTES], String> {
    let mut secret = [0u8; GENERATED_SECRET_BYTES];
    getrandom::fill(&mut secret)
        .map_err(|e| format!("no randomness for a key-hash secret: {e}"))?;
    Ok(secret)
}

/// Writes a new file readable by its owner only, via a temporary file and a rename, so a
/// crash never leaves a half-written secret behind.
fn write_new_secret(path: &Path, secret: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(secret)?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(secret: &str) -> KeyHashes {
        KeyHashes::from_secret(secret.as_bytes(), "test".into()).unwrap()
    }

    #[test]
    fn the_same_secret_gives_the_same_key_hash_and_another_does_not() {
        let a = with("0123456789abcdef0123");
        let b = with("0123456789abcdef0123");
        let c = with("fedcba98765432100123");
        let key = b"customer-1\x1f";
        assert_eq!(a.of(key), b.of(key));
        assert_ne!(a.of(key), c.of(key));
        assert_ne!(a.of(key), a.of(b"customer-2\x1f"));
        assert_eq!(a.of_parts(&["customer-1"]), a.of(key));
        assert_eq!(display(a.of(key)).len(), 16);
        assert_eq!(a.fingerprinter.hash(key), b.fingerprinter.hash(key));
        assert_ne!(a.fingerprinter.hash(key), c.fingerprinter.hash(key));
        assert_ne!(a.fingerprinter.hash(key), a.of(key), "separate domains");
    }

    #[test]
    fn a_short_secret_is_refused() {
        let e = KeyHashes::from_secret(b"short", "f".into()).err().unwrap();
        assert!(e.contains("at least 16"), "{e}");
    }

    #[test]
    fn a_missing_file_is_created_once_and_then_read() {
        let dir = std::env::temp_dir().join(format!("tollgate-key-hash-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        let _ = std::fs::remove_file(&path);
        let first = KeyHashes::load_or_create(&path).unwrap();
        let again = KeyHashes::load_or_create(&path).unwrap();
        assert_eq!(first.of(b"k\x1f"), again.of(b"k\x1f"));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
