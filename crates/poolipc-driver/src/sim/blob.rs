//! The 64-byte blobs the simulation hands between processes (pointer exports, event
//! handles): eight words, the first two naming the machine (`state::MAGIC`, the machine id),
//! the third the kind.

/// The 64 bytes of a blob: eight little-endian words.
pub(super) fn export_blob(fields: [u64; 8]) -> [u8; 64] {
    let mut b = [0u8; 64];
    for (i, v) in fields.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    b
}

/// The eight words of a blob.
pub(super) fn blob_fields(b: &[u8; 64]) -> [u64; 8] {
    let mut f = [0u64; 8];
    for (i, v) in f.iter_mut().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i * 8..i * 8 + 8]);
        *v = u64::from_le_bytes(w);
    }
    f
}

/// A pointer export (`cuMemPoolExportPointer`).
pub(super) const BLOB_POINTER: u64 = 1;
/// An event handle (`cuIpcGetEventHandle`).
pub(super) const BLOB_EVENT: u64 = 2;
/// The block field of a pointer blob that names an address and size, not an allocation
/// (driver 580's behaviour; see [`SimConfig::blob_per_allocation`](super::SimConfig::blob_per_allocation)).
pub(super) const BLOB_BY_ADDRESS: u64 = u64::MAX;
