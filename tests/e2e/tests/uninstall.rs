//! Removing tollgate from running pods: `tollgate-controller --retire` (the chart's `pre-delete`
//! hook) makes every controller replica stream an empty rule set, so sidecars that outlive the
//! controller enforce nothing and keep nothing in their rules cache. Real kube-apiserver, real
//! controller and sidecar processes.

use std::process::Command;
use std::time::Duration;

use tollgate_e2e::{
    ControlPlane, Sidecar, app, free_port, install_crd_and_shop, pod_with_token, serial,
    shop_policy, start_controller, text, wait, workspace_bin,
};

fn get(client: &reqwest::blocking::Client, url: &str, key: &str) -> u16 {
    client
        .get(url)
        .header("x-api-key", key)
        .send()
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[test]
fn retiring_the_controllers_leaves_running_sidecars_enforcing_nothing() {
    let _serial = serial();
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);
    cp.apply(&shop_policy(2)).expect("apply policy");
    let port = free_port();
    let mut controller = start_controller(&cp, "controller", port, &["--heartbeat-interval", "1s"]);
    let dir = tempfile::tempdir().unwrap();
    let token = pod_with_token(&cp, "p0", dir.path());
    let cache = dir.path().join("rules.json");
    let app_port = app();
    let sidecar = Sidecar::for_pod(
        "p0",
        app_port,
        port,
        &token,
        &["--rules-cache", cache.to_str().unwrap()],
    );
    sidecar.wait_ready("the sidecar's first rules", Duration::from_secs(30));
    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{}/", sidecar.listen);
    let codes: Vec<u16> = (0..3).map(|_| get(&client, &url, "k")).collect();
    assert_eq!(codes, [200, 200, 429], "the policy is enforced");
    assert!(
        std::fs::read_to_string(&cache)
            .unwrap()
            .contains("shop-api-keys")
    );

    // The pre-delete hook's command.
    let out = Command::new(workspace_bin("tollgate-controller"))
        .args([
            "--retire",
            "--retire-wait",
            "3s",
            "--lease-namespace",
            "default",
        ])
        .env("KUBECONFIG", cp.kubeconfig())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "--retire: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    controller.wait_for_log("tollgate is being removed", Duration::from_secs(5));
    // The marker is gone again (a later install must not retire at once).
    let marker = cp.kubectl(&[
        "-n",
        "default",
        "get",
        "lease",
        "tollgate-controller-retire",
    ]);
    assert!(!marker.status.success(), "the retire Lease is left behind");

    // The exhausted key passes, and keeps passing once the controller is gone for good.
    wait(
        "the sidecar to drop its rules",
        Duration::from_secs(10),
        || get(&client, &url, "k") == 200,
    );
    let cached = std::fs::read_to_string(&cache).unwrap();
    assert!(
        !cached.contains("shop-api-keys"),
        "the rules cache still holds the policy: {cached}"
    );
    controller.stop(Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));
    let codes: Vec<u16> = (0..10).map(|_| get(&client, &url, "k")).collect();
    assert!(codes.iter().all(|c| *c == 200), "{codes:?}");
    // Policies edited meanwhile change nothing: the sidecar has no controller to hear from, and
    // a retired controller ignores them.
    assert_eq!(sidecar.readyz(), 200, "the sidecar stays ready");

    // A controller started afterwards (a reinstall) enforces the policies again.
    let _again = start_controller(
        &cp,
        "controller-again",
        port,
        &["--heartbeat-interval", "1s"],
    );
    wait(
        "the policy to be enforced again",
        Duration::from_secs(30),
        || get(&client, &url, "k2") == 429,
    );
}
