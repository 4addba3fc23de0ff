//! Every run of the simulated handlers, and the faults that may explain a run again.
//!
//! A stored final reply per request says nothing of how often its handler ran: a runner that
//! finished a request and then lost the race to store its reply leaves the request to the next
//! owner, which runs it again, and one reply is still stored. So each handler run is recorded
//! here (the runner, the simulated time), and at the end:
//! - a request runs again only after a run on a runner that crashed, froze or had its lock
//!   storage slowed down (it cannot tell whether it still holds the shard), or after a write of
//!   its reply failed (storage errors: the request runs again once the retries are spent);
//! - with graceful faults only (rebalances, joins, restarts, slow storage), each request ran
//!   exactly once, and each entity ran its requests in storage order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cluster_core::sync::lock;
use cluster_core::{EntityAddress, Snowflake};

use super::{History, millis};

/// What a runner's entities record their runs with (a runtime extension).
pub(super) struct Recorder {
    pub(super) runs: Arc<Runs>,
    pub(super) runner: String,
    /// Whether handlers take a moment (the window in which a shard's release races a reply).
    pub(super) slow_handlers: bool,
}

impl Recorder {
    /// The handler of request `request_id` (with key `key`) of `address` starts; returns how
    /// long it takes, and the run, which the handler ends with [`Run::returned`].
    pub(super) fn ran(
        self: &Arc<Recorder>,
        key: &str,
        request_id: Snowflake,
        address: &EntityAddress,
    ) -> (Duration, Run) {
        let index = self.runs.ran(key, request_id, address, &self.runner);
        let run = Run { runs: Arc::clone(&self.runs), key: key.to_owned(), index, returned: false };
        if !self.slow_handlers {
            return (Duration::ZERO, run);
        }
        // A few milliseconds, the same for every run of one key.
        let spread = key.bytes().fold(7_u64, |hash, byte| hash.wrapping_mul(31) ^ u64::from(byte));
        (Duration::from_millis(spread % 40), run)
    }
}

/// One run of a handler: dropped before [`returned`](Run::returned), it was cut off.
pub(super) struct Run {
    runs: Arc<Runs>,
    key: String,
    index: usize,
    returned: bool,
}

impl Run {
    /// The handler returned.
    pub(super) fn returned(mut self) {
        self.returned = true;
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.returned {
            self.runs.state().cut_off.insert((std::mem::take(&mut self.key), self.index));
        }
    }
}

/// The runs of one simulation.
pub(super) struct Runs {
    history: History,
    state: Mutex<RunsState>,
}

#[derive(Default)]
struct RunsState {
    /// Each request's handler runs: (runner, simulated milliseconds).
    runs: BTreeMap<String, Vec<(String, u64)>>,
    /// Each request's address and id.
    requests: BTreeMap<String, (EntityAddress, Snowflake)>,
    /// Per entity, the requests in the order of their first runs.
    first_runs: BTreeMap<EntityAddress, Vec<Snowflake>>,
    /// Runners that crashed, froze or had slow lock storage, with what happened.
    ungraceful: BTreeMap<String, &'static str>,
    /// The runs cut off before their handler returned (the instance was interrupted: the end of
    /// a drain, a lost lock), by key and the run's position: the next run is expected.
    cut_off: BTreeSet<(String, usize)>,
    /// The requests a reply write of failed (by injection), and their entities.
    failed_replies: BTreeSet<Snowflake>,
    failed_entities: BTreeSet<String>,
}

impl Runs {
    pub(super) fn new(history: History) -> Arc<Runs> {
        Arc::new(Runs { history, state: Mutex::default() })
    }

    fn state(&self) -> MutexGuard<'_, RunsState> {
        lock(&self.state)
    }

    /// Records a run; its position among the key's runs.
    fn ran(
        &self,
        key: &str,
        request_id: Snowflake,
        address: &EntityAddress,
        runner: &str,
    ) -> usize {
        let at = millis(self.history.start.elapsed());
        let mut state = self.state();
        let runs = state.runs.entry(key.to_owned()).or_default();
        runs.push((runner.to_owned(), at));
        let n = runs.len();
        if n == 1 {
            state.requests.insert(key.to_owned(), (address.clone(), request_id));
            state.first_runs.entry(address.clone()).or_default().push(request_id);
        } else {
            drop(state);
            self.history.record(format!("{key} runs again ({n}) on {runner}"));
        }
        n - 1
    }

    /// Whether the handler of the request with key `key` ran.
    pub(super) fn has_run(&self, key: &str) -> bool {
        self.state().runs.contains_key(key)
    }

    /// `runner` crashed, froze or lost track of its locks (`what`): its runs may be repeated.
    pub(super) fn ungraceful(&self, runner: &str, what: &'static str) {
        self.state().ungraceful.entry(runner.to_owned()).or_insert(what);
    }

    /// A reply write of request `request_id` (of `address`) failed by injection: the request
    /// may run again.
    pub(super) fn reply_write_failed(&self, request_id: Snowflake, address: Option<EntityAddress>) {
        let mut state = self.state();
        state.failed_replies.insert(request_id);
        if let Some(address) = address {
            state.failed_entities.insert(address.entity_id.as_str().to_owned());
        }
    }

    /// The entities a reply write of failed (by injection).
    pub(super) fn failed_entities(&self) -> BTreeSet<String> {
        self.state().failed_entities.clone()
    }

    /// The runner that an earlier run of a request was on may have lost it without a fault:
    /// the runs after the first that no crash, freeze, outage or cut-off explains (a run cut
    /// off, by the end of a drain for instance, runs again).
    pub(super) fn unexplained_reruns(&self) -> Vec<String> {
        let state = self.state();
        let mut unexplained = Vec::new();
        for (key, runs) in &state.runs {
            let reply_failed = state
                .requests
                .get(key)
                .is_some_and(|(_, request_id)| state.failed_replies.contains(request_id));
            for (index, pair) in runs.windows(2).enumerate() {
                let ((runner, at), (again_on, again_at)) = (&pair[0], &pair[1]);
                let cut_off = state.cut_off.contains(&(key.clone(), index));
                if state.ungraceful.contains_key(runner) || reply_failed || cut_off {
                    continue;
                }
                unexplained.push(format!(
                    "{key} ran on {runner} at {at} ms and again on {again_on} at {again_at} ms, \
                     with no crash, freeze or failed reply write to explain it"
                ));
            }
        }
        unexplained
    }

    /// Per entity, whether the first runs followed storage order (`order` gives an entity's
    /// stored requests in storage order): the entities whose did not.
    pub(super) fn out_of_order(
        &self,
        order: impl Fn(&EntityAddress) -> Vec<Snowflake>,
    ) -> Vec<String> {
        let state = self.state();
        let mut wrong = Vec::new();
        for (address, ran) in &state.first_runs {
            let ran_ids: BTreeSet<&Snowflake> = ran.iter().collect();
            let stored: Vec<Snowflake> =
                order(address).into_iter().filter(|id| ran_ids.contains(id)).collect();
            if stored != *ran {
                wrong.push(format!(
                    "{} ran {ran:?}, stored in the order {stored:?}",
                    address.entity_id
                ));
            }
        }
        wrong
    }

    /// The runners whose runs may be repeated, and why.
    pub(super) fn ungraceful_runners(&self) -> BTreeMap<String, &'static str> {
        self.state().ungraceful.clone()
    }

    /// How many handler runs and repeated runs there were.
    pub(super) fn counts(&self) -> (usize, usize) {
        let state = self.state();
        let runs: usize = state.runs.values().map(Vec::len).sum();
        (runs, runs - state.runs.len())
    }
}
