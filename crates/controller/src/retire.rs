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

/// How long a retired replica keeps running after the marker is gone before it concludes that
/// the uninstall did not happen (it failed or was aborted after the hook) and restarts.
pub const RETIRED_WITHOUT_MARKER: Duration = Duration::from_secs(120);

/// Watches for the marker; at the first fresh one, sets `retired` and empties the index of every
/// policy in `scopes` (under the index lock the policy watches check `retired` with).
///
/// Retiring is meant to end with the controller deleted. A replica that is still running
/// [`RETIRED_WITHOUT_MARKER`] after the marker went away, or [`MAX_MARKER_AGE`] after it
/// retired, was not uninstalled: it exits, and the restarted process (which ignores a marker
/// that old) enforces every policy again. So a failed `helm uninstall` cannot leave the
/// installation silently enforcing nothing.
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
    let mut restart = Restart::default();
    loop {
        let event = tokio::select! {
            event = stream.next() => event,
            () = restart.due() => {
                tracing::error!(lease = %name, "this replica retired for an uninstall that did not happen (the controller is still running); restarting to enforce every policy again");
                std::process::exit(1);
            }
        };
        let Some(event) = event else { return };
        let lease = match event {
            Ok(Event::Apply(l) | Event::InitApply(l)) => l,
            Ok(Event::Init) => {
                restart.relisting();
                continue;
            }
            Ok(Event::InitDone) => {
                restart.relisted(tokio::time::Instant::now());
                continue;
            }
            Ok(Event::Delete(_)) => {
                restart.marker_gone(tokio::time::Instant::now());
                continue;
            }
            Err(error) => {
                tracing::debug!(%error, "retire marker watch failed; retrying");
                continue;
            }
        };
        restart.marker_seen();
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
        restart.retired(tokio::time::Instant::now());
        tracing::warn!(
            "tollgate is being removed: every sidecar gets an empty rule set and enforces nothing from now on"
        );
    }
}

/// When a retired replica gives up waiting to be deleted.
#[derive(Default)]
struct Restart {
    /// Set once this replica retired.
    at: Option<tokio::time::Instant>,
    /// During a relist: whether the marker was listed.
    listed: Option<bool>,
}

impl Restart {
    fn retired(&mut self, now: tokio::time::Instant) {
        self.at = Some(now + MAX_MARKER_AGE);
    }

    fn marker_seen(&mut self) {
        if let Some(listed) = &mut self.listed {
            *listed = true;
        }
    }

    /// The marker was deleted: the hook is done, and the controller should be deleted soon.
    fn marker_gone(&mut self, now: tokio::time::Instant) {
        if let Some(at) = &mut self.at {
            *at = (*at).min(now + RETIRED_WITHOUT_MARKER);
        }
    }

    fn relisting(&mut self) {
        self.listed = Some(false);
    }

    /// A relist that did not list the marker: it was deleted while the watch was down.
    fn relisted(&mut self, now: tokio::time::Instant) {
        if self.listed.take() == Some(false) {
            self.marker_gone(now);
        }
    }

    /// Completes when the replica should restart; never before it retired.
    async fn due(&self) {
        match self.at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica that retired but is never deleted must not stay silently retired.
    #[test]
    fn a_retired_replica_that_outlives_its_uninstall_restarts() {
        let t0 = tokio::time::Instant::now();
        let mut r = Restart::default();
        r.marker_gone(t0);
        assert_eq!(
            r.at, None,
            "a marker deleted before retiring (the hook's clean-up) is no news"
        );
        r.retired(t0);
        assert_eq!(
            r.at,
            Some(t0 + MAX_MARKER_AGE),
            "retired for too long, marker or not"
        );
        let gone = t0 + Duration::from_secs(15);
        r.marker_gone(gone);
        assert_eq!(
            r.at,
            Some(gone + RETIRED_WITHOUT_MARKER),
            "the hook ended and we still run"
        );
        r.marker_gone(gone + Duration::from_secs(60));
        assert_eq!(
            r.at,
            Some(gone + RETIRED_WITHOUT_MARKER),
            "the first deletion counts"
        );

        // A relist that still lists the marker changes nothing; one that does not, ends it.
        let mut r = Restart::default();
        r.retired(t0);
        r.relisting();
        r.marker_seen();
        r.relisted(gone);
        assert_eq!(r.at, Some(t0 + MAX_MARKER_AGE));
        r.relisting();
        r.relisted(gone);
        assert_eq!(r.at, Some(gone + RETIRED_WITHOUT_MARKER));
    }
}
