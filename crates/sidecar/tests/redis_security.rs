//! Redis AUTH and TLS against a real TLS-only `redis-server`, and what the sidecar never writes
//! down: passwords, API keys and bearer tokens.
//!
//! A fresh PKI is made with the `openssl` binary (a CA, a server certificate for 127.0.0.1, a
//! client certificate, and an unrelated "rogue" CA). `redis-server` runs with `--port 0` (no
//! plain-text port), `--tls-port`, `requirepass` and a least-privilege ACL user. The real
//! `tollgate-sidecar` binary then:
//!
//! - enforces a global limit through that Redis with an ACL user, `--redis-password-file` and
//!   `--redis-ca-file`; a second sidecar with the credentials in the URL shares the same bucket;
//! - with a wrong password, and with a CA that did not sign the server's certificate (and with
//!   the system roots), cannot use Redis: the fail-closed rule answers 503, the fail-open rule
//!   admits, and one warning line says why;
//! - with mutual TLS required, fails without a client certificate and works with one;
//! - never shows a password in its stdout/stderr, `/debug/config`, `/debug/rules`, `/metrics`
//!   or `--help` (even with the URL in `TOLLGATE_REDIS_URL`).
//!
//! And, without Redis: keyed traffic (an API key header, a bearer JWT) with default settings
//! leaves neither the key, nor the token, nor its claim in the logs or admin endpoints;
//! `--audit-raw-keys` (off by default) is what puts the key in the audit line.
//!
//! Every process is started on free 127.0.0.1 ports and killed by PID when dropped.
//! Needs `openssl` and `redis-server`/`redis-cli` built with TLS (Debian's are):
//! `apt-get install openssl redis-server` (./tools/test-all.sh installs them).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]
#![allow(
    clippy::too_many_lines,
    reason = "a scenario test reads top to bottom as one story: setup, steps, checks"
)]

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use tollgate_testkit::pki::Ca;
use tollgate_testkit::require_tool;

/// The passwords the tests look for everywhere they must not be.
const DEFAULT_PASSWORD: &str = "pw-default-Zq81xK";
const USER_PASSWORD: &str = "pw-tollgate-Hv27Lm";
const WRONG_PASSWORD: &str = "pw-wrong-Rt55Ye";

/// These tests start several processes each; one at a time keeps timings sane on 2 cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// Tools and PKI

/// Certificates and keys for one test run.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// CA, server (127.0.0.1/localhost), client, and a rogue CA.
    fn generate() -> Pki {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = Ca::new(dir.path(), "ca", "tollgate-test-ca");
        Ca::new(dir.path(), "rogue-ca", "rogue-ca");
        ca.issue(
            "server",
            "tollgate-test-server",
            // clientAuth too: cluster nodes present it to each other on the TLS bus.
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth,clientAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        );
        ca.issue(
            "client",
            "tollgate-test-client",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        );
        Pki { dir }
    }
}

// ---------------------------------------------------------------------------------------------
// redis-server with TLS only

/// A free port whose cluster bus port (port + 10000) is free too.
fn free_bus_port_pair() -> u16 {
    for _ in 0..200 {
        let p = free_port();
        if p < 55_000 && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
    panic!("no free port pair for a cluster node");
}

/// The ACL a sidecar needs: its keys (`tg:*`), the scripts and the commands they call.
/// On Redis Cluster, `cluster|slots` lets the client find the shards.
const SIDECAR_ACL: &str = "on ~tg:* resetchannels -@all +evalsha +eval +script|load +ping \
     +time +hget +hset +hdel +hgetall +hlen +pexpire +pttl +set +zadd +zcard +zrem \
     +zremrangebyscore +cluster|slots";

/// A TLS-only `redis-server` (no plain-text port) with `requirepass` and an ACL user
/// `tollgate`, killed by PID when dropped.
struct TlsRedis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    fn start(pki: &Pki, client_certs: &str) -> TlsRedis {
        TlsRedis::start_with(pki, client_certs, &[])
    }

    fn start_with(pki: &Pki, client_certs: &str, extra: &[&str]) -> TlsRedis {
        require_tool(
            "redis-server",
            "install it (Debian/Ubuntu: `apt-get install redis-server`; ./tools/test-all.sh does)",
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let cluster = extra.contains(&"--cluster-enabled");
        let port = if cluster {
            free_bus_port_pair()
        } else {
            free_port()
        };
        // The ACL file keeps the passwords off redis-server's command line.
        let acl = dir.path().join("users.acl");
        let log = std::fs::File::create(dir.path().join("redis.log")).expect("redis log");
        std::fs::write(
            &acl,
            format!(
                "user default on >{DEFAULT_PASSWORD} ~* &* +@all\nuser tollgate {SIDECAR_ACL} \
                 >{USER_PASSWORD}\n"
            ),
        )
        .expect("write ACL file");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--bind", "127.0.0.1"])
            .args(["--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(pki.path("server.crt"))
            .arg("--tls-key-file")
            .arg(pki.path("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(pki.path("ca.crt"))
            .args(["--tls-auth-clients", client_certs])
            .arg("--aclfile")
            .arg(&acl)
            .args(["--save", "", "--appendonly", "no"])
            .args(extra)
            .args(if cluster {
                vec![
                    "--cluster-port".to_string(),
                    (port + 10_000).to_string(),
                    "--cluster-node-timeout".to_string(),
                    "2000".to_string(),
                ]
            } else {
                Vec::new()
            })
            .arg("--dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("redis log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server: {e}"));
        let r = TlsRedis {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if r.cli(pki, &["PING"]).trim() == "PONG" {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "TLS redis-server did not answer PING on 127.0.0.1:{port} within 15 s (is it \
                 built with TLS? `redis-server --tls-port` must be supported): {}\n{}",
                r.cli(pki, &["PING"]),
                std::fs::read_to_string(r._dir.path().join("redis.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// redis-cli over TLS as the default user (the password via `REDISCLI_AUTH`).
    fn cli(&self, pki: &Pki, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["--tls", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("--cacert")
            .arg(pki.path("ca.crt"))
            .arg("--cert")
            .arg(pki.path("client.crt"))
            .arg("--key")
            .arg(pki.path("client.key"))
            .args(args)
            .env("REDISCLI_AUTH", DEFAULT_PASSWORD)
            .stdin(Stdio::null())
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr)
            })
            .unwrap_or_default()
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// The sidecar, with stdout and stderr both captured

struct Proc {
    child: Child,
    listen: SocketAddr,
    admin: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

impl Proc {
    /// Starts `tollgate-sidecar --policies <yaml>` with `extra` arguments and `env`; waits for its
    /// start-up line.
    fn start(upstream: &str, yaml: &str, extra: &[String], env: &[(&str, String)]) -> Proc {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("policy.yaml"), yaml).expect("write policy");
        let mut cmd = Command::new(BIN);
        cmd.arg("--policies")
            .arg(dir.path())
            .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--upstream", upstream])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tollgate-sidecar");
        let lines = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let lines = Arc::clone(&lines);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push(line);
                }
            });
        }
        let mut p = Proc {
            child,
            listen: ([0, 0, 0, 0], 0).into(),
            admin: ([0, 0, 0, 0], 0).into(),
            lines,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some((listen, admin)) = p.lines().iter().find_map(|l| started_line(l)) {
                p.listen = listen;
                p.admin = admin;
                return p;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("sidecar exited ({status}):\n{}", p.lines().join("\n"));
            }
            assert!(
                Instant::now() < deadline,
                "sidecar did not start within 30 s:\n{}",
                p.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listen)
    }

    async fn admin_get(&self, path: &str) -> String {
        let resp = client()
            .get(format!("http://{}{path}", self.admin))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        resp.text().await.expect("admin body")
    }

    async fn debug_config(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin_get("/debug/config").await).expect("/debug/config JSON")
    }

    /// Waits until `/debug/config` says Redis is connected (the first heartbeat connects).
    async fn wait_connected(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let cfg = self.debug_config().await;
            if cfg["redis"]["connected"] == true {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not connected to redis within 20 s: {cfg}\n{}",
                self.lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for a log line containing every needle; returns it.
    async fn wait_log(&self, needles: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(l) = self
                .lines()
                .into_iter()
                .find(|l| needles.iter().all(|n| l.contains(n)))
            {
                return l;
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {needles:?} within 20 s:\n{}",
                self.lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Everything the process wrote and its admin endpoints show.
    async fn everything_visible(&self) -> String {
        let mut all = self.lines().join("\n");
        for path in [
            "/debug/config",
            "/debug/rules",
            "/debug/top-keys",
            "/metrics",
        ] {
            all.push('\n');
            all.push_str(&self.admin_get(path).await);
        }
        all
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL to this child's PID only.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let lines = self.lines();
            eprintln!(
                "---- sidecar output (last 40 lines) ----\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
}

fn assert_secret_free(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        assert!(
            !text.contains(s),
            "{what} contains the secret {s:?}:\n{text}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Two global rules with the same limit, one failing closed and one failing open.
fn failure_mode_policy() -> String {
    policy(
        "secure",
        r#"
        rules:
        - name: closed
          match: {path: {prefix: /closed}}
          key: [{header: x-client}]
          limit: {requests: 5, period: 1m, burst: 5}
          scope: Global
          failureMode: Closed
        - name: open
          match: {path: {prefix: /open}}
          key: [{header: x-client}]
          limit: {requests: 5, period: 1m, burst: 5}
          scope: Global
          failureMode: Open
        "#,
    )
}

fn file_with(dir: &Path, name: &str, content: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).expect("write file");
    p
}

fn arg(flag: &str, path: &Path) -> String {
    format!("{flag}={}", path.display())
}

/// Requests that need Redis on a fresh key: a fail-closed rule answers 503, a fail-open one
/// admits.
async fn assert_failure_modes(sidecar: &Proc, client_id: &str) {
    let c = client();
    let closed = status_of(&c, &sidecar.url("/closed"), &[("x-client", client_id)]).await;
    assert_eq!(closed, 503, "fail-closed rule without Redis");
    let open = status_of(&c, &sidecar.url("/open"), &[("x-client", client_id)]).await;
    assert_eq!(open, 200, "fail-open rule without Redis");
}

#[tokio::test]
async fn redis_auth_and_tls_work_and_failures_follow_the_failure_mode() {
    let _serial = SERIAL.lock().await;
    within(240, async {
        let pki = Pki::generate();
        let redis = TlsRedis::start(&pki, "no");
        let up = Upstream::start().await;
        let yaml = failure_mode_policy();
        let secrets = tempfile::tempdir().unwrap();
        let password_file = file_with(secrets.path(), "password", &format!("{USER_PASSWORD}\n"));
        let wrong_file = file_with(secrets.path(), "wrong", WRONG_PASSWORD);
        let url = format!("rediss://127.0.0.1:{}", redis.port);
        let all_secrets = [DEFAULT_PASSWORD, USER_PASSWORD, WRONG_PASSWORD];

        // --- ACL user + password file + CA file.
        let a = Proc::start(
            &up.url(),
            &yaml,
            &[
                format!("--redis={url}"),
                "--redis-username=tollgate".into(),
                arg("--redis-password-file", &password_file),
                arg("--redis-ca-file", &pki.path("ca.crt")),
            ],
            &[],
        );
        // --- the same Redis with the credentials in the URL (and the CA from the environment).
        let b = Proc::start(
            &up.url(),
            &yaml,
            &[format!(
                "--redis=rediss://tollgate:{USER_PASSWORD}@127.0.0.1:{}",
                redis.port
            )],
            &[(
                "TOLLGATE_REDIS_CA_FILE",
                pki.path("ca.crt").display().to_string(),
            )],
        );
        a.wait_connected().await;
        b.wait_connected().await;
        let line = a.wait_log(&["connected to redis"]).await;
        assert!(line.contains("\"tls\":true"), "{line}");
        let started = b.wait_log(&["tollgate-sidecar started"]).await;
        assert!(
            started.contains(&format!("rediss://tollgate:***@127.0.0.1:{}", redis.port)),
            "the start-up line names Redis, redacted: {started}"
        );
        let cfg = a.debug_config().await;
        assert_eq!(cfg["redis"]["tls"], true, "{cfg}");
        assert_eq!(cfg["redis"]["username"], "tollgate", "{cfg}");
        assert_eq!(
            cfg["redis"]["passwordFile"],
            password_file.display().to_string()
        );

        // One global bucket of 5 shared by both sidecars: 5 admitted in all, then 429.
        let c = client();
        let key = [("x-client", "shared")];
        let from_a = statuses(&c, &a.url("/closed"), &key, 5).await;
        let from_b = statuses(&c, &b.url("/closed"), &key, 5).await;
        let more_a = statuses(&c, &a.url("/closed"), &key, 3).await;
        let admitted = from_a
            .iter()
            .chain(&from_b)
            .chain(&more_a)
            .filter(|s| **s == 200)
            .count();
        eprintln!("shared bucket of 5 over TLS: a {from_a:?}, b {from_b:?}, a again {more_a:?}");
        assert!(
            from_a
                .iter()
                .chain(&from_b)
                .chain(&more_a)
                .all(|s| *s == 200 || *s == 429),
            "only 200 and 429 while Redis is healthy"
        );
        // 5 per minute: at most one token refills while the test runs; local enforcement
        // would admit 5 per sidecar. Fewer than 5 is possible while tokens are parked in a
        // lease on their way back (docs/global-limits.md).
        assert!(
            (3..=6).contains(&admitted),
            "{admitted} admitted across two sidecars for a global limit of 5"
        );
        assert!(
            from_b.contains(&429) || more_a.contains(&429),
            "the second sidecar saw the first one's spending"
        );
        let groups = redis.cli(&pki, &["--scan", "--pattern", "tg:{g*"]);
        assert!(
            groups.lines().any(|l| l.starts_with("tg:{g")),
            "buckets live in Redis: {groups}"
        );
        let metrics = a.admin_get("/metrics").await;
        assert!(
            metric(&metrics, "tollgate_tokens_leased_total", &[]).unwrap_or(0.0) > 0.0,
            "{metrics}"
        );

        // --- wrong password.
        let wrong = Proc::start(
            &up.url(),
            &yaml,
            &[
                format!("--redis={url}"),
                "--redis-username=tollgate".into(),
                arg("--redis-password-file", &wrong_file),
                arg("--redis-ca-file", &pki.path("ca.crt")),
            ],
            &[],
        );
        let line = wrong
            .wait_log(&["cannot connect to redis", "authentication failed"])
            .await;
        eprintln!("wrong password: {line}");
        assert!(line.contains("\"level\":\"WARN\""), "{line}");
        assert!(line.contains("\"kind\":\"auth\""), "{line}");
        assert_failure_modes(&wrong, "w1").await;
        let cfg = wrong.debug_config().await;
        assert_eq!(cfg["redis"]["connected"], false, "{cfg}");
        assert!(
            cfg["redis"]["lastError"]
                .as_str()
                .unwrap_or_default()
                .contains("authentication failed"),
            "{cfg}"
        );
        let metrics = wrong.admin_get("/metrics").await;
        assert!(
            metric(&metrics, "tollgate_redis_errors_total", &[("kind", "auth")]).unwrap_or(0.0)
                > 0.0,
            "{metrics}"
        );

        // --- a password file that does not exist (an optional Secret that is missing).
        let missing = Proc::start(
            &up.url(),
            &yaml,
            &[
                format!("--redis={url}"),
                arg("--redis-password-file", &secrets.path().join("absent")),
                arg("--redis-ca-file", &pki.path("ca.crt")),
            ],
            &[],
        );
        let line = missing
            .wait_log(&["cannot connect to redis", "--redis-password-file"])
            .await;
        assert!(line.contains("\"kind\":\"config\""), "{line}");
        assert_failure_modes(&missing, "m1").await;

        // --- a CA that did not sign the server certificate, and the system roots.
        let rogue = Proc::start(
            &up.url(),
            &yaml,
            &[
                format!("--redis={url}"),
                "--redis-username=tollgate".into(),
                arg("--redis-password-file", &password_file),
                arg("--redis-ca-file", &pki.path("rogue-ca.crt")),
            ],
            &[],
        );
        let line = rogue
            .wait_log(&["cannot connect to redis", "certificate"])
            .await;
        eprintln!("untrusted CA: {line}");
        assert!(line.contains("UnknownIssuer"), "{line}");
        assert_failure_modes(&rogue, "r1").await;
        let system_roots = Proc::start(
            &up.url(),
            &yaml,
            &[
                format!("--redis={url}"),
                "--redis-username=tollgate".into(),
                arg("--redis-password-file", &password_file),
            ],
            &[],
        );
        system_roots
            .wait_log(&["cannot connect to redis", "certificate"])
            .await;
        assert_failure_modes(&system_roots, "s1").await;

        // The breaker opened and said why, once.
        let opened = rogue
            .wait_log(&["redis unreachable: global rules follow their failure mode"])
            .await;
        assert!(opened.contains("certificate"), "{opened}");

        // --- plain text to a TLS-only server is refused by the server: not an option either.
        let plain = Proc::start(
            &up.url(),
            &yaml,
            &[format!("--redis=redis://127.0.0.1:{}", redis.port)],
            &[],
        );
        plain.wait_log(&["cannot connect to redis"]).await;
        assert_failure_modes(&plain, "p1").await;

        // --- --redis-ca-file with redis:// is refused at start-up rather than ignored.
        let out = Command::new(BIN)
            .args([
                "--policies",
                "/nonexistent",
                "--upstream",
                "http://127.0.0.1:1",
            ])
            .arg(format!(
                "--redis=redis://:{USER_PASSWORD}@127.0.0.1:{}",
                redis.port
            ))
            .arg(arg("--redis-ca-file", &pki.path("ca.crt")))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .output()
            .expect("run sidecar");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            text.contains("--redis-ca-file needs a rediss:// URL"),
            "{text}"
        );
        assert_secret_free("a start-up error", &text, &all_secrets);

        // --- nothing shows a password.
        for (name, p) in [
            ("a", &a),
            ("b", &b),
            ("wrong", &wrong),
            ("missing", &missing),
            ("rogue", &rogue),
            ("system roots", &system_roots),
            ("plain", &plain),
        ] {
            let seen = p.everything_visible().await;
            assert_secret_free(
                &format!("sidecar {name}'s output and admin endpoints"),
                &seen,
                &all_secrets,
            );
        }
        // Not even --help with the URL in the environment (clap shows env values by default).
        let out = Command::new(BIN)
            .arg("--help")
            .env(
                "TOLLGATE_REDIS_URL",
                format!("rediss://tollgate:{USER_PASSWORD}@127.0.0.1:1"),
            )
            .output()
            .expect("--help");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("--redis-password-file"), "{help}");
        assert_secret_free("--help", &help, &all_secrets);
    })
    .await;
}

#[tokio::test]
async fn mutual_tls_needs_the_client_certificate() {
    let _serial = SERIAL.lock().await;
    within(120, async {
        let pki = Pki::generate();
        let redis = TlsRedis::start(&pki, "yes");
        let up = Upstream::start().await;
        let yaml = failure_mode_policy();
        let secrets = tempfile::tempdir().unwrap();
        let password_file = file_with(secrets.path(), "password", USER_PASSWORD);
        let base = vec![
            format!("--redis=rediss://127.0.0.1:{}", redis.port),
            "--redis-username=tollgate".to_string(),
            arg("--redis-password-file", &password_file),
            arg("--redis-ca-file", &pki.path("ca.crt")),
        ];

        let without = Proc::start(&up.url(), &yaml, &base, &[]);
        let line = without.wait_log(&["cannot connect to redis"]).await;
        eprintln!("no client certificate: {line}");
        assert_failure_modes(&without, "n1").await;

        let mut with_cert = base.clone();
        with_cert.push(arg("--redis-client-cert-file", &pki.path("client.crt")));
        with_cert.push(arg("--redis-client-key-file", &pki.path("client.key")));
        let with = Proc::start(&up.url(), &yaml, &with_cert, &[]);
        with.wait_connected().await;
        let got = statuses(&client(), &with.url("/closed"), &[("x-client", "m")], 7).await;
        eprintln!("mutual TLS, limit 5: {got:?}");
        let admitted = got.iter().filter(|s| **s == 200).count();
        assert!(got.iter().all(|s| *s == 200 || *s == 429), "{got:?}");
        assert!((1..=6).contains(&admitted) && got.contains(&429), "{got:?}");
        let cfg = with.debug_config().await;
        assert_eq!(
            cfg["redis"]["clientCertFile"],
            pki.path("client.crt").display().to_string()
        );
        for p in [&without, &with] {
            let seen = p.everything_visible().await;
            assert_secret_free("sidecar output", &seen, &[USER_PASSWORD]);
            assert!(!seen.contains("PRIVATE KEY"), "key material shown:\n{seen}");
        }
    })
    .await;
}

#[tokio::test]
async fn redis_cluster_over_tls_with_an_acl_user() {
    let _serial = SERIAL.lock().await;
    within(180, async {
        let pki = Pki::generate();
        let nodes: Vec<TlsRedis> = (0..3)
            .map(|_| {
                TlsRedis::start_with(
                    &pki,
                    "no",
                    &["--cluster-enabled", "yes", "--tls-cluster", "yes"],
                )
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        // `timeout` bounds redis-cli, which waits for the cluster to join without a limit.
        let out = Command::new("timeout")
            .args(["60", "redis-cli", "--tls", "--cacert"])
            .arg(pki.path("ca.crt"))
            .arg("--cert")
            .arg(pki.path("client.crt"))
            .arg("--key")
            .arg(pki.path("client.key"))
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .env("REDISCLI_AUTH", DEFAULT_PASSWORD)
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while !nodes.iter().all(|n| {
            n.cli(&pki, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
        }) {
            assert!(Instant::now() < deadline, "cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }

        let up = Upstream::start().await;
        let secrets = tempfile::tempdir().unwrap();
        let password_file = file_with(secrets.path(), "password", USER_PASSWORD);
        let seeds: Vec<String> = addrs.iter().map(|a| format!("rediss://{a}")).collect();
        let s = Proc::start(
            &up.url(),
            &failure_mode_policy(),
            &[
                format!("--redis={}", seeds.join(",")),
                "--redis-cluster".into(),
                "--redis-username=tollgate".into(),
                arg("--redis-password-file", &password_file),
                arg("--redis-ca-file", &pki.path("ca.crt")),
            ],
            &[],
        );
        s.wait_connected().await;
        let c = client();
        let mut admitted = 0;
        for i in 0..4 {
            let got = statuses(&c, &s.url("/closed"), &[("x-client", &format!("k{i}"))], 7).await;
            assert!(got.iter().all(|s| *s == 200 || *s == 429), "{got:?}");
            assert!(got.contains(&429), "limit 5 holds for k{i}: {got:?}");
            admitted += got.iter().filter(|s| **s == 200).count();
        }
        eprintln!("TLS cluster: {admitted} admitted for 4 keys with a limit of 5 each");
        let keys: usize = nodes
            .iter()
            .map(|n| {
                n.cli(&pki, &["DBSIZE"])
                    .trim()
                    .parse::<usize>()
                    .unwrap_or(0)
            })
            .sum();
        assert!(keys >= 1, "no buckets on the cluster");
        let seen = s.everything_visible().await;
        assert_secret_free("cluster sidecar", &seen, &[USER_PASSWORD, DEFAULT_PASSWORD]);

        // A wrong password on the cluster: the rule's failure mode.
        let wrong_file = file_with(secrets.path(), "wrong", WRONG_PASSWORD);
        let w = Proc::start(
            &up.url(),
            &failure_mode_policy(),
            &[
                format!("--redis={}", seeds.join(",")),
                "--redis-cluster".into(),
                "--redis-username=tollgate".into(),
                arg("--redis-password-file", &wrong_file),
                arg("--redis-ca-file", &pki.path("ca.crt")),
            ],
            &[],
        );
        let line = w.wait_log(&["cannot connect to redis"]).await;
        eprintln!("TLS cluster, wrong password: {line}");
        assert!(line.contains("\"kind\":\"auth\""), "{line}");
        assert_failure_modes(&w, "w").await;
        let seen = w.everything_visible().await;
        assert_secret_free(
            "cluster sidecar",
            &seen,
            &[WRONG_PASSWORD, DEFAULT_PASSWORD],
        );
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Keys and tokens in logs

const API_KEY: &str = "sk_live_9fQ2mZt7LwXa";
const JWT_SUB: &str = "user-7731-secret-subject";

fn b64url(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// A bearer JWT (unsigned is fine: the sidecar decodes claims, the app verifies).
fn jwt() -> String {
    let header = b64url(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = b64url(format!(r#"{{"sub":"{JWT_SUB}","scope":"read"}}"#).as_bytes());
    format!("{header}.{payload}.c2lnbmF0dXJlLW5vdC1jaGVja2Vk")
}

fn keyed_policy() -> String {
    policy(
        "keyed",
        r#"
        rules:
        - name: per-api-key
          match: {path: {prefix: /key}}
          key: [{header: x-api-key}]
          limit: {requests: 3, period: 1m}
          scope: Local
        - name: per-user
          match: {path: {prefix: /user}}
          key: [{jwtClaim: {claim: sub, header: authorization}}]
          limit: {requests: 3, period: 1m}
          scope: Local
        "#,
    )
}

/// Sends keyed traffic until both rules reject (so audit lines are written).
async fn keyed_traffic(p: &Proc) {
    let c = client();
    let token = format!("Bearer {}", jwt());
    let keyed = statuses(&c, &p.url("/key"), &[("x-api-key", API_KEY)], 6).await;
    let user = statuses(&c, &p.url("/user"), &[("authorization", token.as_str())], 6).await;
    assert_eq!(keyed, [200, 200, 200, 429, 429, 429]);
    assert_eq!(user, [200, 200, 200, 429, 429, 429]);
    // The audit lines are written as the rejections happen.
    p.wait_log(&["request rejected", "per-user"]).await;
}

#[tokio::test]
async fn keys_and_tokens_stay_out_of_logs_by_default() {
    let _serial = SERIAL.lock().await;
    within(120, async {
        let up = Upstream::start().await;
        let yaml = keyed_policy();
        let token = jwt();
        let payload = token.split('.').nth(1).unwrap_or_default().to_string();
        let raw = [API_KEY, JWT_SUB, token.as_str(), payload.as_str()];

        // Default settings (log level info), and debug for good measure.
        for extra in [vec![], vec!["--log=debug".to_string()]] {
            let p = Proc::start(&up.url(), &yaml, &extra, &[]);
            keyed_traffic(&p).await;
            let line = p.wait_log(&["request rejected", "per-api-key"]).await;
            assert!(
                line.contains("\"key_hash\""),
                "hashed key in the audit line: {line}"
            );
            let seen = p.everything_visible().await;
            assert_secret_free(&format!("sidecar {extra:?}"), &seen, &raw);
            let top = p.admin_get("/debug/top-keys").await;
            assert!(top.contains("keyHash"), "{top}");
        }

        // The opt-in is what writes raw keys: the check above would have caught them.
        let p = Proc::start(&up.url(), &yaml, &["--audit-raw-keys".to_string()], &[]);
        keyed_traffic(&p).await;
        let line = p.wait_log(&["request rejected", "per-api-key"]).await;
        assert!(
            line.contains(API_KEY),
            "--audit-raw-keys logs the key: {line}"
        );
        // Still never the bearer token itself, only the claim used as the key.
        assert!(!p.lines().join("\n").contains(token.as_str()));
    })
    .await;
}
