//! A real Redis Cluster on loopback ports, its nodes killed by PID when dropped.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::{Redis, free_port};

/// `masters` cluster-enabled `redis-server`s, each with `replicas` replicas, joined by
/// `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts the nodes with `cluster-node-timeout` `node_timeout` (how soon a replica takes
    /// over a dead master) and returns once every node reports `cluster_state:ok` and every
    /// replica is in sync with its master.
    pub fn start(masters: usize, replicas: usize, node_timeout: Duration) -> RedisCluster {
        let timeout = node_timeout.as_millis().to_string();
        let nodes: Vec<Redis> = (0..masters * (1 + replicas))
            .map(|_| {
                Redis::start_on(
                    free_port(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-node-timeout",
                        &timeout,
                    ],
                )
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let c = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.ready(masters * replicas) {
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    /// Every node reports the cluster ok, and `replicas` replicas are in sync.
    fn ready(&self, replicas: usize) -> bool {
        let ok = self
            .nodes
            .iter()
            .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
        let synced: Vec<&Redis> = self
            .nodes
            .iter()
            .filter(|n| n.cli(&["ROLE"]).starts_with("slave"))
            .collect();
        ok && synced.len() == replicas
            && synced.iter().all(|n| {
                n.cli(&["INFO", "replication"])
                    .contains("master_link_status:up")
            })
    }

    /// The seed list for `--redis-cluster`.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(Redis::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}
