//! Stopping without cutting anything off: [`Drain::signal`] tells every task at once, then
//! [`Tasks::join`] waits for each, up to its own grace period.
//!
//! A task stops one of two ways. Tasks that write or serve (leader election, the membership
//! report, status, coverage, the servers) watch [`Drain::receiver`] themselves and stop between
//! two pieces of work: a request in flight finishes. Tasks that only wait for events (the
//! watches) are wrapped in [`Drain::until_signal`] and dropped where they wait for the next one,
//! which is the only place they can be.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The shutdown signal every task follows.
pub(super) struct Drain {
    tx: watch::Sender<bool>,
}

impl Drain {
    pub(super) fn new() -> Drain {
        Drain {
            tx: watch::Sender::new(false),
        }
    }

    /// For a task that stops itself between two pieces of work.
    pub(super) fn receiver(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// Tells every task to stop.
    pub(super) fn signal(&self) {
        self.tx.send_replace(true);
    }

    /// Completes once [`Drain::signal`] was called.
    pub(super) fn signalled(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.receiver();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    /// `task` until the signal, then dropped at the await it is parked on. Only for tasks whose
    /// every await is a wait for an event or a timer (no write in flight to cut off).
    pub(super) fn until_signal(
        &self,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + 'static {
        let signalled = self.signalled();
        async move {
            tokio::select! {
                () = task => {}
                () = signalled => {}
            }
        }
    }
}

/// The spawned tasks, each with the time it gets to finish once told to stop.
#[derive(Default)]
pub(super) struct Tasks {
    running: Vec<Task>,
}

struct Task {
    name: &'static str,
    grace: Duration,
    handle: JoinHandle<()>,
}

impl Tasks {
    /// Spawns `task`; `name` identifies it in the log if it outlives `grace`.
    pub(super) fn spawn(
        &mut self,
        name: &'static str,
        grace: Duration,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        self.running.push(Task {
            name,
            grace,
            handle: tokio::spawn(task),
        });
    }

    /// Waits for every task at once, each up to its grace. One still running after it is left
    /// to the process exit (and named in the log).
    pub(super) async fn join(self) {
        let waits = self.running.into_iter().map(|task| async move {
            if tokio::time::timeout(task.grace, task.handle).await.is_err() {
                tracing::warn!(task = task.name, grace = ?task.grace, "task still running after its shutdown grace period");
            }
        });
        futures_util::future::join_all(waits).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiting task stops at the signal; a working one finishes its work; one that overruns
    /// its grace does not hold up the others.
    #[tokio::test]
    async fn the_drain_waits_for_work_in_hand_up_to_each_grace() {
        let ms = Duration::from_millis;
        let drain = Drain::new();
        let mut tasks = Tasks::default();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let waiting = std::future::pending::<()>();
        tasks.spawn("waiting", ms(2000), drain.until_signal(waiting));
        let mut stop = drain.receiver();
        let done = done_tx.clone();
        tasks.spawn("working", ms(2000), async move {
            let _ = stop.wait_for(|s| *s).await;
            // The piece of work in hand when the signal came.
            tokio::time::sleep(ms(200)).await;
            let _ = done.send("working");
        });
        tasks.spawn("overrunning", ms(300), async move {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            let _ = done_tx.send("overrunning");
        });
        let t0 = tokio::time::Instant::now();
        drain.signal();
        tasks.join().await;
        let took = t0.elapsed();
        assert!(
            took >= ms(300) && took < ms(1500),
            "the longest wait, not the sum of the graces: {took:?}"
        );
        assert_eq!(done_rx.recv().await, Some("working"));
        assert!(done_rx.try_recv().is_err());
    }
}
