//! The installation's key-hash secret: one value shared by every sidecar, under which they
//! compute the stable identities of counter keys (audit lines, top keys, `key-hash`).
//!
//! It lives in a Secret the chart creates empty (so the controller needs no `create`
//! permission on Secrets, and `helm`/`kubectl apply` never overwrite what it holds); the first
//! controller replica to see it empty fills it with 32 random bytes, the others read that.
//! The value never changes on its own: identities stay comparable across restarts, upgrades
//! and reinstalls (the Secret is kept on uninstall). Rotating it is an operator's decision
//! (docs/operations.md): the controller reads the Secret again every [`RECHECK`] and streams a
//! new value to every connected sidecar, without a restart.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;

/// The data key holding the secret (hex).
pub const DATA_KEY: &str = "secret";
/// Shortest secret accepted from the Secret (bytes of its text).
const MIN_BYTES: usize = 16;
/// How often the Secret is read again for a rotation (a `get`, so the controller needs no
/// `list`/`watch` on Secrets).
pub const RECHECK: Duration = Duration::from_secs(30);

/// Reads the secret, filling the Secret first if it is empty. `Ok(None)`: the Secret does not
/// exist (the chart was told not to create it), which is not an error.
pub async fn load_or_fill(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Option<Arc<str>>> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    loop {
        let Some(mut secret) = api
            .get_opt(name)
            .await
            .with_context(|| format!("get Secret {namespace}/{name}"))?
        else {
            return Ok(None);
        };
        if let Some(value) = stored(&secret) {
            return Ok(Some(value));
        }
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        let value = hex::encode(bytes);
        secret
            .data
            .get_or_insert_with(Default::default)
            .insert(DATA_KEY.to_string(), ByteString(value.clone().into_bytes()));
        match api.replace(name, &PostParams::default(), &secret).await {
            Ok(_) => {
                tracing::info!(secret = %format!("{namespace}/{name}"), "generated the installation's key-hash secret");
                return Ok(Some(value.into()));
            }
            // Another replica filled it first: read what it wrote.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("fill Secret {namespace}/{name}"));
            }
        }
    }
}

/// The secret held by `secret`, if it holds a usable one.
fn stored(secret: &Secret) -> Option<Arc<str>> {
    let raw = secret.data.as_ref()?.get(DATA_KEY)?;
    let text = std::str::from_utf8(&raw.0).ok()?.trim();
    (text.len() >= MIN_BYTES).then(|| text.into())
}

/// Loads the secret in the background, retrying every 5 s until it has it (or learns there is
/// none), and publishes it to `tx`: streams opened from then on carry it, and open streams
/// get it in a new snapshot. Then reads it again every [`RECHECK`], publishing a rotated value.
/// Stops at `shutdown`, between two reads of the Secret (never in the middle of one).
pub async fn follow(
    client: kube::Client,
    namespace: String,
    name: String,
    tx: watch::Sender<Option<Arc<str>>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last_error: Option<String> = None;
    loop {
        match load_or_fill(&client, &namespace, &name).await {
            Ok(Some(value)) => {
                tx.send_replace(Some(value));
                watch_rotation(&client, &namespace, &name, &tx, RECHECK, shutdown).await;
                return;
            }
            Ok(None) => {
                tracing::warn!(secret = %format!("{namespace}/{name}"), "no key-hash Secret: sidecars use per-process key identities");
                return;
            }
            Err(e) => {
                let msg = format!("{e:#}");
                if last_error.as_deref() != Some(msg.as_str()) {
                    tracing::warn!(error = %msg, "cannot load the key-hash secret; retrying in 5s");
                    last_error = Some(msg);
                }
            }
        }
        if !sleep_unless_shutdown(Duration::from_secs(5), &mut shutdown).await {
            return;
        }
    }
}

/// Sleeps for `period`; false if `shutdown` came first.
async fn sleep_unless_shutdown(period: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    let stop = async {
        if shutdown.wait_for(|stop| *stop).await.is_err() {
            // No one left to say stop: sleep on.
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = tokio::time::sleep(period) => true,
        () = stop => false,
    }
}

/// Reads the Secret every `recheck` and publishes a value that changed. A Secret that is gone
/// or emptied keeps the last value in force (logged once): identities do not fall back to
/// per-process ones because of a mistake.
async fn watch_rotation(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    tx: &watch::Sender<Option<Arc<str>>>,
    recheck: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut complained = false;
    loop {
        if !sleep_unless_shutdown(recheck, &mut shutdown).await || tx.is_closed() {
            return;
        }
        match api.get_opt(name).await {
            Ok(Some(secret)) => match stored(&secret) {
                Some(value) => {
                    complained = false;
                    let rotated = tx.send_if_modified(|cur| {
                        let changed = cur.as_deref() != Some(&*value);
                        if changed {
                            *cur = Some(value.clone());
                        }
                        changed
                    });
                    if rotated {
                        tracing::info!(secret = %format!("{namespace}/{name}"), "the key-hash secret was rotated: streaming it to every sidecar");
                    }
                }
                None if !complained => {
                    complained = true;
                    tracing::warn!(secret = %format!("{namespace}/{name}"), "the key-hash Secret holds no usable value now; keeping the last one");
                }
                None => {}
            },
            Ok(None) if !complained => {
                complained = true;
                tracing::warn!(secret = %format!("{namespace}/{name}"), "the key-hash Secret is gone; keeping the last value");
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the key-hash Secret; trying again later")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_long_enough_value_counts() {
        let with = |v: &str| Secret {
            data: Some([(DATA_KEY.to_string(), ByteString(v.as_bytes().to_vec()))].into()),
            ..Default::default()
        };
        assert!(stored(&Secret::default()).is_none());
        assert!(stored(&with("short")).is_none());
        assert_eq!(
            stored(&with("0123456789abcdef0123\n")).as_deref(),
            Some("0123456789abcdef0123")
        );
    }
}
