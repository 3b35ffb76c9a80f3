//! Contract violations the simulation records instead of (or besides) failing a call: what a
//! real GPU would let happen silently, or fault on later.

use std::fmt;

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
            _ => return None,
        })
    }
}

/// A recorded violation, machine-wide: any process attached to the simulated machine reads
/// all of them with [`SimDriver::violations`](super::SimDriver::violations).
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
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} in {} by pid {}", self.kind, self.call, self.pid)?;
        if let Some(o) = self.other_pid {
            write!(f, " (other pid {o})")?;
        }
        if let Some(c) = self.other_call {
            write!(f, " against {c}")?;
        }
        if let Some(g) = self.generation {
            write!(f, ", allocation generation {g}")?;
        }
        write!(f, ", detail {:#x}/{:#x}", self.detail.0, self.detail.1)
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
];

pub(super) fn call_code(call: &'static str) -> u32 {
    CALLS
        .iter()
        .position(|c| *c == call)
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(0)
}

pub(super) fn call_name(code: u32) -> &'static str {
    CALLS.get(code as usize).copied().unwrap_or("?")
}
