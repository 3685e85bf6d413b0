//! Membership: which sidecars are connected, and how many enforce each policy.
//!
//! A sidecar is a member of a policy while its pod has at least one open rule stream and the
//! policy (its last good version) selects the pod. Several streams from one pod (a reconnect
//! that overlaps the old stream's teardown) count once. The count per policy is pushed to every
//! selected pod's stream as a `members` message; sidecars divide global limits by it.
//!
//! A [`Connection`] is held by the stream body: when hyper drops the body (the client went away,
//! a write failed, the server drains), the guard unregisters the stream and the counts of the
//! other sidecars drop at once.

use std::time::Duration;

use crate::index::{AckError, SharedIndex, Subscription};

/// An open rule stream of one pod. Dropping it ends the membership.
#[derive(Debug)]
pub struct Connection {
    index: SharedIndex,
    namespace: String,
    pod: String,
    pod_id: u64,
}

impl Connection {
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn pod(&self) -> &str {
        &self.pod
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.index
            .write()
            .disconnect(&self.namespace, &self.pod, self.pod_id);
        tracing::debug!(namespace = %self.namespace, pod = %self.pod, "sidecar disconnected");
    }
}

/// Registers a stream for a known pod. `resume` is the client's `(since, epoch)`; `has_redis`
/// whether its sidecar has a Redis store (else it enforces Global rules per pod).
pub fn connect(
    index: &SharedIndex,
    namespace: &str,
    pod: &str,
    resume: Option<(u64, &str)>,
    has_redis: bool,
) -> Option<(Connection, Subscription)> {
    let sub = index
        .write()
        .connect_with(namespace, pod, resume, has_redis)?;
    tracing::debug!(%namespace, %pod, resumed = sub.resumed, "sidecar connected");
    let conn = Connection {
        index: index.clone(),
        namespace: namespace.to_string(),
        pod: pod.to_string(),
        pod_id: sub.pod_id,
    };
    Some((conn, sub))
}

/// Records an ack; returns the stream lag of policy changes it completed.
pub fn ack(
    index: &SharedIndex,
    namespace: &str,
    pod: &str,
    version: u64,
    epoch: &str,
) -> Result<Vec<Duration>, AckError> {
    index.write().ack(namespace, pod, version, epoch)
}
