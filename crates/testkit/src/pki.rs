//! Certificates for TLS tests, made with the `openssl` binary (ECDSA P-256, valid two days).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What to tell a developer whose machine lacks `openssl`.
const GET_OPENSSL: &str =
    "install it (Debian/Ubuntu: `apt-get install openssl`; ./tools/test-all.sh does)";

/// A CA whose certificate and key are `<name>.crt` and `<name>.key` in a directory.
pub struct Ca {
    dir: PathBuf,
    name: String,
}

impl Ca {
    /// Makes a self-signed CA `name` with common name `cn` in `dir`.
    pub fn new(dir: &Path, name: &str, cn: &str) -> Ca {
        crate::require_tool("openssl", GET_OPENSSL);
        let ca = Ca {
            dir: dir.to_path_buf(),
            name: name.to_string(),
        };
        run(
            Command::new("openssl")
                .args(["req", "-x509"])
                .args(NEW_EC_KEY)
                .arg("-keyout")
                .arg(ca.key())
                .arg("-out")
                .arg(ca.crt())
                .args(["-days", "2", "-subj", &format!("/CN={cn}")])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]),
            "openssl: CA",
        );
        ca
    }

    pub fn crt(&self) -> PathBuf {
        self.dir.join(format!("{}.crt", self.name))
    }

    pub fn key(&self) -> PathBuf {
        self.dir.join(format!("{}.key", self.name))
    }

    /// Issues `<leaf>.crt` and `<leaf>.key` next to the CA, with common name `cn` and the
    /// extension lines `ext` (an `openssl x509 -extfile`, e.g. `subjectAltName=IP:127.0.0.1`).
    pub fn issue(&self, leaf: &str, cn: &str, ext: &str) {
        let path = |suffix: &str| self.dir.join(format!("{leaf}.{suffix}"));
        run(
            Command::new("openssl")
                .arg("req")
                .args(NEW_EC_KEY)
                .arg("-keyout")
                .arg(path("key"))
                .arg("-out")
                .arg(path("csr"))
                .args(["-subj", &format!("/CN={cn}")]),
            "openssl: CSR",
        );
        std::fs::write(path("ext"), ext).expect("write the extension file");
        run(
            Command::new("openssl")
                .args(["x509", "-req", "-days", "2"])
                .arg("-in")
                .arg(path("csr"))
                .arg("-CA")
                .arg(self.crt())
                .arg("-CAkey")
                .arg(self.key())
                .arg("-CAcreateserial")
                .arg("-extfile")
                .arg(path("ext"))
                .arg("-out")
                .arg(path("crt")),
            "openssl: sign",
        );
    }
}

const NEW_EC_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e}; {GET_OPENSSL}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
