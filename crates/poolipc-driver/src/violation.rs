//! Contract violations the simulation records instead of (or besides) failing a call: what a
//! real GPU would let happen silently, or fault on later; and the [`Checker`] that reads them.
//! Below both the `Driver` trait (whose `sim_checker` hands out a `Checker`) and the simulation
//! (which records them and implements the trait): neither imports the other through it.

use std::fmt;
use std::sync::Arc;

/// What rule a [`Violation`] broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u32)]
pub enum ViolationKind {
    /// The exporter freed an allocation while another process still had it imported.
    FreedWhileImported = 1,
    /// Memory was touched before the other process's last write to it was ordered before the
    /// touch (no event recorded after the write and waited on by the touching stream, or
    /// synchronized on by the host before a synchronous copy).
    UnorderedAccess = 2,
    /// An address that no live allocation, import or mapping of this process covers was
    /// touched: an import used after its free (or after its alias was freed), a freed
    /// allocation, memory never allocated. The call also fails with `ILLEGAL_ADDRESS`.
    UnmappedAccess = 3,
    /// An import was used after the exporter freed the allocation and the pool handed the
    /// memory out again: the import's generation is stale.
    StaleGeneration = 4,
    /// A pointer import over the 128-chunk limit: on hardware, the importing process dies.
    ImportOverLimit = 5,
    /// A device touched memory it was given no access to (`cuMemSetAccess`,
    /// `cuMemPoolSetAccess`).
    NoAccess = 6,
    /// The export of an allocation the exporter had already freed was imported (the pool
    /// still held the memory, so the real driver maps it; the import reads memory the pool
    /// may hand out again).
    ImportOfFreed = 7,
    /// An export was imported while the address held an allocation smaller than the range
    /// the export names: the import maps the export's range (driver 580, measured on the
    /// H200), so the importer reaches past the live allocation into whatever the pool keeps
    /// there.
    ImportBeyondAllocation = 8,
    /// Memory lent for a job ([`SimDriver::lend`](crate::sim::SimDriver::lend)) was touched on a
    /// stream not ordered after the job's stream at the lending: a stream that never waited
    /// for READY.
    NotAfterReady = 9,
    /// Memory lent read-only for a job was written.
    ReadOnlyWritten = 10,
    /// A write to memory lent for a job is not ordered before the job's DONE: written on a
    /// stream the job's stream never waited for, or after DONE was recorded.
    WriteAfterDone = 11,
}

impl ViolationKind {
    pub(super) fn from_u32(v: u32) -> Option<ViolationKind> {
        Some(match v {
            1 => ViolationKind::FreedWhileImported,
            2 => ViolationKind::UnorderedAccess,
            3 => ViolationKind::UnmappedAccess,
            4 => ViolationKind::StaleGeneration,
            5 => ViolationKind::ImportOverLimit,
            6 => ViolationKind::NoAccess,
            7 => ViolationKind::ImportOfFreed,
            8 => ViolationKind::ImportBeyondAllocation,
            9 => ViolationKind::NotAfterReady,
            10 => ViolationKind::ReadOnlyWritten,
            11 => ViolationKind::WriteAfterDone,
            _ => return None,
        })
    }
}

/// A recorded violation, machine-wide: any process attached to the simulated machine reads
/// all of them with [`SimDriver::violations`](crate::sim::SimDriver::violations).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The rule broken.
    pub kind: ViolationKind,
    /// The driver call during which it was seen.
    pub call: &'static str,
    /// The process that made the call.
    pub pid: u32,
    /// The other process involved, where there is one: the importer still holding an import
    /// ([`FreedWhileImported`](ViolationKind::FreedWhileImported)), the last writer
    /// ([`UnorderedAccess`](ViolationKind::UnorderedAccess)).
    pub other_pid: Option<u32>,
    /// The allocation's generation (machine-unique per allocation), where one is involved.
    pub generation: Option<u64>,
    /// The other access's call, where the violation is between two accesses
    /// ([`UnorderedAccess`](ViolationKind::UnorderedAccess)).
    pub other_call: Option<&'static str>,
    /// Kind-specific numbers: the chunks spanned and the limit (`ImportOverLimit`), the stale
    /// and the current generation (`StaleGeneration`), the address (`UnmappedAccess`).
    pub detail: (u64, u64),
    /// The stream of the call, as the program named it ([`SimDriver::label_stream`]; the
    /// legacy stream is `its legacy stream`), else `stream #slot`; where the violation is
    /// between two accesses.
    ///
    /// [`SimDriver::label_stream`]: crate::sim::SimDriver::label_stream
    pub stream: Option<String>,
    /// The other access's stream, named the same way.
    pub other_stream: Option<String>,
    /// The allocation, as the program named it ([`SimDriver::label_memory`]), when it did.
    ///
    /// [`SimDriver::label_memory`]: crate::sim::SimDriver::label_memory
    pub memory: Option<String>,
    /// Whether the call wrote and whether the other access wrote, where the violation is
    /// between two accesses.
    pub writes: Option<(bool, bool)>,
}

impl Violation {
    /// The violation in words, each process named by `process` (given its pid): which call on
    /// which stream touched which memory, and what it should have been ordered after.
    pub fn describe(&self, process: &dyn Fn(u32) -> String) -> String {
        let who = process(self.pid);
        let memory = self
            .memory
            .clone()
            .unwrap_or_else(|| match self.generation {
                Some(g) => format!("allocation #{g}"),
                None => "memory".to_owned(),
            });
        let verb = |w: bool| if w { "wrote" } else { "read" };
        match self.kind {
            ViolationKind::UnorderedAccess => {
                let (w, ow) = self.writes.unwrap_or((true, true));
                let other = self
                    .other_pid
                    .map_or_else(|| "a process".to_owned(), process);
                let stream = self.stream.as_deref().unwrap_or("a stream");
                let other_stream = self.other_stream.as_deref().unwrap_or("a stream");
                let other_call = self.other_call.unwrap_or("an earlier call");
                format!(
                    "unordered access: {who} {} {memory} ({} on {stream}) while {other} {} it \
                     ({other_call} on {other_stream}), and nothing orders the two: no event \
                     recorded after one was waited on before the other, no host synchronize \
                     in between",
                    verb(w),
                    self.call,
                    verb(ow),
                )
            }
            ViolationKind::UnmappedAccess => format!(
                "use after free: {who} touched {memory} at {:#x} ({} bytes) in {} after it was \
                 freed or unmapped, or where nothing was mapped",
                self.detail.0, self.detail.1, self.call
            ),
            ViolationKind::FreedWhileImported => format!(
                "{who} freed {memory} ({}) while {} still had it imported",
                self.call,
                self.other_pid
                    .map_or_else(|| "another process".to_owned(), process)
            ),
            ViolationKind::StaleGeneration => format!(
                "{who} used an import of {memory} in {} after the exporter freed it and the pool \
                 handed the memory out again",
                self.call
            ),
            ViolationKind::NoAccess => format!(
                "{who} wrote or read {memory} at {:#x} in {} without access to it (a read-only \
                 input written, or memory never given access to)",
                self.detail.0, self.call
            ),
            ViolationKind::ImportOfFreed => format!(
                "{who} imported {memory} in {} after its exporter had freed it",
                self.call
            ),
            ViolationKind::ImportBeyondAllocation => format!(
                "{who} imported a range larger than the live allocation {memory} in {}",
                self.call
            ),
            ViolationKind::NotAfterReady => {
                let verb = if self.writes.is_some_and(|w| w.0) {
                    "wrote"
                } else {
                    "read"
                };
                let stream = self.stream.as_deref().unwrap_or("a stream");
                let before = match (self.other_pid, self.other_call) {
                    (Some(pid), Some(call)) => format!(
                        "the last write to it by {} ({call} on {})",
                        process(pid),
                        self.other_stream.as_deref().unwrap_or("a stream")
                    ),
                    _ => "the lender's last writes to it".to_owned(),
                };
                format!(
                    "{who} {verb} {memory} ({} on {stream}) without waiting for READY: \
                     {stream} never waited for the job's READY event, so nothing orders the \
                     access after {before}",
                    self.call
                )
            }
            ViolationKind::ReadOnlyWritten => format!(
                "{who} wrote {memory}, lent read-only ({} on {})",
                self.call,
                self.stream.as_deref().unwrap_or("a stream"),
            ),
            ViolationKind::WriteAfterDone => format!(
                "{who} wrote {memory} ({} on {}) without ordering the write before DONE \
                 (recorded on {}): the parent may read or free it before the write ran",
                self.other_call.unwrap_or("a call"),
                self.other_stream.as_deref().unwrap_or("a stream"),
                self.stream.as_deref().unwrap_or("the job's stream"),
            ),
            ViolationKind::ImportOverLimit => format!(
                "{who} imported {} chunks of 32 MiB in {} (the limit is {}): on a GPU this \
                 process dies",
                self.detail.0, self.call, self.detail.1
            ),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(&|pid| format!("pid {pid}")))
    }
}

/// Calls that can record a violation, stored by index in shared memory.
const CALLS: &[&str] = &[
    "?",
    "cuMemFreeAsync",
    "cuMemPoolImportPointer",
    "cuMemsetD8Async",
    "cuMemsetD32Async",
    "cuMemcpyDtoH",
    "cuMemcpyHtoD",
    "cuMemcpyDtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyHtoDAsync",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuLaunchKernel",
    "(executed)",
    "cuEventRecord",
];

pub(crate) fn call_code(call: &'static str) -> u32 {
    CALLS
        .iter()
        .position(|c| *c == call)
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(0)
}

pub(crate) fn call_name(code: u32) -> &'static str {
    CALLS.get(code as usize).copied().unwrap_or("?")
}

/// What a [`Checker`] reads: a simulated machine's violation log (the simulation's machine
/// implements it).
pub(crate) trait ViolationLog: Send + Sync {
    /// The machine's id.
    fn id(&self) -> u64;
    /// How many violations were recorded so far.
    fn count(&self) -> u64;
    /// The violations recorded after the first `from`, oldest first.
    fn since(&self, from: u64) -> Vec<Violation>;
    /// How many violations some process marked reported.
    fn reported(&self) -> u64;
    /// Marks the first `upto` violations reported.
    fn mark_reported(&self, upto: u64);
}

/// The violation log of a simulated machine, as
/// [`SimDriver::checker`](crate::sim::SimDriver::checker) hands it out: cheap to clone,
/// readable from any thread.
#[derive(Clone)]
pub struct Checker {
    log: Arc<dyn ViolationLog>,
    seed: u64,
}

impl std::fmt::Debug for Checker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checker")
            .field("machine", &format_args!("{:#x}", self.log.id()))
            .field("seed", &self.seed)
            .finish()
    }
}

impl Checker {
    /// A checker on `log`, made by the process whose engine's seed is `seed`.
    pub(crate) fn new(log: Arc<dyn ViolationLog>, seed: u64) -> Checker {
        Checker { log, seed }
    }

    /// How many violations were recorded on the machine so far.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.log.count()
    }

    /// The violations recorded after the first `from`, oldest first (see
    /// [`SimDriver::violations_since`](crate::sim::SimDriver::violations_since)).
    #[must_use]
    pub fn since(&self, from: u64) -> Vec<Violation> {
        self.log.since(from)
    }

    /// How many violations some process on the machine marked reported
    /// ([`mark_reported`](Checker::mark_reported)): each is shown to the user once.
    #[must_use]
    pub fn reported(&self) -> u64 {
        self.log.reported()
    }

    /// Marks the first `upto` violations reported, for every process on the machine.
    pub fn mark_reported(&self, upto: u64) {
        self.log.mark_reported(upto);
    }

    /// The seed of the engine of the process that made this checker (see
    /// [`SimDriver::seed`](crate::sim::SimDriver::seed)).
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.seed
    }
}
