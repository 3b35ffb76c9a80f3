//! How the parent behaves ([`ParentConfig`]) and the bounds on what one worker may make it
//! hold ([`Bound`]).

use std::fmt;
use std::time::Duration;

use crate::message::MAX_BATCH;
use poolipc_types::ImportLimit;

#[cfg(doc)]
use {
    super::{FailReason, Parent},
    crate::message::MAX_RESULTS_PER_REQUEST,
};

/// How the parent side behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParentConfig {
    /// Which allocations may go by pool pointer.
    pub limit: ImportLimit,
    /// How long a job may go without progress from its worker. Past it, the worker is
    /// killed, its jobs fail, and what it held is released once it is reaped. Only progress
    /// starts the wait again: a result request that is granted (at least one result
    /// allocated), a `Done` that marks a handoff DONE or is the job's first, the job's first
    /// `JobError`, a `Heartbeat` from a worker that declared long jobs
    /// ([`Parent::allow_long_jobs`]). An empty result request, one refused, an empty or
    /// repeated `Done`, a repeated `JobError` move nothing: they count against
    /// [`max_idle_messages`](ParentConfig::max_idle_messages).
    pub handoff_timeout: Duration,
    /// The most results one job may ask for, over all its result requests (those a request
    /// over [`MAX_RESULTS_PER_REQUEST`] asks for are refused and not counted). Past it the
    /// worker is condemned: [`FailReason::BoundExceeded`] with [`Bound::ResultsPerJob`].
    pub max_results_per_job: u64,
    /// The most result bytes one job may ask for, over all its result requests (counted as
    /// asked, whether the facade then allocates or refuses them). Past it the worker is
    /// condemned ([`Bound::ResultBytesPerJob`]).
    pub max_result_bytes_per_job: u64,
    /// The most result bytes a worker may have asked for in its open jobs together: a job's
    /// results count until the job finished (its results handed to the caller, or freed).
    /// Past it the worker is condemned ([`Bound::ResultBytesPerWorker`]).
    pub max_result_bytes_per_worker: u64,
    /// The longest a job may stay open from its start, however busy its worker keeps it
    /// (every message about a job restarts its `handoff_timeout`, not this). Past it the
    /// worker is condemned ([`Bound::JobLifetime`]) and killed.
    pub max_job_lifetime: Duration,
    /// The most messages about one job that are not progress (see
    /// [`handoff_timeout`](ParentConfig::handoff_timeout)) a worker may send. Past it the
    /// worker is condemned ([`Bound::IdleMessages`]).
    pub max_idle_messages: u32,
    /// How long a worker has, after [`Parent::cancel`], to finish the cancelled job (its
    /// `Done` and `Ack`). Past it the worker is condemned and killed; the job fails with
    /// [`FailReason::Cancelled`] and what was lent to it is released once the worker is
    /// reaped, as for a lost worker.
    pub cancel_grace: Duration,
}

/// [`ParentConfig::max_results_per_job`]'s default: as many as a `Lend` may carry inputs
/// ([`MAX_BATCH`]), so that a worker answering each input with a result fits.
pub const DEFAULT_MAX_RESULTS_PER_JOB: u64 = MAX_BATCH as u64;
/// [`ParentConfig::max_result_bytes_per_job`]'s default: 32 GiB.
pub const DEFAULT_MAX_RESULT_BYTES_PER_JOB: u64 = 32 << 30;
/// [`ParentConfig::max_result_bytes_per_worker`]'s default: 48 GiB.
pub const DEFAULT_MAX_RESULT_BYTES_PER_WORKER: u64 = 48 << 30;
/// [`ParentConfig::max_job_lifetime`]'s default: 4 hours.
pub const DEFAULT_MAX_JOB_LIFETIME: Duration = Duration::from_secs(4 * 3600);
/// [`ParentConfig::max_idle_messages`]'s default: 32 (an honest worker sends a few at most:
/// a refused request and its `JobError`, say).
pub const DEFAULT_MAX_IDLE_MESSAGES: u32 = 32;
/// [`ParentConfig::cancel_grace`]'s default: 3 s.
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(3);

impl Default for ParentConfig {
    fn default() -> Self {
        ParentConfig {
            limit: ImportLimit::default(),
            handoff_timeout: Duration::from_secs(30),
            max_results_per_job: DEFAULT_MAX_RESULTS_PER_JOB,
            max_result_bytes_per_job: DEFAULT_MAX_RESULT_BYTES_PER_JOB,
            max_result_bytes_per_worker: DEFAULT_MAX_RESULT_BYTES_PER_WORKER,
            max_job_lifetime: DEFAULT_MAX_JOB_LIFETIME,
            max_idle_messages: DEFAULT_MAX_IDLE_MESSAGES,
            cancel_grace: DEFAULT_CANCEL_GRACE,
        }
    }
}

/// A bound on what one worker may make the parent hold ([`FailReason::BoundExceeded`]).
/// Exceeding one condemns that worker alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bound {
    /// [`ParentConfig::max_results_per_job`].
    ResultsPerJob,
    /// [`ParentConfig::max_result_bytes_per_job`].
    ResultBytesPerJob,
    /// [`ParentConfig::max_result_bytes_per_worker`].
    ResultBytesPerWorker,
    /// [`ParentConfig::max_job_lifetime`].
    JobLifetime,
    /// The facade's bound on DONE events a worker holds open (its own, enforced outside the
    /// contract: [`Parent::condemn_for`]).
    OpenDoneEvents,
    /// The facade's bound on the frames it keeps aside while host staging waits (enforced
    /// outside the contract: [`Parent::condemn_for`]).
    StagingBacklog,
    /// [`ParentConfig::max_idle_messages`]: messages about a job that moved nothing.
    IdleMessages,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::ResultsPerJob => "results per job",
            Bound::ResultBytesPerJob => "result bytes per job",
            Bound::ResultBytesPerWorker => "result bytes per worker",
            Bound::JobLifetime => "job lifetime",
            Bound::OpenDoneEvents => "open DONE events per worker",
            Bound::StagingBacklog => "staging backlog",
            Bound::IdleMessages => "messages without progress per job",
        })
    }
}
