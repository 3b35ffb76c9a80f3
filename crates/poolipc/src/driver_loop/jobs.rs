//! The room's jobs as the loop holds them ([`JobState`]), from their Lend to their
//! JobFinished: what each lent, its results by request and by handoff, and what it leaves to
//! free or to give back.

use std::collections::{BTreeMap, HashMap};

use poolipc_contract::FailReason;
use poolipc_driver::{DevicePtr, EventBlob, OwnedEvent, StreamHandle};
use poolipc_types::{AllocId, HandoffId, JobId, RequestId, Rung, WorkerId};

use super::ArenaInput;
use super::allocator::SharedAllocator;
use crate::state::{Answer, ArenaLease, ResultTensor};

/// A job as the loop holds it, from its Lend to its JobFinished.
pub(super) struct JobState {
    pub(super) stream: StreamHandle,
    /// The caller's allocator, run on the room's allocator thread ([`allocator`](super::allocator)).
    pub(super) alloc: Option<SharedAllocator>,
    pub(super) done: Answer,
    pub(super) ready: Option<(OwnedEvent, EventBlob)>,
    pub(super) input_rungs: Vec<Rung>,
    pub(super) input_reasons: Vec<Option<String>>,
    /// Arena-copy inputs: their blocks, copied back into the caller's tensors (unless lent
    /// read-only) and given back (stream-ordered, on the job's stream) at the input's
    /// release, which comes once the host saw the worker's DONE complete or once the worker
    /// was reaped.
    pub(super) arena_inputs: HashMap<HandoffId, ArenaInput>,
    /// The first copy-back that failed, for the job's error: a write of the worker's that
    /// could not reach the caller's tensor is never dropped silently.
    pub(super) copy_back_error: Option<String>,
    pub(super) staged: bool,
    /// Staged inputs: where their bytes are.
    pub(super) staged_inputs: HashMap<HandoffId, (DevicePtr, u64)>,
    /// Results, by the contract's request id (increasing: the worker's order).
    pub(super) results: BTreeMap<RequestId, ResultTensor>,
    pub(super) requests_by_alloc: HashMap<AllocId, RequestId>,
    pub(super) requests_by_handoff: HashMap<HandoffId, RequestId>,
    /// Result memory that will not be handed out: freed (default allocator) or returned.
    pub(super) orphans: Vec<DevicePtr>,
    /// Input allocations lent by pointer: their entries in `Loop::lent` are dropped at release.
    pub(super) lent_bases: Vec<u64>,
    /// The first result request the parent refused, for the job's error.
    pub(super) refused: Option<crate::error::ResultRefusal>,
    /// The job's arena slice: given back whole when dropped, or split at its release into
    /// the carved results and the rest.
    pub(super) slice: Option<ArenaLease>,
    /// Results carved out of the slice, by their place among the job's results.
    pub(super) carved: BTreeMap<u32, ResultTensor>,
    /// Why the slice could not be split into its carves, for the job's error.
    pub(super) slice_error: Option<String>,
    /// The worker's DONE could not be asked about (its event would not open, say):
    /// nothing orders the caller after the worker's writes, so the job fails whatever the
    /// contract concludes, and its results are not handed out.
    pub(super) done_failed: Option<String>,
    /// Why the job fails when `done_failed` is set (a protocol violation unless a bound was
    /// passed).
    pub(super) failed_as: Option<FailReason>,
}

impl JobState {
    /// A result that will not be handed out: an arena block goes back to the arena now
    /// (stream-ordered on the job's stream, by dropping it); other memory waits in `orphans`
    /// to be freed or returned.
    pub(super) fn discard(&mut self, r: ResultTensor) {
        if !r.is_arena() {
            self.orphans.push(r.ptr);
        }
    }
}

impl JobState {
    /// A job lent on `stream`, answered through `done`, its results made by `alloc` (the
    /// shared pool's default when `None`); everything else starts empty.
    pub(super) fn new(
        stream: StreamHandle,
        alloc: Option<SharedAllocator>,
        done: Answer,
    ) -> JobState {
        JobState {
            stream,
            alloc,
            done,
            ready: None,
            input_rungs: Vec::new(),
            input_reasons: Vec::new(),
            arena_inputs: HashMap::new(),
            copy_back_error: None,
            staged: false,
            staged_inputs: HashMap::new(),
            results: BTreeMap::new(),
            requests_by_alloc: HashMap::new(),
            requests_by_handoff: HashMap::new(),
            orphans: Vec::new(),
            lent_bases: Vec::new(),
            refused: None,
            slice: None,
            carved: BTreeMap::new(),
            slice_error: None,
            done_failed: None,
            failed_as: None,
        }
    }

    /// Result `request` was made: `result`, lent under `alloc`.
    pub(super) fn record(&mut self, request: RequestId, alloc: AllocId, result: ResultTensor) {
        self.results.insert(request, result);
        self.requests_by_alloc.insert(alloc, request);
    }

    /// The grant of the result lent under `alloc` names it `handoff` on the wire.
    pub(super) fn granted(&mut self, alloc: AllocId, handoff: HandoffId) {
        if let Some(&req) = self.requests_by_alloc.get(&alloc) {
            self.requests_by_handoff.insert(handoff, req);
        }
    }

    /// The result the wire calls `handoff`, if it is one of this job's.
    pub(super) fn result_by_handoff(&self, handoff: HandoffId) -> Option<&ResultTensor> {
        self.requests_by_handoff
            .get(&handoff)
            .and_then(|req| self.results.get(req))
    }

    /// Records `ptr`, memory of the job's allocator that will not be handed out, among the
    /// job's orphans (given back with its error), unless it is recorded already, as an
    /// orphan or as a result.
    pub(super) fn keep_orphan(&mut self, ptr: DevicePtr) {
        if !self.orphans.contains(&ptr) && !self.results.values().any(|r| r.ptr == ptr) {
            self.orphans.push(ptr);
        }
    }

    /// The bytes of its results in the shared pool (not the arena's) that the loop frees if
    /// the job fails: none where the caller's allocator made them (they are the caller's).
    pub(super) fn pool_result_bytes(&self) -> u64 {
        if self.alloc.is_some() {
            return 0;
        }
        self.results
            .values()
            .filter(|r| !r.is_arena())
            .map(|r| r.bytes)
            .sum()
    }
}

/// The room's jobs, by (worker, job).
#[derive(Default)]
pub(super) struct Jobs(HashMap<(WorkerId, JobId), JobState>);

impl Jobs {
    pub(super) fn get(&self, key: &(WorkerId, JobId)) -> Option<&JobState> {
        self.0.get(key)
    }

    pub(super) fn get_mut(&mut self, key: &(WorkerId, JobId)) -> Option<&mut JobState> {
        self.0.get_mut(key)
    }

    pub(super) fn contains_key(&self, key: &(WorkerId, JobId)) -> bool {
        self.0.contains_key(key)
    }

    pub(super) fn insert(&mut self, key: (WorkerId, JobId), job: JobState) {
        self.0.insert(key, job);
    }

    pub(super) fn remove(&mut self, key: &(WorkerId, JobId)) -> Option<JobState> {
        self.0.remove(key)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every job, taken out (the thread ends).
    pub(super) fn take_all(&mut self) -> HashMap<(WorkerId, JobId), JobState> {
        std::mem::take(&mut self.0)
    }

    /// `worker`'s jobs.
    pub(super) fn of(&self, worker: WorkerId) -> Vec<JobId> {
        self.0
            .keys()
            .filter(|k| k.0 == worker)
            .map(|k| k.1)
            .collect()
    }

    /// The pool bytes `worker`'s jobs' results hold that the loop frees if it is lost
    /// ([`JobState::pool_result_bytes`]).
    pub(super) fn pool_result_bytes(&self, worker: WorkerId) -> u64 {
        self.0
            .iter()
            .filter(|((w, _), _)| *w == worker)
            .map(|(_, st)| st.pool_result_bytes())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use poolipc_driver::{DevicePtr, StreamHandle};
    use poolipc_types::{AllocId, DType, HandoffId, JobId, RequestId, Rung, WorkerId};

    use super::{JobState, Jobs};
    use crate::state::{Answer, Completion, ResultTensor};
    use crate::tensor::ResultShape;

    fn job(own_allocator: bool) -> JobState {
        let alloc = own_allocator.then(|| {
            let a: crate::state::ResultAllocator = Box::new(|_, _, _| Ok(DevicePtr(0)));
            Arc::new(Mutex::new(a))
        });
        JobState::new(
            StreamHandle::LEGACY,
            alloc,
            Answer(Arc::new(Completion::default())),
        )
    }

    fn result(ptr: u64, bytes: u64) -> ResultTensor {
        ResultTensor::new(
            DevicePtr(ptr),
            bytes,
            ResultShape::new(DType::U8, &[bytes]),
            Rung::PoolPointer,
        )
    }

    #[test]
    fn a_result_is_found_by_its_grants_handoff() {
        let mut st = job(false);
        st.record(RequestId(0), AllocId(5), result(0x1000, 64));
        assert!(
            st.result_by_handoff(HandoffId(9)).is_none(),
            "not granted yet"
        );
        st.granted(AllocId(5), HandoffId(9));
        st.granted(AllocId(6), HandoffId(10));
        assert_eq!(
            st.result_by_handoff(HandoffId(9)).map(|r| r.ptr),
            Some(DevicePtr(0x1000))
        );
        assert!(
            st.result_by_handoff(HandoffId(10)).is_none(),
            "no such result"
        );
    }

    #[test]
    fn an_orphan_is_kept_once_and_never_when_it_is_a_result() {
        let mut st = job(true);
        st.record(RequestId(0), AllocId(1), result(0x1000, 64));
        st.keep_orphan(DevicePtr(0x1000));
        st.keep_orphan(DevicePtr(0x2000));
        st.keep_orphan(DevicePtr(0x2000));
        assert_eq!(st.orphans, vec![DevicePtr(0x2000)]);
    }

    #[test]
    fn the_pool_bytes_a_lost_worker_owes_are_its_default_allocator_results() {
        let (w1, w2) = (WorkerId(1), WorkerId(2));
        let mut jobs = Jobs::default();
        let mut a = job(false);
        a.record(RequestId(0), AllocId(1), result(0x1000, 64));
        a.record(RequestId(1), AllocId(2), result(0x2000, 36));
        let mut b = job(true);
        b.record(RequestId(0), AllocId(3), result(0x3000, 1000));
        let mut c = job(false);
        c.record(RequestId(0), AllocId(4), result(0x4000, 7));
        jobs.insert((w1, JobId(1)), a);
        jobs.insert((w1, JobId(2)), b);
        jobs.insert((w2, JobId(3)), c);
        assert_eq!(
            jobs.pool_result_bytes(w1),
            100,
            "the caller's allocator's are its own"
        );
        assert_eq!(jobs.pool_result_bytes(w2), 7);
        let mut mine = jobs.of(w1);
        mine.sort_unstable();
        assert_eq!(mine, vec![JobId(1), JobId(2)]);
        assert!(jobs.remove(&(w2, JobId(3))).is_some() && jobs.of(w2).is_empty());
    }
}
