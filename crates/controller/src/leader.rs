//! Leader election with a `coordination.k8s.io/v1` Lease (kube-lease-manager).
//!
//! Only the leader writes status and events; every replica serves rule streams. The outcome is
//! published on a `watch::Receiver<bool>`. Failures to build the manager (missing RBAC, API
//! server down) are retried with backoff while this replica stays a follower.

use std::time::Duration;

use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Lease settings.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub name: String,
    pub namespace: String,
    /// Unique per replica (pod name plus a random suffix).
    pub identity: String,
    /// How long a lease stays valid without renewal.
    pub duration: Duration,
    /// How long before expiry the holder renews.
    pub grace: Duration,
}

/// A leadership channel that is always `true` (leader election disabled).
pub fn always_leader() -> (watch::Sender<bool>, watch::Receiver<bool>) {
    watch::channel(true)
}

/// Runs leader election until `shutdown` turns true, then releases the lease.
pub async fn run(
    client: kube::Client,
    config: LeaseConfig,
    tx: watch::Sender<bool>,
    metrics: Metrics,
    mut shutdown: watch::Receiver<bool>,
) {
    let duration = config.duration.as_secs().max(2);
    let grace = config.grace.as_secs().clamp(1, duration - 1);
    let mut backoff = Duration::from_secs(1);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let built = LeaseManagerBuilder::new(client.clone(), &config.name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_field_manager(format!("tollgate-controller-{}", config.identity))
            .with_duration(duration)
            .with_grace(grace)
            .build()
            .await;
        let manager = match built {
            Ok(m) => m,
            Err(error) => {
                tracing::warn!(%error, lease = %config.name, namespace = %config.namespace, "cannot set up leader election; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        backoff = Duration::from_secs(1);
        let (mut rx, task) = manager.watch().await;
        let ended = loop {
            let leader = *rx.borrow_and_update();
            if tx.send_replace(leader) != leader {
                metrics.set_leader(leader);
                if leader {
                    tracing::info!(identity = %config.identity, lease = %config.name, "became the leader: writing status");
                } else {
                    tracing::info!(identity = %config.identity, lease = %config.name, "lost leadership: status writes stop");
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { break false },
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { break true },
            }
        };
        // Dropping the receiver makes the manager release the lease and finish.
        drop(rx);
        tx.send_replace(false);
        metrics.set_leader(false);
        match tokio::time::timeout(Duration::from_secs(5), task).await {
            Ok(Ok(Ok(_))) => tracing::debug!("lease manager stopped"),
            Ok(Ok(Err(error))) => tracing::warn!(%error, "lease manager failed"),
            Ok(Err(error)) => tracing::warn!(%error, "lease manager task failed"),
            Err(_) => tracing::warn!("lease manager did not stop in time"),
        }
        if ended {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = shutdown.changed() => return,
        }
    }
}
