//! The facade's error: one variant per thing a caller can act on.

use poolipc_contract::{ContractError, FailReason, WorkerId};
use poolipc_driver::DriverError;
use poolipc_pool::{ArenaError, CacheError, PoolError, VmmShareError};
use poolipc_transport::{HandshakeError, SetupError, TransportError};

/// Why a poolipc operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The host-staging rung failed.
    #[error(transparent)]
    Staging(#[from] crate::staging::StagingError),
    /// A CUDA driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The shared pool could not be installed, attached or used.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// An import could not be made or freed.
    #[error(transparent)]
    Import(#[from] CacheError),
    /// The result arena refused: full (past its cap), a chunk that could not be made or
    /// mapped, or, on a worker, a grant naming a chunk it has not mapped or a range outside
    /// its chunk (malformed input: nothing was touched).
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// A VMM allocation lent by handle: its FD could not be imported or mapped, or, on a
    /// worker, a tensor named one the parent never shared or lay outside it (malformed
    /// input: nothing was touched).
    #[error(transparent)]
    VmmShare(#[from] VmmShareError),
    /// The connection failed: malformed frame, wrong FDs, deadline, peer gone.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Setting up the connection failed (spawn, socket, environment).
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The handshake failed; the message says which side refused what.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// A spawned worker hung up and exited before its handshake was through: its exit
    /// status, the last lines of its stderr (an import error, a missing library) and what the
    /// parent saw. (A worker that refused the handshake is [`Error::Handshake`]: its refusal
    /// says why.)
    #[error(
        "the worker exited before its handshake ({status}): {during}\n--- the worker's last lines on stderr:\n{stderr}"
    )]
    WorkerExited {
        /// How it exited (`exit status: 1`, `signal: 9 (SIGKILL)`).
        status: String,
        /// Its last lines on stderr (it goes on reaching the parent's stderr as well).
        stderr: String,
        /// What the parent saw of it (usually the transport's "peer is gone").
        during: Box<Error>,
    },
    /// The ownership contract refused an operation (a bug in the caller or the peer).
    #[error("the ownership contract refused it: {0}")]
    Contract(#[from] ContractError),
    /// The parent's IO thread stopped on a bug of its own (a panic): every job, spawn, stop
    /// and `empty_cache` that waited on it got this error, and so does every later call. The
    /// parent can do no more; drop it and make a new one.
    #[error(
        "the parent's IO thread stopped ({detail}): this Parent can do no more work; drop it and make a new one"
    )]
    IoThreadStopped {
        /// What stopped it (the panic's message).
        detail: String,
    },
    /// A call on a [`Parent`](crate::Parent) from a process forked after the parent was made:
    /// its IO thread and its workers belong to the process that made it, and do not exist in
    /// the child. Make a new `Parent` in the child (or fork before making one).
    #[error(
        "this Parent was made by process {creator} and cannot be used in process {this}, forked from it: make a new Parent in the child"
    )]
    Forked {
        /// The process that made the parent.
        creator: u32,
        /// This process.
        this: u32,
    },
    /// The job failed because its worker died, hung up or missed a deadline; what it held
    /// was released once the process was reaped. The parent goes on serving other workers.
    #[error("job failed on worker {worker}: {reason:?} ({detail})")]
    JobFailed {
        /// The worker.
        worker: WorkerId,
        /// Why, as the contract saw it.
        reason: FailReason,
        /// What the parent saw (exit status, transport error).
        detail: String,
        /// The result memory the caller's allocator made for this job, given back: nothing
        /// imports it any more. Empty after [`Parent::run_job`](crate::Parent::run_job),
        /// which frees it.
        results: Vec<poolipc_driver::DevicePtr>,
    },
    /// The simulated GPU's race checker found a violation while the job ran, made by its
    /// worker or by the parent: two accesses to the same memory that nothing ordered (a
    /// stream that did not wait for READY, DONE recorded before the last write), memory used
    /// after it was freed, a read-only input written. The report names both calls, their
    /// streams and processes, and the seed that replays the run (see
    /// [`check`](crate::check)). Only on the simulated driver.
    #[error(
        "job {} on worker {} broke the GPU's ordering rules: {report}",
        job.0,
        worker.0
    )]
    SimViolation {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: poolipc_transport::JobId,
        /// What the checker found.
        report: crate::check::RaceReport,
        /// The job's results from the shared pool or the caller's allocator, the caller's to
        /// free (as for [`Error::JobFailed`]).
        results: Vec<poolipc_driver::DevicePtr>,
        /// The job's own error, when it failed besides (the worker's report of the fault
        /// the violation caused, say); its results are listed above, not in it.
        during: Option<Box<Error>>,
    },
    /// The worker reported an error for the job.
    #[error("the worker reported: {message}")]
    Worker {
        /// What it said.
        message: String,
        /// As for [`Error::JobFailed`].
        results: Vec<poolipc_driver::DevicePtr>,
        /// The first result request of this job the parent refused, if any: what the worker
        /// most likely failed of (its message usually quotes it), typed.
        refused: Option<ResultRefusal>,
    },
    /// The parent refused a result request (allocation failed, over the limit, shutdown).
    #[error("result request refused: {0}")]
    ResultRefused(String),
    /// A tensor description that cannot be right (shape, strides, dtype and bytes disagree,
    /// a pointer outside its allocation).
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// A tensor that no rung available to this worker can carry.
    #[error("no rung can carry this tensor: {0}")]
    NoRung(String),
    /// A stream the parent cannot use for a job: `CU_STREAM_PER_THREAD` names the calling
    /// thread's default stream, which the parent's IO thread (where READY is recorded and
    /// results are allocated) cannot reach.
    #[error("invalid stream: {0}")]
    InvalidStream(String),
    /// An option that cannot work (a device listed twice, say).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A message out of place in the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// This process's CUDA context is lost: a GPU fault (under MPS, possibly another
    /// client's: a worker's), an uncorrectable ECC error, or the MPS server dropped it. Every
    /// later CUDA call in the process fails and nothing computed since can be trusted, so the
    /// [`Parent`](crate::Parent) refuses all further work; only a new process has a working
    /// context. The detail names the first failing call, whether this process is an MPS
    /// client, and the worker most likely at fault.
    #[error("{detail}")]
    ContextLost {
        /// What happened, and what to do.
        detail: String,
    },
    /// A worker id this parent does not know (or no longer serves: stopped, or lost and
    /// reaped).
    #[error("unknown worker {0}: not spawned by this parent, or already stopped or lost")]
    UnknownWorker(WorkerId),
    /// An operating system call failed.
    #[error("{call}: {source}")]
    Os {
        /// What was called.
        call: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Whether this error says the process's CUDA context is lost (see
    /// [`Error::ContextLost`]), directly or through the driver error it carries.
    #[must_use]
    pub fn is_context_lost(&self) -> bool {
        match self {
            Error::ContextLost { .. } => true,
            Error::Driver(e)
            | Error::Pool(PoolError::Driver(e))
            | Error::Import(CacheError::Driver(e))
            | Error::Arena(ArenaError::Driver(e))
            | Error::VmmShare(VmmShareError::Driver(e))
            | Error::Staging(crate::staging::StagingError::Driver(e)) => e.is_context_lost(),
            _ => false,
        }
    }
}

/// Why the parent refused a worker's result request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResultRefusal {
    /// The result arena would pass its cap ([`ResultMemory::Arena`]'s `max_bytes`) to hold
    /// the result.
    ///
    /// [`ResultMemory::Arena`]: crate::ResultMemory::Arena
    ArenaFull {
        /// The bytes asked for.
        requested: u64,
        /// The arena's bytes when it refused.
        capacity: u64,
        /// Its cap.
        max: u64,
    },
    /// Any other refusal (the allocator failed, the device is out of memory, ...), in words.
    Other(String),
}

impl std::fmt::Display for ResultRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResultRefusal::ArenaFull {
                requested,
                capacity,
                max,
            } => write!(
                f,
                "the result arena cannot hold {requested} more bytes: it has {capacity} and may grow to {max} at most"
            ),
            ResultRefusal::Other(why) => f.write_str(why),
        }
    }
}

impl ResultRefusal {
    /// The refusal an allocation error amounts to.
    pub(crate) fn of(e: &Error) -> Self {
        match e {
            Error::Arena(ArenaError::Exhausted {
                requested,
                capacity,
                max,
            }) => ResultRefusal::ArenaFull {
                requested: *requested,
                capacity: *capacity,
                max: *max,
            },
            other => ResultRefusal::Other(other.to_string()),
        }
    }
}
