//! `kubectl tollgate why`: asks one pod's sidecar (`GET /debug/why` on its admin port)
//! through the API server's port-forward, which connects on the pod's loopback, where the
//! sidecar answers `/debug/*`.

use anyhow::Context as _;
use http_body_util::BodyExt as _;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::Api;
use serde_json::Value;
use tollgate_crd::why::{Decision, ExplainedRule, KeyState, Outcome, WhyAnswer, Would};

use crate::cli::{Balance, Output, WhyArgs};
use crate::client::{Kube, describe};
use crate::output::{structured, table};

/// The injected sidecar's container name and admin port name (the controller's webhook
/// sets both; see crates/controller/src/webhook/inject.rs).
const SIDECAR_CONTAINER: &str = "tollgate-sidecar";
const ADMIN_PORT_NAMES: [&str; 2] = ["tollgate-admin", "admin"];

pub async fn run(kube: &Kube, args: &WhyArgs) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(kube.client.clone(), &kube.namespace);
    let pod = pods.get(&args.pod).await.map_err(|e| {
        describe(
            e,
            &format!("pod {:?} in namespace {:?}", args.pod, kube.namespace),
        )
    })?;
    let id = format!("{}/{}", kube.namespace, args.pod);
    let (container, port) =
        admin_port(&pod, args.container.as_deref()).with_context(|| format!("pod {id}"))?;
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    if phase != "Running" {
        anyhow::bail!("pod {id} is {phase:?}, not Running: its sidecar cannot be asked");
    }
    let query = query(args);
    let raw = ask(&pods, &args.pod, port, &format!("/debug/why?{query}"))
        .await
        .with_context(|| {
            format!("asking the sidecar (container {container}, port {port}) of pod {id}")
        })?;
    let answer: WhyAnswer = serde_json::from_value(raw.clone()).with_context(|| {
        format!("the sidecar of pod {id} answered /debug/why in a shape this plugin does not read")
    })?;
    // -o json/yaml print the sidecar's answer whole, fields a newer sidecar adds included.
    if structured(&raw, args.output)? {
        return Ok(());
    }
    print!(
        "{}",
        render(&id, &answer, args.output == Some(Output::Wide))
    );
    Ok(())
}

/// The sidecar container and its admin port number, from the pod spec.
fn admin_port(pod: &Pod, wanted: Option<&str>) -> anyhow::Result<(String, u16)> {
    let spec = pod.spec.as_ref().context("has no spec")?;
    let all: Vec<&Container> = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .collect();
    let has_admin = |c: &&&Container| {
        c.ports.iter().flatten().any(|p| {
            p.name
                .as_deref()
                .is_some_and(|n| ADMIN_PORT_NAMES.contains(&n))
        })
    };
    let container = match wanted {
        Some(name) => all
            .iter()
            .find(|c| c.name == name)
            .with_context(|| format!("has no container {name:?}"))?,
        None => all
            .iter()
            .find(|c| c.name == SIDECAR_CONTAINER)
            .or_else(|| all.iter().find(has_admin))
            .with_context(|| {
                format!(
                    "has no tollgate sidecar (no container named {SIDECAR_CONTAINER}): is its \
                     namespace labelled tollgate.dev/inject=enabled? -c names the container"
                )
            })?,
    };
    let port = container
        .ports
        .iter()
        .flatten()
        .find(|p| {
            p.name
                .as_deref()
                .is_some_and(|n| ADMIN_PORT_NAMES.contains(&n))
        })
        .with_context(|| {
            format!(
                "container {} has no port named {}",
                container.name,
                ADMIN_PORT_NAMES.join(" or ")
            )
        })?;
    let number = u16::try_from(port.container_port)
        .with_context(|| format!("admin port {} is out of range", port.container_port))?;
    Ok((container.name.clone(), number))
}

/// The query of `/debug/why` (see crates/engine/src/explain.rs).
fn query(args: &WhyArgs) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("method", &args.method);
    q.append_pair("path", &args.path);
    for (name, value) in &args.headers {
        q.append_pair("header", &format!("{name}:{value}"));
    }
    if let Some(ip) = args.client_ip {
        q.append_pair("clientIp", &ip.to_string());
    }
    if args.balance == Balance::Redis {
        q.append_pair("balance", "redis");
    }
    q.finish()
}

/// One HTTP/1.1 GET to `port` on the pod's loopback through the API server's port-forward.
async fn ask(pods: &Api<Pod>, pod: &str, port: u16, path: &str) -> anyhow::Result<Value> {
    let mut forwarder = pods
        .portforward(pod, &[port])
        .await
        .context("opening a port-forward through the API server (needs pods/portforward)")?;
    let stream = forwarder
        .take_stream(port)
        .context("the port-forward has no stream")?;
    let result = async {
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .context("HTTP handshake over the port-forward")?;
        let conn = tokio::spawn(conn);
        let request = http::Request::get(path)
            .header(http::header::HOST, "localhost")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .context("building the request")?;
        let response = sender
            .send_request(request)
            .await
            .context("sending the request")?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .context("reading the answer")?
            .to_bytes();
        conn.abort();
        let text = String::from_utf8_lossy(&body);
        match status.as_u16() {
            200 => serde_json::from_slice(&body).context("the answer is not JSON"),
            404 => anyhow::bail!(
                "the sidecar does not serve /debug/why (it predates this plugin: upgrade tollgate)"
            ),
            _ => anyhow::bail!("the sidecar answered {status}: {}", text.trim()),
        }
    }
    .await;
    forwarder.abort();
    result
}

/// The table: one line per rule.
fn render(pod: &str, answer: &WhyAnswer, wide: bool) -> String {
    let req = &answer.request;
    let mut out = format!(
        "pod {pod}: rules version {}; request {} {}{}, client IP {}\n",
        answer.version,
        req.method,
        req.path,
        if req.headers.is_empty() {
            String::new()
        } else {
            format!(" (headers {})", req.headers.join(", "))
        },
        req.client_ip,
    );
    if answer.rules.is_empty() {
        out.push_str("No rules in force in this sidecar: nothing is limited.\n");
        return out;
    }
    out.push_str(&verdict(&answer.decision));
    let mut columns = vec![
        "POLICY", "RULE", "MATCH", "OUTCOME", "WOULD", "MODE", "KEY-HASH", "STATE",
    ];
    if wide {
        columns.extend(["SCOPE", "RULE-DOES", "DETAIL"]);
    }
    let rows: Vec<Vec<String>> = answer.rules.iter().map(|r| row(r, wide)).collect();
    out.push_str(&table(&columns, &rows, false));
    out
}

/// One rule's line of the table.
fn row(r: &ExplainedRule, wide: bool) -> Vec<String> {
    let s = |v: &str| if v.is_empty() { "-" } else { v }.to_string();
    let short = r.outcome.split(':').next().unwrap_or(&r.outcome);
    let mut row = vec![
        s(&r.policy),
        s(&r.rule),
        if r.matches { "yes" } else { "no" }.into(),
        s(short),
        would(r.would.as_ref()),
        s(&r.mode),
        s(r.key_hash.as_deref().unwrap_or_default()),
        state(r.state.as_ref()),
    ];
    if wide {
        row.extend([s(&r.scope), s(&r.describe), s(&r.outcome)]);
    }
    row
}

/// The request's fate over all rules, in one line.
fn verdict(d: &Decision) -> String {
    let rule = d.rule.as_deref().unwrap_or("?");
    match d.outcome {
        Outcome::Admitted => "This request would be admitted now.\n".into(),
        Outcome::Delayed => format!("This request would be delayed (shaped) by rule {rule}.\n"),
        Outcome::Rejected => format!("This request would be rejected (429) by rule {rule}.\n"),
        Outcome::Unavailable => {
            format!(
                "This request would be refused (503) by rule {rule}: its Redis did not answer.\n"
            )
        }
        Outcome::Unknown => format!(
            "Unknown whether this request would be admitted: rule {rule} is decided by Redis \
             (add --balance redis to read it).\n"
        ),
    }
}

/// What one rule would do, in words: `admitted (4 left)`, `rejected (retry in 12s)`.
fn would(w: Option<&Would>) -> String {
    let Some(w) = w else {
        return "-".into();
    };
    let outcome = w.outcome.as_str();
    let secs = |ms: u64| crate::output::age(ms.div_ceil(1000) as i64);
    match (w.outcome, w.remaining, w.retry_after_ms, w.delay_ms) {
        (Outcome::Rejected, _, Some(ms), _) => format!("rejected (retry in {})", secs(ms)),
        (Outcome::Delayed, _, _, Some(ms)) => format!("delayed ({ms}ms)"),
        (_, Some(left), _, _) if w.shadow_rejected => {
            format!("{outcome} (shadow, {left} left)")
        }
        (_, Some(left), _, _) => format!("{outcome} ({left} left)"),
        _ => outcome.to_string(),
    }
}

/// A key's state in words.
fn state(s: Option<&KeyState>) -> String {
    let Some(s) = s else {
        return "-".into();
    };
    if let Some(ms) = s.blocked_for_ms {
        return format!(
            "blocked for {}",
            crate::output::age(ms.div_ceil(1000) as i64)
        );
    }
    if s.store.as_deref() == Some("redis") {
        let mode = s.global_mode.as_deref().unwrap_or("?");
        return match (s.leased_here, s.bucket_remaining) {
            (Some(here), Some(bucket)) => {
                format!("{mode}: {here} leased here, {bucket} left in Redis")
            }
            (Some(here), None) => format!("{mode}: {here} leased here"),
            _ => format!("{mode}: not tracked here (balance in Redis)"),
        };
    }
    match (s.remaining, s.limit) {
        (Some(remaining), Some(limit)) => {
            if let Some(in_flight) = s.in_flight {
                return format!("{in_flight}/{limit} in flight");
            }
            let reset = s.reset_ms.unwrap_or(0);
            if reset == 0 {
                format!("{remaining}/{limit} left")
            } else {
                format!(
                    "{remaining}/{limit} left, full in {}",
                    crate::output::age(reset.div_ceil(1000) as i64)
                )
            }
        }
        _ => "not tracked (full limit)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_in_words() {
        let v = |s: &str| state(Some(&serde_json::from_str::<KeyState>(s).unwrap()));
        assert_eq!(
            v(r#"{"tracked":true,"limit":20,"remaining":19,"resetMs":2500}"#),
            "19/20 left, full in 3s"
        );
        assert_eq!(
            v(r#"{"tracked":false,"note":"x"}"#),
            "not tracked (full limit)"
        );
        assert_eq!(
            v(r#"{"tracked":true,"blockedForMs":61000}"#),
            "blocked for 61s"
        );
        assert_eq!(
            v(r#"{"store":"redis","globalMode":"Leased","leasedHere":4,"bucketRemaining":90}"#),
            "Leased: 4 leased here, 90 left in Redis"
        );
        assert_eq!(
            v(r#"{"store":"redis","globalMode":"Exact","tracked":false}"#),
            "Exact: not tracked here (balance in Redis)"
        );
        assert_eq!(state(None), "-");
    }

    #[test]
    fn outcomes_read_in_words() {
        let v = |s: &str| would(Some(&serde_json::from_str::<Would>(s).unwrap()));
        assert_eq!(
            v(r#"{"outcome":"admitted","remaining":5}"#),
            "admitted (5 left)"
        );
        assert_eq!(
            v(r#"{"outcome":"rejected","remaining":0,"retryAfterMs":11500}"#),
            "rejected (retry in 12s)"
        );
        assert_eq!(v(r#"{"outcome":"unknown"}"#), "unknown");
        assert_eq!(would(None), "-");
        let answer: WhyAnswer = serde_json::from_str(
            r#"{"version":3,"request":{"method":"GET","path":"/x","headers":[],"clientIp":"127.0.0.1"},
            "decision":{"outcome":"rejected","rule":"per-key"},
            "rules":[{"policy":"shop/p","rule":"per-key","matches":true,"outcome":"counted","mode":"Enforce",
              "keyHash":"00ff","would":{"outcome":"rejected","remaining":0,"retryAfterMs":3000},
              "state":{"tracked":true,"limit":5,"remaining":0,"resetMs":3000}}]}"#,
        )
        .unwrap();
        let text = render("shop/pod", &answer, false);
        assert!(
            text.contains("would be rejected (429) by rule per-key"),
            "{text}"
        );
        assert!(text.contains("rejected (retry in 3s)"), "{text}");
        assert!(!text.contains("limited"), "{text}");
        let unknown: Decision =
            serde_json::from_str(r#"{"outcome":"unknown","rule":"g"}"#).unwrap();
        assert!(verdict(&unknown).contains("--balance redis"));
    }

    #[test]
    fn the_admin_port_comes_from_the_pod_spec() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "initContainers": [{"name": "tollgate-sidecar", "ports": [
                    {"name": "tollgate-http", "containerPort": 8081},
                    {"name": "tollgate-admin", "containerPort": 9191}]}],
                "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]
            }
        }))
        .unwrap();
        assert_eq!(
            admin_port(&pod, None).unwrap(),
            ("tollgate-sidecar".into(), 9191)
        );
        assert_eq!(admin_port(&pod, Some("tollgate-sidecar")).unwrap().1, 9191);
        let e = admin_port(&pod, Some("app")).unwrap_err().to_string();
        assert!(e.contains("no port named tollgate-admin"), "{e}");
        let e = admin_port(&pod, Some("nope")).unwrap_err().to_string();
        assert!(e.contains("no container \"nope\""), "{e}");
    }
}
