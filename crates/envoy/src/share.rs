//! Demand-weighted shares of a limit among the Envoys that decide it locally (RLQS).
//!
//! RLQS is leasing by another name: each Envoy enforces a token bucket the server assigns, and
//! reports what it allowed and denied. This module is the book of those assignments: per
//! bucket (a rule and a key), each reporting stream's demand, what it was assigned, and what
//! the other server replicas reported through Redis. It is pure (clock passed in, no I/O), so
//! the rules it keeps are unit-tested here:
//!
//! - a stream's rate is the limit's rate times its part of the fleet's demand (allowed plus
//!   denied requests: refused demand counts, or a starved Envoy could never grow);
//! - the sum of rates assigned, here and on other replicas, never exceeds the limit: a new
//!   rate is capped by what the others hold now, and a stream holding more than its new fair
//!   part is told at once ([`Book::report`] returns it), so the room comes free;
//! - a rate within 5 % of the one held is kept as it is, so Envoy keeps its bucket's state
//!   instead of starting a new, full one;
//! - a stream that reports a bucket idle for [`IDLE_REPORTS`] reports in a row is told to
//!   abandon it.

use std::collections::HashMap;

use tollgate_limiter::Nanos;

/// Reports in a row with no requests before a stream is told to abandon the bucket.
pub const IDLE_REPORTS: u32 = 5;
/// A rate this close to the one held is not worth a new bucket at the Envoy.
const KEEP_WITHIN: f64 = 0.05;
/// Weight of the newest report in a stream's demand (the rest is its history). Envoy 1.40
/// reports every 5 s, so the history is short.
const DEMAND_WEIGHT: f64 = 0.7;

/// Identifies a stream (one Envoy's connection) on this replica.
pub type StreamId = u64;

/// What a bucket is limited to, in requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limit {
    /// Requests per second, fleet-wide.
    pub rate: f64,
    /// The most requests at once, fleet-wide.
    pub burst: u64,
}

/// An assignment: a token bucket of `rate` requests per second holding at most `burst`.
/// A rate of 0 denies everything until the next assignment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Assignment {
    pub rate: f64,
    pub burst: u64,
}

/// What the other replicas reported for a bucket (through Redis), and when it was read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Remote {
    pub demand: f64,
    pub assigned: f64,
    /// Envoy streams on other replicas reporting this bucket.
    pub streams: u32,
    pub read_at: Nanos,
}

/// The answer to one stream's report for one bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Answer {
    Assign(Assignment),
    /// The bucket was idle: the Envoy drops it (and reports it anew when it sees traffic).
    Abandon,
}

#[derive(Clone, Debug, Default)]
struct Member {
    /// Requests per second offered (allowed + denied), smoothed.
    demand: f64,
    idle_reports: u32,
    held: Option<Assignment>,
    /// When this stream last reported the bucket (the book's clock). The span between two
    /// reports is measured here: Envoy's `time_elapsed` is truncated to whole seconds.
    last_report: Option<Nanos>,
    /// Reports whose span was known so far; until one is, the demand is a guess
    /// ([`Bucket::demand_of`]).
    measured: u32,
}

#[derive(Debug, Default)]
struct Bucket {
    members: HashMap<StreamId, Member>,
    remote: Remote,
    /// The limit as of the last report (rules may change between reports).
    limit: Option<Limit>,
}

impl Bucket {
    fn local_demand(&self) -> f64 {
        self.members.values().map(|m| self.demand_of(m)).sum()
    }

    /// A member's demand, or for one not measured yet (a new bucket's first request) the
    /// average of those that are: guessing its one request a second squeezed a new Envoy to
    /// nearly nothing until its next report, 5 s later.
    fn demand_of(&self, m: &Member) -> f64 {
        if m.measured > 0 {
            return m.demand;
        }
        let (sum, n) = self
            .members
            .values()
            .filter(|o| o.measured > 0)
            .fold((0.0, 0u32), |(s, n), o| (s + o.demand, n + 1));
        if n > 0 {
            sum / f64::from(n)
        } else if self.remote.streams > 0 && self.remote.demand > 0.0 {
            self.remote.demand / f64::from(self.remote.streams)
        } else {
            1.0
        }
    }

    fn local_assigned_except(&self, stream: StreamId) -> f64 {
        self.members
            .iter()
            .filter(|(id, _)| **id != stream)
            .filter_map(|(_, m)| m.held.map(|a| a.rate))
            .sum()
    }

    /// The stream's fair part of `limit` by demand (an equal part while nobody has any).
    fn fair(&self, stream: StreamId, limit: Limit, remote: &Remote) -> f64 {
        let total = self.local_demand() + remote.demand;
        let mine = self.members.get(&stream).map_or(0.0, |m| self.demand_of(m));
        if total > 0.0 {
            limit.rate * mine / total
        } else {
            let streams = self.members.len() as f64 + f64::from(remote.streams);
            limit.rate / streams.max(1.0)
        }
    }
}

/// One usage report's figures for a bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Usage {
    pub allowed: u64,
    pub denied: u64,
    /// Seconds the counts cover, as the Envoy says; used only for a stream's first report of
    /// a bucket (later spans are measured between reports). `None` when the report covers no
    /// time: Envoy reports a new bucket at its first request, which says nothing of its rate.
    pub elapsed: Option<f64>,
}

/// The assignments of one replica, per bucket key.
#[derive(Debug, Default)]
pub struct Book<K: std::hash::Hash + Eq + Clone> {
    buckets: HashMap<K, Bucket>,
}

impl<K: std::hash::Hash + Eq + Clone> Book<K> {
    pub fn new() -> Self {
        Book {
            buckets: HashMap::new(),
        }
    }

    /// Records `stream`'s report for `bucket` and answers it. Also returns the other streams
    /// of this replica that now hold more than their fair part, with their new assignment,
    /// so the caller pushes it to them at once (`remote` is what other replicas hold, or
    /// `None` when they do not count: a local rule, or no Redis).
    pub fn report(
        &mut self,
        bucket: &K,
        stream: StreamId,
        usage: Usage,
        limit: Limit,
        remote: Option<Remote>,
        now: Nanos,
    ) -> (Answer, Vec<(StreamId, Assignment)>) {
        let b = self.buckets.entry(bucket.clone()).or_default();
        b.limit = Some(limit);
        if let Some(r) = remote {
            b.remote = r;
        }
        let remote = remote.unwrap_or_default();
        let requests = usage.allowed.saturating_add(usage.denied);
        let member = b.members.entry(stream).or_default();
        if requests == 0 {
            member.idle_reports += 1;
            if member.idle_reports >= IDLE_REPORTS {
                b.members.remove(&stream);
                if b.members.is_empty() {
                    self.buckets.remove(bucket);
                }
                return (Answer::Abandon, Vec::new());
            }
        } else {
            member.idle_reports = 0;
        }
        let elapsed = match member.last_report {
            Some(t) => Some(now.saturating_sub(t) as f64 / 1e9),
            None => usage.elapsed,
        };
        member.last_report = Some(now);
        if let Some(elapsed) = elapsed {
            let observed = requests as f64 / elapsed.max(0.001);
            member.demand = if member.measured == 0 {
                observed
            } else {
                DEMAND_WEIGHT * observed + (1.0 - DEMAND_WEIGHT) * member.demand
            };
            member.measured += 1;
        }
        // Others first: what they are told to give back is room for this stream now.
        let pushes = Self::shrink_others(b, stream, limit, &remote);
        let answer = Self::assign(b, stream, limit, &remote);
        (Answer::Assign(answer), pushes)
    }

    /// A stream's new assignment: its fair part, capped by what the others hold.
    fn assign(b: &mut Bucket, stream: StreamId, limit: Limit, remote: &Remote) -> Assignment {
        let fair = b.fair(stream, limit, remote);
        let room = (limit.rate - b.local_assigned_except(stream) - remote.assigned).max(0.0);
        let rate = fair.min(room);
        let held = b.members.get(&stream).and_then(|m| m.held);
        let assignment = match held {
            Some(h) if h.rate <= room && (h.rate - rate).abs() <= KEEP_WITHIN * rate => h,
            _ => Assignment {
                rate,
                burst: burst_for(rate, limit),
            },
        };
        if let Some(m) = b.members.get_mut(&stream) {
            m.held = Some(assignment);
        }
        assignment
    }

    /// Streams other than `stream` holding more than their fair part (beyond the keep
    /// margin) get their fair part now.
    fn shrink_others(
        b: &mut Bucket,
        stream: StreamId,
        limit: Limit,
        remote: &Remote,
    ) -> Vec<(StreamId, Assignment)> {
        let over: Vec<(StreamId, f64)> = b
            .members
            .iter()
            .filter(|(id, _)| **id != stream)
            .filter_map(|(id, m)| {
                let held = m.held?;
                let fair = b.fair(*id, limit, remote);
                (held.rate > fair * (1.0 + KEEP_WITHIN)).then_some((*id, fair))
            })
            .collect();
        over.into_iter()
            .map(|(id, fair)| {
                let a = Assignment {
                    rate: fair,
                    burst: burst_for(fair, limit),
                };
                if let Some(m) = b.members.get_mut(&id) {
                    m.held = Some(a);
                }
                (id, a)
            })
            .collect()
    }

    /// Brings every stream to its fair part between reports (Envoy reports only every few
    /// seconds; demand and room change in between as others report or other replicas sync):
    /// those holding too much shrink first, then those holding too little grow into the room
    /// that leaves. Returns the changed assignments, to push.
    pub fn rebalance(&mut self) -> Vec<(K, StreamId, Assignment)> {
        let mut changed = Vec::new();
        for (key, b) in &mut self.buckets {
            let Some(limit) = b.limit else { continue };
            let remote = b.remote;
            for (id, a) in Self::shrink_others(b, StreamId::MAX, limit, &remote) {
                changed.push((key.clone(), id, a));
            }
            let ids: Vec<StreamId> = b.members.keys().copied().collect();
            for id in ids {
                if let Some(a) = Self::grow(b, id, limit, &remote) {
                    changed.push((key.clone(), id, a));
                }
            }
        }
        changed
    }

    /// A stream holding clearly less than its fair part gets what the room allows.
    fn grow(b: &mut Bucket, id: StreamId, limit: Limit, remote: &Remote) -> Option<Assignment> {
        let fair = b.fair(id, limit, remote);
        let held = b.members.get(&id)?.held?;
        if held.rate >= fair * (1.0 - KEEP_WITHIN) {
            return None;
        }
        let room = (limit.rate - b.local_assigned_except(id) - remote.assigned).max(0.0);
        let rate = fair.min(room);
        if rate <= held.rate * (1.0 + KEEP_WITHIN) {
            return None;
        }
        let a = Assignment {
            rate,
            burst: burst_for(rate, limit),
        };
        b.members.get_mut(&id)?.held = Some(a);
        Some(a)
    }

    /// Forgets a stream that went away (its assignments lapse at the Envoy by their TTL).
    pub fn leave(&mut self, stream: StreamId) {
        self.buckets.retain(|_, b| {
            b.members.remove(&stream);
            !b.members.is_empty()
        });
    }

    /// This replica's demand and assignments per bucket, for the other replicas.
    pub fn totals(&self) -> Vec<(K, f64, f64, u32)> {
        self.buckets
            .iter()
            .map(|(k, b)| {
                let assigned = b.local_assigned_except(StreamId::MAX);
                (
                    k.clone(),
                    b.local_demand(),
                    assigned,
                    b.members.len() as u32,
                )
            })
            .collect()
    }

    /// What the other replicas hold for `bucket`, as last read from Redis.
    pub fn remote(&self, bucket: &K) -> Option<Remote> {
        self.buckets.get(bucket).map(|b| b.remote)
    }

    /// What other replicas hold for a bucket this replica is about to report for the first
    /// time (read from Redis before its first assignment).
    pub fn prime_remote(&mut self, bucket: &K, remote: Remote) {
        self.buckets.entry(bucket.clone()).or_default().remote = remote;
    }

    /// Sets what other replicas hold (from the fleet sync).
    pub fn set_remote(&mut self, bucket: &K, remote: Remote) {
        if let Some(b) = self.buckets.get_mut(bucket) {
            b.remote = remote;
        }
    }

    /// Buckets in the book.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Streams holding an assignment, over all buckets.
    pub fn assignments(&self) -> usize {
        self.buckets.values().map(|b| b.members.len()).sum()
    }
}

/// A share's burst: its part of the limit's burst, at least one request, and at least two
/// for a share of a request a second or more: a bucket holding one token loses the refill
/// while it is full, and a share of 10 a second admitted 7.
fn burst_for(rate: f64, limit: Limit) -> u64 {
    if limit.rate <= 0.0 || rate <= 0.0 {
        return 0;
    }
    let least = if rate >= 1.0 { 2 } else { 1 };
    ((limit.burst as f64 * rate / limit.rate).floor() as u64).max(least)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Nanos = 1_000_000_000;

    const LIMIT: Limit = Limit {
        rate: 100.0,
        burst: 20,
    };

    /// `requests` in the second before round `round` (rounds are a second apart).
    fn report(
        book: &mut Book<&'static str>,
        stream: StreamId,
        requests: u64,
        remote: Option<Remote>,
        round: u64,
    ) -> (Answer, Vec<(StreamId, Assignment)>) {
        let usage = Usage {
            allowed: requests,
            denied: 0,
            elapsed: Some(1.0),
        };
        book.report(&"k", stream, usage, LIMIT, remote, round * SECOND)
    }

    fn assigned(a: Answer) -> Assignment {
        match a {
            Answer::Assign(a) => a,
            Answer::Abandon => panic!("abandoned"),
        }
    }

    #[test]
    fn shares_follow_demand_and_never_sum_above_the_limit() {
        let mut book = Book::new();
        // 90/5/5 of the demand, reported over several rounds.
        let mut held = [0.0; 3];
        for round in 1..8 {
            for (i, d) in [900, 50, 50].into_iter().enumerate() {
                let (a, pushes) = report(&mut book, i as u64, d, None, round);
                held[i] = assigned(a).rate;
                for (s, p) in pushes {
                    held[s as usize] = p.rate;
                }
                assert!(held.iter().sum::<f64>() <= LIMIT.rate + 1e-9, "{held:?}");
            }
        }
        assert!((held[0] - 90.0).abs() < 1.0, "{held:?}");
        assert!((held[1] - 5.0).abs() < 0.5, "{held:?}");
    }

    #[test]
    fn demand_is_measured_between_reports() {
        let mut book = Book::new();
        // Each stream reports the bucket at its first request (no span), then after 5 s.
        let first = Usage {
            allowed: 1,
            denied: 0,
            elapsed: None,
        };
        book.report(&"k", 1, first, LIMIT, None, 0);
        book.report(&"k", 2, first, LIMIT, None, 0);
        // Five seconds later: stream 1 saw 500 requests, stream 2 saw 50.
        let usage = |n| Usage {
            allowed: n,
            denied: 0,
            // Envoy truncates to whole seconds; the book's clock decides.
            elapsed: Some(4.0),
        };
        book.report(&"k", 1, usage(500), LIMIT, None, 5 * SECOND);
        let (b, _) = book.report(&"k", 2, usage(50), LIMIT, None, 5 * SECOND);
        let b = assigned(b);
        assert!((b.rate - 100.0 * 10.0 / 110.0).abs() < 1e-6, "{b:?}");
    }

    #[test]
    fn a_new_buckets_first_request_is_not_taken_for_its_rate() {
        let mut book = Book::new();
        report(&mut book, 1, 50, None, 1);
        report(&mut book, 2, 50, None, 1);
        // Stream 3 reports the bucket at its first request: no span, so no rate yet. It gets
        // the average's part, not a part of one request a second.
        let first = Usage {
            allowed: 1,
            denied: 0,
            elapsed: None,
        };
        let (a, _) = book.report(&"k", 3, first, LIMIT, None, SECOND);
        let rate = assigned(a).rate;
        assert!(rate > 30.0, "{rate}");
    }

    #[test]
    fn a_growing_stream_takes_room_only_as_others_give_it_back() {
        let mut book = Book::new();
        let a = assigned(report(&mut book, 1, 100, None, 1).0);
        assert_eq!(a.rate, 100.0);
        // Stream 2 arrives with equal demand: stream 1 is told to shrink at once.
        let (b, pushes) = report(&mut book, 2, 100, None, 1);
        let b = assigned(b);
        assert_eq!(
            pushes,
            vec![(
                1,
                Assignment {
                    rate: 50.0,
                    burst: 10
                }
            )]
        );
        assert_eq!(b.rate, 50.0);
    }

    #[test]
    fn other_replicas_count_in_demand_and_in_the_room() {
        let remote = Remote {
            demand: 300.0,
            assigned: 75.0,
            streams: 3,
            read_at: 0,
        };
        let mut book = Book::new();
        let a = assigned(report(&mut book, 1, 100, Some(remote), 1).0);
        assert_eq!(a.rate, 25.0);
        // The others still hold 90: only 10 is left.
        let remote = Remote {
            assigned: 90.0,
            ..remote
        };
        let mut book = Book::new();
        let a = assigned(report(&mut book, 1, 100, Some(remote), 1).0);
        assert!((a.rate - 10.0).abs() < 1e-9, "{a:?}");
    }

    #[test]
    fn a_steady_share_keeps_its_assignment() {
        let mut book = Book::new();
        report(&mut book, 1, 60, None, 1);
        report(&mut book, 2, 40, None, 1);
        let first = assigned(report(&mut book, 1, 60, None, 2).0);
        report(&mut book, 2, 40, None, 2);
        let again = assigned(report(&mut book, 1, 61, None, 3).0);
        assert_eq!(first, again);
    }

    #[test]
    fn a_rebalance_between_reports_gives_room_back_to_the_starved() {
        let mut book = Book::new();
        // Stream 1 holds everything; the other replicas then report demand equal to ours
        // and hold nothing yet.
        assert_eq!(assigned(report(&mut book, 1, 100, None, 1).0).rate, 100.0);
        let remote = Remote {
            demand: 100.0,
            assigned: 0.0,
            streams: 1,
            read_at: 0,
        };
        book.set_remote(&"k", remote);
        let changed = book.rebalance();
        assert_eq!(
            changed,
            vec![(
                "k",
                1,
                Assignment {
                    rate: 50.0,
                    burst: 10
                }
            )]
        );
        // They shrink theirs to 10: ours grows into the room at the next rebalance.
        book.set_remote(
            &"k",
            Remote {
                demand: 20.0,
                assigned: 10.0,
                ..remote
            },
        );
        let changed = book.rebalance();
        let grown = changed[0].2.rate;
        assert!((grown - 100.0 * 100.0 / 120.0).abs() < 1e-9, "{changed:?}");
        assert!(book.rebalance().is_empty(), "settled");
    }

    #[test]
    fn idle_buckets_are_abandoned() {
        let mut book = Book::new();
        report(&mut book, 1, 10, None, 1);
        for round in 1..u64::from(IDLE_REPORTS) {
            assert!(matches!(
                report(&mut book, 1, 0, None, 1 + round).0,
                Answer::Assign(_)
            ));
        }
        let last = report(&mut book, 1, 0, None, 1 + u64::from(IDLE_REPORTS)).0;
        assert_eq!(last, Answer::Abandon);
        assert!(book.is_empty());
    }

    #[test]
    fn a_stream_that_leaves_frees_its_share() {
        let mut book = Book::new();
        report(&mut book, 1, 50, None, 1);
        report(&mut book, 2, 50, None, 1);
        book.leave(1);
        assert_eq!(book.assignments(), 1);
        let a = assigned(report(&mut book, 2, 50, None, 2).0);
        assert_eq!(a.rate, 100.0);
    }
}
