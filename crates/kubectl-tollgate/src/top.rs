//! `kubectl tollgate top POLICY`: the fleet-wide most-rejected keys of a policy.

use kube::api::Api;
use serde_json::json;
use tollgate_crd::PolicyStatusView;

use crate::cli::{Output, TopArgs};
use crate::client::{Kube, describe};
use crate::output::{age_of_text, structured, table};

pub async fn run(kube: &Kube, args: &TopArgs) -> anyhow::Result<()> {
    let api: Api<PolicyStatusView> = Api::namespaced(kube.client.clone(), &kube.namespace);
    let policy = api.get(&args.policy).await.map_err(|e| {
        describe(
            e,
            &format!(
                "ratelimitpolicy {:?} in namespace {:?}",
                args.policy, kube.namespace
            ),
        )
    })?;
    let top = policy
        .status
        .as_ref()
        .and_then(|s| s.top_limited_keys.as_ref());
    let id = format!("{}/{}", kube.namespace, args.policy);
    if structured(&json!({ "policy": id, "topLimitedKeys": top }), args.output)? {
        return Ok(());
    }
    let Some(top) = top.filter(|t| !t.keys.is_empty()) else {
        eprintln!(
            "No limited keys reported for {id} (status.topLimitedKeys is empty: nothing was \
             rejected recently, or the controller has not merged the sidecars' reports yet)."
        );
        return Ok(());
    };
    let wide = args.output == Some(Output::Wide);
    let mut headers = vec!["RULE", "KEY-HASH", "REJECTED", "MAX-OVERCOUNT", "PODS"];
    if wide {
        headers.push("POD-NAMES");
    }
    let rows: Vec<Vec<String>> = top
        .keys
        .iter()
        .map(|k| {
            let mut row = vec![
                k.rule.clone(),
                k.key_hash.clone(),
                k.rejected.to_string(),
                k.max_overcount.to_string(),
                k.pod_count.to_string(),
            ];
            if wide {
                let mut names = k.pods.join(",");
                let more = (k.pod_count as usize).saturating_sub(k.pods.len());
                if more > 0 {
                    names.push_str(&format!(" (+{more} more)"));
                }
                row.push(if names.is_empty() { "-".into() } else { names });
            }
            row
        })
        .collect();
    if !args.no_headers {
        println!(
            "{id}: keys rejected most over the last {} (merged {} ago, at {})",
            top.window,
            age_of_text(&top.updated),
            top.updated
        );
    }
    print!("{}", table(&headers, &rows, args.no_headers));
    Ok(())
}
