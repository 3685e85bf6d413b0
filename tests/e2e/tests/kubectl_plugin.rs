//! `kubectl tollgate` against a real kube-apiserver + etcd, a real controller and two real
//! sidecars, run the way kubectl runs a plugin (`kubectl tollgate ...`, the binary on PATH):
//! `status` (table, wide, json, yaml, `-A`, one policy, an unknown one), `top` (the keys the
//! sidecars rejected, under the identity their `/debug/top-keys` shows), and `check` on a good
//! and a bad file. `why` needs a kubelet's port-forward: tests/node runs it on real pods.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use tollgate_e2e::{
    ControlPlane, Sidecar, app, free_port, install_crd_and_shop, pod_with_token, serial,
    shop_policy, start_controller, wait, workspace_bin,
};

/// `kubectl tollgate <args>`, with the plugin found on PATH as kubectl looks for it.
fn plugin(cp: &ControlPlane, args: &[&str]) -> Output {
    let bin = workspace_bin("kubectl-tollgate");
    let dir = bin.parent().unwrap_or(Path::new("."));
    let path = std::env::join_paths(std::iter::once(dir.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .unwrap();
    Command::new("kubectl")
        .arg("tollgate")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", cp.kubeconfig())
        .output()
        .expect("run kubectl")
}

fn ok(cp: &ControlPlane, args: &[&str]) -> String {
    let out = plugin(cp, args);
    assert!(
        out.status.success(),
        "kubectl tollgate {args:?} failed ({:?}):\n{}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn failed(cp: &ControlPlane, args: &[&str], code: i32) -> String {
    let out = plugin(cp, args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "kubectl tollgate {args:?}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const INVALID: &str = r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: broken, namespace: shop}
spec:
  targetRef:
    selector: {matchLabels: {app: shop-api}}
  rules:
  - name: per-api-key
    key: [{header: x-api-key}]
    limit: {requests: 10, period: 1m, burts: 5}
"#;

#[test]
fn kubectl_tollgate_status_top_and_check_against_a_real_api_server() {
    let _serial = serial();
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);
    cp.ok(&[
        "create",
        "secret",
        "generic",
        "tollgate-key-hash",
        "-n",
        "default",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<_> = (0..2)
        .map(|i| pod_with_token(&cp, &format!("p{i}"), dir.path()))
        .collect();
    let port = free_port();
    let mut controller = start_controller(
        &cp,
        "tollgate-controller",
        port,
        &["--heartbeat-interval", "1s", "--top-keys-interval", "1s"],
    );
    cp.apply(&shop_policy(2).replace("limit: {", "scope: Local\n    limit: {"))
        .expect("apply policy");
    // No admission webhook in this harness: the misspelled policy is stored and reaches the
    // controller, whose status says why it is refused.
    let stored = cp.kubectl_stdin(&["create", "--validate=false", "-f", "-"], Some(INVALID));
    assert!(stored.status.success(), "{stored:?}");
    let app_port = app();
    let mut sidecars: Vec<Sidecar> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| {
            let s = Sidecar::for_pod(
                &format!("p{i}"),
                app_port,
                port,
                token,
                &["--top-keys-report-interval", "1s", "--audit-raw-keys"],
            );
            s.wait_ready("a sidecar with rules", Duration::from_secs(20));
            s
        })
        .collect();

    // status: the table once both sidecars run the policy.
    let mut table = String::new();
    wait(
        "kubectl tollgate status to show the policy programmed on 2 sidecars",
        Duration::from_secs(30),
        || {
            table = ok(&cp, &["status", "-n", "shop"]);
            table.lines().any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.first() == Some(&"shop-api-keys") && cols[1..4] == ["True", "True", "2/2"]
            })
        },
    );
    eprintln!("$ kubectl tollgate status -n shop\n{table}");
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "ACCEPTED",
            "PROGRAMMED",
            "SIDECARS",
            "NO-SIDECAR",
            "RULES-VERSION",
            "GENERATION",
            "PROPAGATION",
            "PROGRAMMED-SINCE",
            "AGE"
        ]
    );
    let row = |name: &str| -> Vec<String> {
        table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{table}"))
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    assert_eq!(row("broken")[1], "False", "{table}");
    assert_eq!(row("shop-api-keys")[6], "1/1", "generation: {table}");
    assert!(
        row("shop-api-keys")[7].ends_with("ms") || row("shop-api-keys")[7].ends_with('s'),
        "the propagation of generation 1 is measured: {table}"
    );
    let wide = ok(&cp, &["status", "-n", "shop", "-o", "wide"]);
    let broken = wide.lines().find(|l| l.starts_with("broken ")).unwrap();
    assert!(
        broken.contains("spec.rules[0].limit.burts"),
        "-o wide names the refused field: {wide}"
    );
    let all = ok(&cp, &["status", "-A"]);
    assert!(all.starts_with("NAMESPACE"), "{all}");
    assert!(all.lines().any(|l| l.starts_with("shop ")), "{all}");
    let json: serde_json::Value = serde_json::from_str(&ok(
        &cp,
        &["status", "-n", "shop", "shop-api-keys", "-o", "json"],
    ))
    .unwrap();
    let item = &json["items"][0];
    assert_eq!(item["name"], "shop-api-keys");
    assert_eq!(item["programmed"]["status"], "True");
    assert_eq!(item["sidecarsInSync"], 2);
    assert_eq!(item["propagation"]["generation"], 1, "{item:#}");
    let yaml: serde_norway::Value =
        serde_norway::from_str(&ok(&cp, &["status", "-A", "-o", "yaml"])).unwrap();
    assert_eq!(
        yaml["items"].as_sequence().map(Vec::len),
        Some(2),
        "{yaml:?}"
    );
    let none = ok(&cp, &["status", "-n", "default"]);
    assert!(none.is_empty(), "no table without policies: {none}");
    let missing = failed(&cp, &["status", "-n", "shop", "nope"], 1);
    assert!(missing.contains("not found"), "{missing}");
    let usage = failed(&cp, &["status", "-o", "xml"], 2);
    assert!(usage.contains("xml"), "{usage}");

    // top: nothing yet, then the keys the sidecars rejected.
    let empty = plugin(&cp, &["top", "-n", "shop", "shop-api-keys"]);
    assert!(empty.status.success());
    assert!(
        String::from_utf8_lossy(&empty.stderr).contains("No limited keys"),
        "{empty:?}"
    );
    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut rejected = 0;
    for (key, per_pod) in [("customer-1", 12), ("customer-2", 5)] {
        for s in &sidecars {
            for _ in 0..per_pod {
                let status = client
                    .get(format!("http://127.0.0.1:{}/", s.listen))
                    .header("x-api-key", key)
                    .send()
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0);
                rejected += u32::from(status == 429);
            }
        }
    }
    assert_eq!(
        rejected,
        2 * (10 + 3),
        "the local limit of 2 rejects the rest"
    );
    let top: serde_json::Value = client
        .get(format!(
            "http://127.0.0.1:{}/debug/top-keys",
            sidecars[0].admin
        ))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let hash_of = |key: &str| -> String {
        top["topKeys"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["key"] == key)
            .and_then(|e| e["keyHash"].as_str())
            .unwrap_or_else(|| panic!("{key} in /debug/top-keys: {top}"))
            .to_string()
    };
    let (first, second) = (hash_of("customer-1"), hash_of("customer-2"));
    let mut table = String::new();
    wait(
        "kubectl tollgate top to list both customers",
        Duration::from_secs(30),
        || {
            table = ok(&cp, &["top", "-n", "shop", "shop-api-keys"]);
            table.contains(&first) && table.contains(&second) && table.contains(" 20 ")
        },
    );
    eprintln!("$ kubectl tollgate top -n shop shop-api-keys\n{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("shop/shop-api-keys: keys rejected most over the last 10m"),
        "{table}"
    );
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["RULE", "KEY-HASH", "REJECTED", "MAX-OVERCOUNT", "PODS"]
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["per-api-key", first.as_str(), "20", "0", "2"],
        "{table}"
    );
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        ["per-api-key", second.as_str(), "6", "0", "2"],
        "{table}"
    );
    let wide = ok(&cp, &["top", "-n", "shop", "shop-api-keys", "-o", "wide"]);
    assert!(wide.contains("p0,p1") || wide.contains("p1,p0"), "{wide}");
    let json: serde_json::Value = serde_json::from_str(&ok(
        &cp,
        &["top", "-n", "shop", "shop-api-keys", "-o", "json"],
    ))
    .unwrap();
    assert_eq!(json["policy"], "shop/shop-api-keys");
    assert_eq!(json["topLimitedKeys"]["keys"][0]["keyHash"], first.as_str());
    let missing = failed(&cp, &["top", "-n", "shop", "nope"], 1);
    assert!(missing.contains("not found"), "{missing}");

    // check: offline, the sidecar's own explanation and exit codes.
    let files = tempfile::tempdir().unwrap();
    let good = files.path().join("good.yaml");
    std::fs::write(&good, shop_policy(5)).unwrap();
    let bad = files.path().join("bad.yaml");
    std::fs::write(&bad, INVALID).unwrap();
    let explained = ok(&cp, &["check", good.to_str().unwrap()]);
    assert!(explained.contains("per-api-key"), "{explained}");
    let refused = plugin(&cp, &["check", bad.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(1));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&refused.stdout),
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(said.contains("spec.rules[0].limit.burts"), "{said}");

    // why: the balance to read is local or redis; a pod without a sidecar (the harness's pods
    // have none and no kubelet: tests/node asks real pods) is refused with the reason.
    let refused = failed(
        &cp,
        &["why", "-n", "shop", "--pod", "p0", "--balance", "etcd"],
        2,
    );
    assert!(
        refused.contains("local") && refused.contains("redis"),
        "{refused}"
    );
    let help = ok(&cp, &["why", "--help"]);
    assert!(help.contains("--balance"), "{help}");
    let no_sidecar = failed(
        &cp,
        &["why", "-n", "shop", "--pod", "p0", "--balance", "redis"],
        1,
    );
    assert!(
        no_sidecar.contains("has no tollgate sidecar"),
        "{no_sidecar}"
    );

    for s in &mut sidecars {
        s.proc.stop(Duration::from_secs(10));
    }
    controller.stop(Duration::from_secs(10));
}
