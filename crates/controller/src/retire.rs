//! Removing tollgate from running pods (`helm uninstall`).
//!
//! Injected sidecars outlive the controller: without a word from it they keep enforcing their
//! last rules for the life of their pod, including fail-closed rules whose Redis the uninstall
//! removes too. So before Helm deletes anything, its `pre-delete` hook runs
//! `tollgate-controller --retire` ([`announce`]), which creates the Lease
//! `<lease-name>-retire`. Every replica watches for it ([`follow`]); one that sees it empties its
//! index and ignores policies from then on, so every connected sidecar, and every sidecar that
//! connects later, gets a snapshot with no policy: it enforces nothing and its rules cache holds
//! nothing (a restarted container starts from that). This is an ordinary snapshot, so sidecars
//! of every version understand it. The hook waits `--retire-wait` and deletes the Lease; a
//! replica never leaves the retired state. A Lease older than [`MAX_MARKER_AGE`] is ignored, so
//! one left by a failed hook cannot empty a later installation.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use crate::index::SharedIndex;

/// A marker older than this is left over from an earlier uninstall: ignored.
pub const MAX_MARKER_AGE: Duration = Duration::from_secs(600);

/// Name of the marker Lease for the controllers' `--lease-name`.
pub fn marker_name(lease_name: &str) -> String {
    format!("{lease_name}-retire")
}

/// `--retire`: creates the marker, gives the replicas `wait` to stream empty rule sets, and
/// deletes it again.
pub async fn announce(
    client: kube::Client,
    namespace: &str,
    lease_name: &str,
    wait: Duration,
) -> anyhow::Result<()> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let name = marker_name(lease_name);
    delete(&api, &name).await?;
    let marker = Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([("tollgate.dev/retire-of".to_string(), lease_name.to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("tollgate-retire".to_string()),
            ..LeaseSpec::default()
        }),
    };
    api.create(&PostParams::default(), &marker)
        .await
        .with_context(|| format!("cannot create the Lease {namespace}/{name}"))?;
    tracing::info!(%namespace, lease = %name, ?wait, "told the controllers that tollgate is being removed; waiting for them to empty every sidecar's rules");
    tokio::time::sleep(wait).await;
    delete(&api, &name).await?;
    tracing::info!("done: sidecars enforce nothing from now on");
    Ok(())
}

async fn delete(api: &Api<Lease>, name: &str) -> anyhow::Result<()> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot delete the Lease {name}")),
    }
}

/// Watches for the marker; at the first fresh one, sets `retired` and empties the index of every
/// policy in `scopes` (under the index lock the policy watches check `retired` with).
pub async fn follow(
    client: kube::Client,
    namespace: String,
    lease_name: String,
    index: SharedIndex,
    scopes: Vec<Option<String>>,
    retired: Arc<AtomicBool>,
) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let name = marker_name(&lease_name);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = pin!(watcher::watcher(api, config).default_backoff());
    while let Some(event) = stream.next().await {
        let lease = match event {
            Ok(Event::Apply(l) | Event::InitApply(l)) => l,
            Ok(_) => continue,
            Err(error) => {
                tracing::debug!(%error, "retire marker watch failed; retrying");
                continue;
            }
        };
        if !fresh(&lease) {
            tracing::info!(lease = %name, "ignoring a retire marker left from an earlier uninstall");
            continue;
        }
        let mut index = index.write();
        if retired.swap(true, Ordering::AcqRel) {
            continue;
        }
        for scope in &scopes {
            index.reset_policies(scope.as_deref(), Vec::new());
        }
        drop(index);
        tracing::warn!(
            "tollgate is being removed: every sidecar gets an empty rule set and enforces nothing from now on"
        );
    }
}

/// Whether the marker was created less than [`MAX_MARKER_AGE`] ago (by the API server's clock).
fn fresh(lease: &Lease) -> bool {
    let Some(created) = &lease.metadata.creation_timestamp else {
        return true;
    };
    let age = k8s_openapi::jiff::Timestamp::now().as_second() - created.0.as_second();
    age < i64::try_from(MAX_MARKER_AGE.as_secs()).unwrap_or(i64::MAX)
}
