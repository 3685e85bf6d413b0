//! `kubectl tollgate status`: what each policy's status says, one line per policy.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, ListParams};
use serde_json::json;
use tollgate_crd::PolicyStatusView;
use tollgate_crd::policy::conditions::{ACCEPTED, PROGRAMMED, SIDECARS_INJECTED};

use crate::cli::{Output, StatusArgs};
use crate::client::{Kube, describe};
use crate::output::{age_of, or_dash, structured, table};

pub async fn run(kube: &Kube, args: &StatusArgs) -> anyhow::Result<()> {
    let policies = fetch(kube, args).await?;
    let summaries: Vec<serde_json::Value> = policies.iter().map(summary).collect();
    if structured(&json!({ "items": summaries }), args.output)? {
        return Ok(());
    }
    if policies.is_empty() {
        if args.all_namespaces {
            eprintln!("No RateLimitPolicies found.");
        } else {
            eprintln!(
                "No RateLimitPolicies found in {} namespace.",
                kube.namespace
            );
        }
        return Ok(());
    }
    let wide = args.output == Some(Output::Wide);
    let mut headers = vec![];
    if args.all_namespaces {
        headers.push("NAMESPACE");
    }
    headers.extend([
        "NAME",
        "ACCEPTED",
        "PROGRAMMED",
        "SIDECARS",
        "NO-SIDECAR",
        "RULES-VERSION",
        "GENERATION",
        "PROPAGATION",
        "PROGRAMMED-SINCE",
        "AGE",
    ]);
    if wide {
        headers.extend(["RULES", "GLOBAL-RULES", "MESSAGE"]);
    }
    let rows: Vec<Vec<String>> = policies
        .iter()
        .map(|p| row(p, args.all_namespaces, wide))
        .collect();
    print!("{}", table(&headers, &rows, args.no_headers));
    Ok(())
}

async fn fetch(kube: &Kube, args: &StatusArgs) -> anyhow::Result<Vec<PolicyStatusView>> {
    let api: Api<PolicyStatusView> = if args.all_namespaces {
        Api::all(kube.client.clone())
    } else {
        Api::namespaced(kube.client.clone(), &kube.namespace)
    };
    if let Some(name) = &args.name {
        let p = api.get(name).await.map_err(|e| {
            describe(
                e,
                &format!("ratelimitpolicy {name:?} in namespace {:?}", kube.namespace),
            )
        })?;
        return Ok(vec![p]);
    }
    let mut list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| match &e {
            kube::Error::Api(s) if s.code == 404 => anyhow::anyhow!(
                "the server has no RateLimitPolicy resource (ratelimitpolicies.tollgate.dev): \
                 is tollgate installed?"
            ),
            _ => describe(e, "ratelimitpolicies"),
        })?
        .items;
    list.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    Ok(list)
}

fn condition<'a>(p: &'a PolicyStatusView, ty: &str) -> Option<&'a Condition> {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == ty))
}

fn condition_json(c: Option<&Condition>) -> serde_json::Value {
    match c {
        Some(c) => json!({
            "status": c.status,
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": c.last_transition_time.0.to_string(),
            "observedGeneration": c.observed_generation,
        }),
        None => serde_json::Value::Null,
    }
}

/// Everything the table shows, for `-o json|yaml`.
fn summary(p: &PolicyStatusView) -> serde_json::Value {
    let s = p.status.clone().unwrap_or_default();
    json!({
        "namespace": p.metadata.namespace,
        "name": p.metadata.name,
        "generation": p.metadata.generation,
        "observedGeneration": s.observed_generation,
        "accepted": condition_json(condition(p, ACCEPTED)),
        "programmed": condition_json(condition(p, PROGRAMMED)),
        "sidecarsInjected": condition_json(condition(p, SIDECARS_INJECTED)),
        "sidecarsInSync": s.sidecars_in_sync,
        "sidecarsTotal": s.sidecars_total,
        "podsWithoutSidecar": s.pods_without_sidecar,
        "rulesVersion": s.rules_version,
        "ruleCount": s.rule_count,
        "globalRules": s.global_rules,
        "propagation": s.propagation,
        "creationTimestamp": p.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()),
    })
}

/// The last measured generation's propagation, e.g. `420ms (gen 3)`.
fn propagation(s: &tollgate_crd::RateLimitPolicyStatus) -> String {
    match &s.propagation {
        Some(p) if p.duration_millis < 10_000 => {
            format!("{}ms (gen {})", p.duration_millis, p.generation)
        }
        Some(p) => format!("{}s (gen {})", p.duration_millis / 1000, p.generation),
        None => "-".into(),
    }
}

fn row(p: &PolicyStatusView, all_namespaces: bool, wide: bool) -> Vec<String> {
    let s = p.status.clone().unwrap_or_default();
    let accepted = condition(p, ACCEPTED);
    let programmed = condition(p, PROGRAMMED);
    let injected = condition(p, SIDECARS_INJECTED);
    let status_of = |c: Option<&Condition>| or_dash(c.map(|c| c.status.clone()));
    let sidecars = match (s.sidecars_in_sync, s.sidecars_total) {
        (None, None) => "-".to_string(),
        (a, b) => format!("{}/{}", a.unwrap_or(0), b.unwrap_or(0)),
    };
    let generation = format!(
        "{}/{}",
        or_dash(s.observed_generation),
        or_dash(p.metadata.generation)
    );
    let mut row = vec![];
    if all_namespaces {
        row.push(p.metadata.namespace.clone().unwrap_or_default());
    }
    row.extend([
        p.metadata.name.clone().unwrap_or_default(),
        status_of(accepted),
        status_of(programmed),
        sidecars,
        or_dash(s.pods_without_sidecar),
        or_dash(s.rules_version),
        generation,
        propagation(&s),
        programmed
            .map(|c| age_of(Some(c.last_transition_time.0)))
            .unwrap_or_else(|| "-".into()),
        age_of(p.metadata.creation_timestamp.as_ref().map(|t| t.0)),
    ]);
    if wide {
        let global = if s.global_rules.is_empty() {
            "-".to_string()
        } else {
            s.global_rules
                .iter()
                .map(|g| format!("{}={}", g.name, g.mode))
                .collect::<Vec<_>>()
                .join(",")
        };
        // The first condition that is not True says why (pods without the sidecar included:
        // Programmed counts connected sidecars only); else Programmed's message.
        let message = [accepted, programmed, injected]
            .into_iter()
            .flatten()
            .find(|c| c.status != "True")
            .or(programmed)
            .map(|c| format!("{}: {}", c.reason, c.message))
            .unwrap_or_else(|| "-".into());
        row.extend([or_dash(s.rule_count), global, message]);
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: Some(1),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        }
    }

    /// Programmed counts connected sidecars only: a pod without the sidecar must show in the
    /// table, or "1/1 Programmed" hides replicas nobody limits.
    #[test]
    fn pods_without_the_sidecar_show_beside_a_programmed_policy() {
        let policy: PolicyStatusView = serde_json::from_value(json!({
            "metadata": {"name": "api", "namespace": "shop", "generation": 1},
        }))
        .unwrap();
        let policy = PolicyStatusView {
            status: Some(tollgate_crd::RateLimitPolicyStatus {
                observed_generation: Some(1),
                sidecars_in_sync: Some(1),
                sidecars_total: Some(1),
                pods_without_sidecar: Some(2),
                conditions: vec![
                    condition(ACCEPTED, "True", "Accepted", "compiled"),
                    condition(PROGRAMMED, "True", "Programmed", "1 of 1"),
                    condition(
                        SIDECARS_INJECTED,
                        "False",
                        "PodsWithoutSidecar",
                        "2 selected pods run without the sidecar: api-2, api-3",
                    ),
                ],
                ..Default::default()
            }),
            ..policy
        };
        let row = row(&policy, false, true);
        assert_eq!(row[..5], ["api", "True", "True", "1/1", "2"]);
        assert_eq!(
            row.last().map(String::as_str),
            Some("PodsWithoutSidecar: 2 selected pods run without the sidecar: api-2, api-3")
        );
        let json = summary(&policy);
        assert_eq!(json["podsWithoutSidecar"], 2);
        assert_eq!(json["sidecarsInjected"]["status"], "False");
    }
}
